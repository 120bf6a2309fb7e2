"""Reasons are frozen typed values; the plan JSON's dict is rendered from them."""

from __future__ import annotations

import dataclasses

import pytest

from cgbuild.core.codes import Code
from cgbuild.plan import reasons


def test_a_reason_takes_a_plan_code_member_and_is_frozen() -> None:
    with pytest.raises(ValueError, match="not a plan reason code"):
        reasons.Reason("moved-somehow", "?", True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a plan reason code"):
        reasons.Reason("axis-moved", "?", True)  # type: ignore[arg-type]  # its string, not the member
    with pytest.raises(ValueError, match="not a plan reason code"):
        reasons.Reason(Code.WEIGHTS_UNTIED, "?", True)  # registered, but adopt's, not the plan's
    assert reasons.Reason(Code.AXIS_MOVED, "?", True).code is Code.AXIS_MOVED
    r = reasons.file_moved("pkg/model.py", None, "ab" * 32, root=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.root = False  # type: ignore[misc]
    assert r.propagated().root is False and r.root is True


def test_json_names_what_moved_and_omits_what_is_absent() -> None:
    assert reasons.file_moved("pkg/model.py", None, "ab" * 32, root=True).to_json() == {
        "code": "trace-input-moved",
        "detail": "pkg/model.py added",
        "root": True,
        "component": "pkg/model.py",
        "new": "abababababab",
    }
    dist = reasons.version_moved("diffusers", "0.30.0", None, root=False).to_json()
    assert dist["detail"] == "diffusers 0.30.0 → absent" and dist["old"] == "0.30.0"
    setting = reasons.setting_moved("family.f.config.unet", {"heads": 8}, {"heads": 16}, root=True)
    assert setting.detail == 'family.f.config.unet changed ({"heads":8} → {"heads":16})'
    assert reasons.axis_moved("toolchain", "3.6.0", "3.7.0", root=True, component="triton").detail == (
        "toolchain: triton 3.6.0 → 3.7.0"
    )


def test_a_workers_typed_refusal_keeps_its_code_as_the_plans_reason() -> None:
    """A held worker that cannot build on this host says `wrong-host`: the plan shows that, not a
    relabelled `trace-failed`; a code no plan reason has is kept in the detail."""
    held = reasons.trace_refused({"ok": False, "code": "wrong-host", "detail": "no /no/such/c++"})
    assert (held.code, held.detail, held.root) == ("wrong-host", "no /no/such/c++", True)
    odd = reasons.trace_refused({"ok": False, "code": "seal-failed", "detail": "x"})
    assert (odd.code, odd.detail) == ("trace-failed", "seal-failed: x")
