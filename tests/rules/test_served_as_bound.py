"""Never a wrong answer: a compiled call runs only on inputs laid out as traced and on the tensors,
tree and configuration the package was bound to (rules/bound.py, rules/configured.py).

Every test compares a served call with the live module's own eager output, after a change a
user makes; each would be compiled and wrong without its guard. Uses the session's real mint
of the tiny MLP (`art_a`, support/minted.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from cgbuild_rules.adopt import AdoptRefused, adopt, fit
from support.artifacts import edited
from support.minted import tiny

from cgbuild.protocol.contract import CallContract
from cgbuild.store.seal import read_metadata

pytestmark = pytest.mark.slow


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def views() -> dict[str, torch.Tensor]:
    """[1, 8, 64] inputs laid out as a caller hands them: none of them contiguous and aligned."""
    torch.manual_seed(7)
    return {
        "expanded": torch.randn(1, 1, 64).expand(1, 8, 64),  # stride 0, as diffusers' t.expand(b)
        "transposed": torch.randn(1, 64, 8).transpose(1, 2),
        "sliced": torch.randn(1, 8, 128)[..., :64],
        "offset": torch.randn(8 * 64 + 1)[1:].view(1, 8, 64),  # contiguous, 4 bytes off alignment
    }


@pytest.mark.parametrize("kind", list(views()))
def test_an_input_laid_out_otherwise_than_traced_is_served_on_a_copy(
    art_a: Path, tmp_path_factory: pytest.TempPathFactory, kind: str
) -> None:
    m = tiny(tmp_path_factory)
    served = adopt(art_a, m)
    x = views()[kind]
    assert not (x.is_contiguous() and x.data_ptr() % 16 == 0)
    with torch.no_grad():
        close(served(x), m(x))
    assert served.counters == {"compiled": 1, "restrided": 1}
    with torch.no_grad():
        close(served(x.contiguous().clone()), m(x))
    assert served.counters == {"compiled": 2, "restrided": 1}  # a traced layout is not copied


def test_the_contract_records_the_traced_strides_outside_the_digest(art_a: Path) -> None:
    meta = read_metadata(art_a)
    (leaf,) = meta["graph"]["contract"]["inputs"][0]["leaves"]
    assert leaf["stride"] == [512, 64, 1]
    copied: list[str] = []
    x = torch.randn(1, 64, 8).transpose(1, 2)
    why, (laid,) = fit(CallContract.from_json(meta["graph"]["contract"]), (x,), {}, copied)
    assert why is None and copied == ["x"] and laid.stride() == (512, 64, 1) and torch.equal(laid, x)


def test_replaced_weights_are_re_bound_by_the_next_call(
    art_a: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A new Parameter, a `.data` assignment, a `load_state_dict(assign=True)`: each re-bound
    by the call that follows it, without `rebind()`."""
    m = tiny(tmp_path_factory)
    served = adopt(art_a, m)
    x = torch.randn(1, 8, 64)
    with torch.no_grad():
        close(served(x), m(x))
        m.fc2.weight = torch.nn.Parameter(torch.randn_like(m.fc2.weight))
        close(served(x), m(x))
        m.fc1.weight.data = torch.randn_like(m.fc1.weight)
        close(served(x), m(x))
        m.load_state_dict({k: v * 0.5 for k, v in m.state_dict().items()}, assign=True)
        close(served(x), m(x))
        m.fc1.weight.add_(1.0)  # in place: the package reads the storage, nothing to re-bind
        close(served(x), m(x))
    assert served.counters == {"compiled": 5, "rebound": 3}


