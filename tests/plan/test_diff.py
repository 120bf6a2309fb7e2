"""Plan files given to `cgbuild diff` and `mint --plan` (hostile until checked: exit 2, never a
traceback), and what each tag of a rendered diff tells a reviewer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cgbuild.cli.main import main
from cgbuild.config.labels import parse_label
from cgbuild.core.errors import UserError
from cgbuild.exec.mint import recorded_plan_keys
from cgbuild.plan.diff import diff_plans, load_plan, render
from cgbuild.plan.entries import Plan

LABEL = "//toy/mlp/8x64-b1@fp32:cpu"
KEY = "ab" * 32


def entry(label: str = LABEL, **fields: Any) -> dict[str, Any]:
    """One target as `plan --json` writes it."""
    tid = parse_label(label)
    return {
        "label": label,
        "family": tid.family,
        "module": tid.module,
        "graph_class": tid.graph_class,
        "layout": tid.layout,
        "stamp": f"{tid.family}.{tid.module}@1+plain.fp32@1",
        "sm": tid.sm,
        "skus": ["cpu"],
        "envelope": {},
        "key": KEY,
        "status": "mint",
        "axes": {},
        "reasons": [],
        "trace_inputs": "t" * 64,
        **fields,
    }


def a_plan(*targets: dict[str, Any], **target: Any) -> dict[str, Any]:
    """A plan as `plan --json` writes it: `targets`, or one target with the fields `target` sets."""
    return {
        "schema": "cgbuild.plan/1",
        "workspace": {"cgfile": "Cgfile", "store": ".cgbuild/store"},
        "toolchains": {
            "cpu": {
                "fold": "f",
                "source": "probe",
                "components": {"torch": {"dist": "torch", "version": "2", "digest": "d"}},
            }
        },
        "targets": list(targets) or [{**entry(), **target}],
    }


def typed(doc: dict[str, Any]) -> Plan:
    return Plan.from_json(doc, "plan.json")


def write(tmp_path: Path, doc: Any, name: str = "plan.json") -> Path:
    path = tmp_path / name
    path.write_bytes(doc if isinstance(doc, bytes) else json.dumps(doc).encode())
    return path


def test_a_well_formed_plan_diffs_and_feeds_mint(tmp_path: Path) -> None:
    path = write(tmp_path, a_plan())
    plan = load_plan(str(path))
    assert diff_plans(plan, plan)["entries"] == []
    assert plan == typed(plan.to_json())  # what a plan writes, it reads back
    assert recorded_plan_keys(str(path)) == {LABEL: KEY}


@pytest.mark.parametrize(
    ("doc", "field", "message"),
    [
        ({"schema": "cgbuild.plan/1", "targets": [{}]}, "targets[0].label", "missing"),
        ({"schema": "cgbuild.plan/1", "targets": [5]}, "targets[0]", "an object"),
        (a_plan(label=LABEL + "\n"), "targets[0].label", "bad label"),
        (a_plan(label="//toy/mlp"), "targets[0].label", "selector"),
        (a_plan(family="other"), "targets[0].family", "from the label"),
        (a_plan(sm="sm_90"), "targets[0].sm", "from the label"),
        (a_plan(key="../../etc"), "targets[0].key", "64 hex"),
        (a_plan(key=7), "targets[0].key", "64 hex"),
        (
            {**a_plan(), "targets": [{k: v for k, v in entry().items() if k != "key"}]},
            "targets[0].key",
            "null or",
        ),
        (a_plan(status=[]), "targets[0].status", "string"),
        (a_plan(axes=[]), "targets[0].axes", "object"),
        (a_plan(status="stale"), "targets[0].status", "not a status"),
        (a_plan(reasons={}), "targets[0].reasons", "array"),
        (
            a_plan(reasons=[{"code": "x", "detail": "", "root": True}]),
            "targets[0].reasons[0].code",
            "reason code",
        ),
        (
            a_plan(reasons=[{"code": "new-target", "detail": 3, "root": True}]),
            "targets[0].reasons[0]",
            "detail",
        ),
        (
            a_plan(reasons=[{"code": "new-target", "detail": "", "root": 1}]),
            "targets[0].reasons[0]",
            "boolean",
        ),
        (a_plan(skus="cpu"), "targets[0].skus", "SKU names"),
        (a_plan(envelope=[]), "targets[0].envelope", "object"),
        (a_plan(module=None), "targets[0].module", "string"),
        ({**a_plan(), "workspace": {"cgfile": 3}}, "workspace", "strings"),
        (a_plan(axes={"graph": 3}), "targets[0].axes.graph", "object"),
        ({**a_plan(), "toolchains": []}, "toolchains", "object"),
        (
            {**a_plan(), "toolchains": {"cpu": {"components": {"torch": {"v": 1.5}}}}},
            "toolchains.cpu.components.torch",
            "float",
        ),
        ({**a_plan(), "toolchains": {"cpu": {"components": {}}}}, "toolchains.cpu.components", "non-empty"),
        ({**a_plan(), "targets": a_plan()["targets"] * 2}, "targets[1].label", "duplicate"),
        ({"schema": "cgbuild.plan/2", "targets": []}, "schema", "not a cgbuild plan"),
    ],
)
def test_malformed_plans_name_the_field(tmp_path: Path, doc: Any, field: str, message: str) -> None:
    path = write(tmp_path, doc)
    with pytest.raises(UserError) as info:
        load_plan(str(path))
    assert (info.value.file, info.value.field) == (str(path), field), str(info.value)
    assert message in info.value.message


@pytest.mark.parametrize(
    ("raw", "line", "message"),
    [
        (b'{"schema": "cgbuild.plan/1",\n "targets": ["\xff"]}', 2, "not UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, None, "nested deeper"),
        (json.dumps({"a": json.loads("[" * 70 + "]" * 70)}).encode(), None, "nested deeper"),
        (b'{"schema": "cgbuild.plan/1", "targets": [], "x": Infinity}', None, "Infinity is not JSON"),
        (b'{"schema": "cgbuild.plan/1",\n "targets": [}', 2, "not JSON"),
    ],
)
def test_unreadable_plans(tmp_path: Path, raw: bytes, line: int | None, message: str) -> None:
    with pytest.raises(UserError) as info:
        load_plan(str(write(tmp_path, raw)))
    assert info.value.line == line and message in info.value.message, str(info.value)


def test_cli_diff_and_mint_plan_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = write(tmp_path, a_plan(), "good.json")
    bad = write(tmp_path, {"schema": "cgbuild.plan/1", "targets": [{}]}, "bad.json")
    assert main(["diff", str(good), str(bad)]) == 2
    assert "bad.json: field 'targets[0].label'" in capsys.readouterr().err
    assert main(["diff", str(good), str(tmp_path)]) == 2  # a folder
    assert main(["diff", str(good), str(tmp_path / "no\x00such")]) == 2
    # mint --plan reads the plan before any workspace or trace: no Cgfile is needed to refuse it
    assert main(["-C", str(tmp_path), "mint", "--plan", str(bad)]) == 2
    assert "targets[0].label" in capsys.readouterr().err


def test_render_escapes_what_a_plan_holds(tmp_path: Path) -> None:
    base = a_plan()
    head = a_plan(key="cd" * 32)
    head["toolchains"]["cpu"]["components"]["torch"]["version"] = "3\x1b[2J"
    base["targets"][0]["axes"] = {"toolchain": {"fold": "x"}}
    head["targets"][0]["axes"] = {"toolchain": {"fold": "y"}}
    text = render(diff_plans(typed(base), typed(head)), "text")
    assert "\x1b" not in text and "\\x1b[2J" in text


def _keyed(label: str, key: str) -> dict[str, Any]:
    axes = {"graph": {"digest": key}, "sm": {"sm": "cpu"}, "toolchain": {"fold": "f"}, "layout": None}
    return entry(label, key=key, axes=axes)


A, B = "//toy/a/8x64-b1@fp32:cpu", "//toy/b/8x64-b1@fp32:cpu"


def test_brand_new_targets_are_tagged_mint_and_moved_ones_re_mint() -> None:
    base = typed(a_plan(_keyed(A, "1" * 64)))
    head = typed(a_plan(_keyed(A, "2" * 64), _keyed(B, "3" * 64)))
    text = render(diff_plans(base, head), "text")
    assert f"  moved    {A} [re-mint]: graph: " in text
    assert f"  added    {B} [mint]: new target" in text
    markdown = render(diff_plans(base, head), "markdown")
    assert f"| added (mint) | `{B}` |" in markdown and f"| moved (re-mint) | `{A}` |" in markdown


def test_a_quant_only_layout_move_names_the_stamp_and_the_digest_that_moved() -> None:
    """Only the quant digest moved (the topology is the same tensors): both stamps, and the quant
    digests on each side, not the first identity field of the axis twice."""
    topo, q1, q2 = "T" * 64, "1" * 64, "2" * 64
    base = a_plan(axes={"layout": {"stamp": "toy.mlp@1+plain.fp32@1", "topology": topo, "quant": q1}})
    head = a_plan(
        key="cd" * 32, axes={"layout": {"stamp": "toy.mlp@1+int8-rowwise@1", "topology": topo, "quant": q2}}
    )
    (moved,) = diff_plans(typed(base), typed(head))["entries"]
    assert moved["axes"] == ["layout"]
    assert moved["detail"] == (
        "layout: toy.mlp@1+plain.fp32@1 (quant 111111111111) → toy.mlp@1+int8-rowwise@1 (quant 222222222222)"
    )
