"""The served module is the traced module: what the live module holds is compared with the module
as traced (sealed at mint, `cgbuild_rules.traced`), never with itself as adopted.

Each case is a change a user makes BEFORE adopt (a hook, an override, a shadowing attribute, a
patched class, train mode, torch's global hooks) or after it where the per-call watch must see
it, and a call mode the program cannot honour (autocast, grad). Every one would be served
compiled and wrong without its guard; each test compares the served call with the live module's
own eager output and names the refusal. Uses the session's real mint of the tiny MLP (`art_a`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from cgbuild_rules.adopt import adopt
from support.artifacts import edited
from support.minted import tiny
from torch import nn
from torch.nn.modules import module as torch_module

from cgbuild.store.seal import read_metadata

pytestmark = pytest.mark.slow


def x() -> torch.Tensor:
    return torch.randn(1, 8, 64, generator=torch.Generator().manual_seed(3))


def eager_and_served(served: Any, m: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return type(m).forward(m, x()), served(x())


def doubled(_m: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
    return out * 2


def halved_input(_m: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return (args[0] * 0.5,)


def _hook(m: nn.Module) -> Callable[[], None]:
    return m.fc1.register_forward_hook(doubled).remove


def _pre_hook(m: nn.Module) -> Callable[[], None]:
    return m.fc2.register_forward_pre_hook(halved_input).remove


def _override(m: nn.Module) -> Callable[[], None]:
    fc1 = m.fc1
    fc1.forward = lambda t: nn.functional.linear(t, fc1.weight) * 3  # type: ignore[method-assign]
    return lambda: delattr(fc1, "forward")


def _shadow(m: nn.Module) -> Callable[[], None]:
    m.fc2.__dict__["weight"] = nn.Parameter(torch.randn_like(m.fc2.weight))
    return lambda: m.fc2.__dict__.__delitem__("weight")


def _global_hook(_m: nn.Module) -> Callable[[], None]:
    return torch_module.register_module_forward_hook(lambda mod, i, o: o + 1 if mod is not _m else o).remove


def _train(m: nn.Module) -> Callable[[], None]:
    m.fc1.train()
    return lambda: setattr(m.fc1, "training", False)


CHANGES: dict[str, tuple[Callable[[nn.Module], Callable[[], None]], str]] = {
    "forward-hook": (_hook, "fc1 has 1 forward hook(s), 0 pre-hook(s), traced with 0 forward hook(s)"),
    "pre-hook": (_pre_hook, "fc2 has 0 forward hook(s), 1 pre-hook(s), traced with"),
    "instance-forward": (_override, "fc1 has 0 forward hook(s), 0 pre-hook(s) and an instance forward"),
    "shadowed-weight": (_shadow, "fc2.weight is shadowed by an instance attribute"),
    "global-hook": (_global_hook, "sees torch's global forward hooks"),
    "train-mode": (_train, "fc1 is in train mode, traced in the other: call .eval()"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_made_before_adopt_is_refused_by_name_then_served_once_undone(
    art_a: Path, tmp_path_factory: pytest.TempPathFactory, change: str
) -> None:
    """Adopted with the change already in place, the module is not the one traced: every call is
    served eager (and equal to eager), named; once the change is undone `rebind()` re-arms it."""
    m = tiny(tmp_path_factory)
    make, detail = CHANGES[change]
    undo = make(m)
    try:
        served = adopt(art_a, m)
        (refusal,) = served.refusals.values()
        assert refusal.code == "module-changed" and detail in refusal.detail, refusal
        changed, got = eager_and_served(served, m)
        assert served.counters == {"eager:module-changed": 1}
        torch.testing.assert_close(got, changed)
    finally:
        undo()
    served.rebind()
    want, got = eager_and_served(served, m)
    assert served.counters["compiled"] == 1 and not served.refusals
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if change != "train-mode":  # the tiny MLP computes alike in both modes; the rest matter
        assert not torch.allclose(got, changed), "the program on these weights is what eager computed"


@pytest.mark.parametrize("change", ["shadowed-weight", "pre-hook"])
def test_a_change_made_after_adopt_is_seen_by_the_next_call(
    art_a: Path, tmp_path_factory: pytest.TempPathFactory, change: str
) -> None:
    m = tiny(tmp_path_factory)
    served = adopt(art_a, m)
    eager_and_served(served, m)
    undo = CHANGES[change][0](m)
    want, got = eager_and_served(served, m)
    torch.testing.assert_close(got, want)
    assert served.counters == {"compiled": 1, "eager:module-changed": 1}, served.counters
    undo()
    want, got = eager_and_served(served, m)
    assert served.counters["compiled"] == 2 and served.counters["rebound"] == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_patched_class_forward_is_seen_before_and_after_adopt(
    art_a: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`nn.Linear.forward` replaced (a library patching a class): eager runs the patch."""
    stock = nn.Linear.forward

    def patched(self: nn.Linear, t: torch.Tensor) -> torch.Tensor:
        return stock(self, t) + 1

    m = tiny(tmp_path_factory)
    served = adopt(art_a, m)
    monkeypatch.setattr(nn.Linear, "forward", patched)
    want, got = eager_and_served(served, m)
    torch.testing.assert_close(got, want)
    assert served.counters == {"eager:module-changed": 1}
    assert "its class's forward was replaced" in str(served.last_reason)
    again = adopt(art_a, tiny(tmp_path_factory))  # adopted with the patch in place
    (refusal,) = again.refusals.values()
    assert refusal.code == "module-changed" and refusal.detail.startswith("fc1 runs ")
    assert "patched:patched, traced as torch.nn.modules.linear.Linear.forward:forward" in refusal.detail
    monkeypatch.undo()
    want, got = eager_and_served(served, m)
    assert served.counters["compiled"] == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_an_instance_forward_of_the_module_itself_stays_what_eager_runs(
    art_a: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`install()` over a forward the caller set: the caller's forward serves every call, named;
    `release()` gives it back."""
    m = tiny(tmp_path_factory)

    def mine(t: torch.Tensor) -> torch.Tensor:
        return type(m).forward(m, t) * -1

    m.forward = mine  # type: ignore[method-assign]
    served = adopt(art_a, m).install()
    with torch.no_grad():
        got, want = m(x()), type(m).forward(m, x()) * -1
    torch.testing.assert_close(got, want)
    assert served.counters == {"eager:module-changed": 1}
    assert "set before adopt" in str(served.last_reason)
    served.release()
    assert m.__dict__["forward"] is mine


def test_autocast_is_served_eager_as_eager_computes_it(
    art_a: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    m = tiny(tmp_path_factory)
    served = adopt(art_a, m)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = served(x()), type(m).forward(m, x())
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)
    assert served.counters == {"eager:autocast": 1}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        served(x())
    assert served.counters["compiled"] == 1


def test_grad_is_served_eager_with_its_autograd(
    art_a: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A direct call with grad on and weights that require grad: eager's output carries autograd,
    and backward reaches the weights; frozen weights and an input that requires grad alike."""
    m = tiny(tmp_path_factory)
    assert all(p.requires_grad for p in m.parameters())
    served = adopt(art_a, m)
    out = served(x())
    assert out.requires_grad and served.counters == {"eager:grad": 1}
    out.sum().backward()
    assert m.fc1.weight.grad is not None
    m.requires_grad_(False)
    assert not served(x()).requires_grad and served.counters["compiled"] == 1
    leaf = x().requires_grad_()
    assert served(leaf).requires_grad and served.counters["eager:grad"] == 2


def test_the_traced_structure_is_sealed_and_checked_for_its_shape(art_a: Path, tmp_path: Path) -> None:
    record = read_metadata(art_a)["module"]
    assert record["global_hooks"] is False
    assert record["tree"]["fc1"] == {
        "class": "torch.nn.modules.linear.Linear",
        "hyper": record["tree"]["fc1"]["hyper"],
        "forward": "torch.nn.modules.linear.Linear.forward:forward",
        "hooks": [0, 0],
        "override": False,
        "shadows": [],
        "training": False,
    }

    def bad(meta: dict[str, Any]) -> None:
        meta["module"]["tree"]["fc1"]["hooks"] = ["1", 0]

    served = adopt(edited(art_a, tmp_path / "bad.tar.gz", bad), nn.Linear(1, 1))
    (refusal,) = served.refusals.values()
    assert refusal.code == "bad-metadata" and "module.tree.fc1.hooks[0]" in refusal.detail


class _Stock(nn.Linear):
    """A class an entry's substitute stands for."""


class _EntryLinear(nn.Linear):
    """An entry's substitute: what the trace held in the stock class's place."""


def test_another_class_is_named_first_unless_it_is_the_declared_stock_class() -> None:
    """A replaced submodule is named as replaced, before its train mode or its new children; the
    stock class a declared substitute stands for is accepted in its slot, and only that class."""
    from cgbuild_rules import traced

    model = nn.Sequential(_EntryLinear(4, 4)).eval()
    record = traced.snapshot(model)
    wrapper = nn.Sequential(nn.Linear(4, 4))  # in train mode, with a child the trace never had
    model[0] = wrapper
    moved = traced.changed(record, model)
    assert moved is not None and str(moved).startswith(
        "0 was replaced by a torch.nn.modules.container.Sequential"
    )
    model[0] = _Stock(4, 4).eval()
    entry, stock = (traced.qualified(c) for c in (_EntryLinear, _Stock))
    assert traced.changed(record, model, substitutes={entry: stock}) is None
    assert "was replaced by" in str(traced.changed(record, model))
    model[0] = nn.Linear(4, 4).eval()
    assert "was replaced by a torch.nn.modules.linear.Linear" in str(
        traced.changed(record, model, substitutes={entry: stock})
    )