def test_a_move_the_package_cannot_read_is_refused_by_name_and_re_armed_when_undone(
    art_a: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`.data` laid out column-major (the same values, as a `.t().contiguous().t()` leaves it):
    eager is right, the package would read it row-major; refused until laid out as bound."""
    m = tiny(tmp_path_factory)
    served = adopt(art_a, m)
    x = torch.randn(1, 8, 64)
    with torch.no_grad():
        m.fc1.weight.data = m.fc1.weight.data.t().contiguous().t()
        close(served(x), m(x))
        why = served.last_reason
        assert why is not None and why.code == "module-changed"
        assert why.detail.startswith("fc1.weight holds another storage")
        assert "weights-mismatch: fc1.weight: stride [1, 32], artifact takes [64, 1]" in why.detail
        m.to(torch.float64)
        close(served(x.double()), m(x.double()))  # moved again: re-tried, still refused
        why = served.last_reason
        assert why is not None and why.code == "module-changed" and "dtype float64" in why.detail
        m.to(torch.float32)
        m.fc1.weight.data = m.fc1.weight.data.contiguous()
        close(served(x), m(x))
    assert served.counters == {"eager:module-changed": 2, "rebound": 1, "compiled": 1}


class Wrapped(torch.nn.Module):
    """What an unfused adapter does to a layer: the layer moves to `base_layer`, and the
    wrapper adds its own term."""

    def __init__(self, base: torch.nn.Linear) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_B = torch.nn.Linear(base.in_features, base.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(x)


def test_a_submodule_swapped_for_a_wrapper_is_refused_and_re_armed_once_restored(
    art_a: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    m = tiny(tmp_path_factory)
    served = adopt(art_a, m)
    x = torch.randn(1, 8, 64)
    fc1 = m.fc1
    with torch.no_grad():
        m.fc1 = Wrapped(fc1)
        close(served(x), m(x))
        why = served.last_reason
        assert why is not None and why.code == "module-changed"
        assert why.detail.startswith("fc1 was replaced by a test_served_as_bound.Wrapped")
        assert "fuse_lora() then unload_lora()" in why.detail  # the fix, named
        close(served(x), m(x))  # still changed: still eager, not retried
        m.fc1 = fc1
        close(served(x), m(x))
    assert served.counters == {"eager:module-changed": 2, "rebound": 1, "compiled": 1}


def test_rebind_re_arms_an_artifact_refused_at_adopt(
    art_a: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    m = tiny(tmp_path_factory)
    fc2 = m.fc2
    m.fc2 = Wrapped(fc2)
    served = adopt(art_a, m)
    (refusal,) = served.refusals.values()
    assert refusal.code == "weights-missing"
    assert "fc2: an adapter layer (PEFT LoRA) wraps it" in refusal.detail
    m.fc2 = fc2
    served.rebind()
    assert served.refusals == {}
    x = torch.randn(1, 8, 64)
    with torch.no_grad():
        close(served(x), m(x))
    assert served.counters == {"compiled": 1}


def test_a_same_class_submodule_swap_is_re_bound(
    art_a: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    m = tiny(tmp_path_factory)
    served = adopt(art_a, m)
    x = torch.randn(1, 8, 64)
    with torch.no_grad():
        m.fc2 = torch.nn.Linear(32, 4).eval()
        close(served(x), m(x))
    assert served.counters == {"compiled": 1, "rebound": 1}


@pytest.mark.parametrize("change", ["hook", "pre-hook", "forward", "train"])
def test_hooks_overrides_and_train_mode_are_refused_until_undone(
    art_a: Path, tmp_path_factory: pytest.TempPathFactory, change: str
) -> None:
    m = tiny(tmp_path_factory)
    served = adopt(art_a, m)
    x = torch.randn(1, 8, 64)
    undo: Any
    if change == "hook":
        undo = m.fc1.register_forward_hook(lambda _m, _i, out: out * 2).remove
    elif change == "pre-hook":
        undo = m.fc2.register_forward_pre_hook(lambda _m, args: (args[0] + 1,)).remove
    elif change == "forward":
        m.fc1.forward = lambda t: torch.nn.functional.linear(t, m.fc1.weight) * 3  # type: ignore[method-assign]
        undo = lambda: m.fc1.__dict__.pop("forward")  # noqa: E731
    else:
        m.train()  # no dropout here, but a module in train mode is not what was traced
        undo = m.eval
    with torch.no_grad():
        close(served(x), m(x))
        assert served.last_reason is not None and served.last_reason.code == "module-changed"
        undo()
        close(served(x), m(x))
    assert served.counters["compiled"] == 1 and served.counters["rebound"] == 1
    assert served.counters["eager:module-changed"] == 1


def test_a_strict_server_refuses_a_changed_module_by_name(
    art_a: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    m = tiny(tmp_path_factory)
    served = adopt(art_a, m, strict=True)
    m.fc1.register_forward_hook(lambda _m, _i, out: out)
    with (
        pytest.raises(
            AdoptRefused,
            match=r"module-changed: fc1 has 1 forward hook\(s\), 0 pre-hook\(s\), traced with 0 forward",
        ),
        torch.no_grad(),
    ):
        served(torch.randn(1, 8, 64))


def test_a_configuration_value_that_moved_is_refused_by_name(
    art_a: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    m = tiny(tmp_path_factory)
    m.fc1.out_features = 31  # what the module says of itself, not what its tensors say
    served = adopt(art_a, m)
    (refusal,) = served.refusals.values()
    assert refusal.code == "config-drift" and refusal.detail == "fc1.out_features 32 → 31"
    m.fc1.out_features = 32
    served.rebind()
    assert served.refusals == {} and served.unverified == {}
    x = torch.randn(1, 8, 64)
    with torch.no_grad():
        close(served(x), m(x))
    assert served.counters == {"compiled": 1}


def test_an_artifact_sealed_without_the_records_adopts_marked_unverified(
    art_a: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    def strip(meta: dict[str, Any]) -> None:
        del meta["module"]
        for spec in meta["graph"]["contract"]["inputs"]:
            for leaf in spec["leaves"]:
                leaf.pop("stride", None)

    old = edited(art_a, tmp_path / "old.tar.gz", strip)
    m = tiny(tmp_path_factory)
    m.fc1.out_features = 31  # not seen: nothing recorded to compare it with
    served = adopt(old, m)
    assert served.refusals == {} and list(served.unverified.values()) == [("config", "structure")]
    x = torch.randn(1, 64, 8).transpose(1, 2)
    with torch.no_grad():
        close(served(x), m(x))  # no recorded strides: held to contiguous, so copied
    assert served.counters == {"compiled": 1, "restrided": 1}


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda m: m.update(module=[]), "module: not an object"),
        (lambda m: m["module"]["tree"].update({"fc1": {"class": 3}}), "module.tree.fc1.class"),
        (
            lambda m: m["graph"]["contract"]["inputs"][0]["leaves"][0].update(stride=[1, 2]),
            "graph.contract.inputs[0].leaves[0].stride: not one stride per dimension",
        ),
    ],
)
def test_malformed_records_are_refused_as_bad_metadata(
    art_a: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, edit: Any, field: str
) -> None:
    bad = edited(art_a, tmp_path / "bad.tar.gz", edit)
    (refusal,) = adopt(bad, tiny(tmp_path_factory)).refusals.values()
    assert refusal.code == "bad-metadata" and field in refusal.detail


def test_traced_strides_this_call_cannot_evaluate_are_refused(art_a: Path) -> None:
    """A recorded stride naming a symbol the call does not bind has no layout to copy into."""
    contract = read_metadata(art_a)["graph"]["contract"]
    contract["inputs"][0]["leaves"][0]["stride"] = ["S0", 64, 1]
    contract["symbols"] = [{"name": "S0", "min": 2, "max": 8}]
    why, _ = fit(CallContract.from_json(contract), (torch.randn(1, 8, 64),), {})
    assert why is not None and why.code == "stride" and "['S0', 64, 1] are not checkable" in why.detail


def test_a_global_forward_hook_is_refused_until_removed(
    art_a: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """torch's process-wide module hooks run in every submodule's eager call, never in the package."""
    m = tiny(tmp_path_factory)
    served = adopt(art_a, m)
    x = torch.randn(1, 8, 64)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda _m, _i, out: out)
    try:
        with torch.no_grad():
            close(served(x), m(x))
        assert served.last_reason is not None and "global forward hooks" in served.last_reason.detail
    finally:
        handle.remove()
    with torch.no_grad():
        close(served(x), m(x))
    assert served.counters == {"eager:module-changed": 1, "rebound": 1, "compiled": 1}
