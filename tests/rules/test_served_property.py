"""Property: every served call is either compiled and within the verify tolerance of the live
module's own eager output, or refused by a named code (served eager, equal to eager; with
`strict`, raising `AdoptRefused`). Zero compiled-and-wrong.

test_served_as_bound.py checks each guard once, by hand; here hypothesis composes what a user
does to a live module between calls (input layouts, replaced or re-laid tensors, dtype moves,
swapped, wrapped or hooked submodules, train/eval, configuration values, explicit re-binds) in
random orders, so that a guard that holds alone but not after another change is found. Each case
is a fresh `Tiny` with seeded random weights, adopted from the session's one real mint of it
(`art_a`, support/minted.py), then 1 to 4 drawn steps and a closing call.

Each adopt loads the package (about 13 ms), so a case costs about 30 ms on a busy 2-core box: the
default 1,200 examples (hypothesis runs ~1,550 cases for them) take 35-45 s, plus the 35-70 s
mint when no other test file in the session made it. `CGBUILD_SOAK_EXAMPLES=N` raises the number
of examples for a longer soak: `CGBUILD_SOAK_EXAMPLES=6000 python -m pytest
tests/rules/test_served_property.py` (7,796 cases) took 233 s here, 293 s with the mint. One
process cannot adopt much more than ~10,000 times (`MAPS_PER_ADOPT`): above ~7,500 examples the
test refuses to start rather than die of a MemoryError minutes in.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from cgbuild_rules.adopt import Adopted, AdoptRefused, adopt
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from support.minted import tiny_class as entry_class
from torch import nn
from torch.utils.hooks import RemovableHandle

pytestmark = pytest.mark.slow

EXAMPLES = max(1200, int(os.environ.get("CGBUILD_SOAK_EXAMPLES") or 0))
TOLERANCE = 1e-4
"""The mint's verify tolerance for float32 outputs (relative error of the norm)."""
TRACED = (1, 8, 64)
TRACED_STRIDE = (512, 64, 1)
DIMS = {"fc1": (64, 32), "fc2": (32, 4)}
"""(in, out) of each Linear of `Tiny(64)`."""

DRAW_SAME_STORAGE_VIEWS = True
"""`.data =` a view of the tensor's own storage (another shape or strides, the same pointer) is
drawn: the watch compares each bound tensor's shape and strides with its pointer
(`test_a_data_view_of_the_bound_storage_is_seen`)."""

MAPS_PER_ADOPT = 6
"""Memory mappings each adopt leaves behind for good: torch's AOTI package loader dlopens its own
extracted copy of the model's .so and never unmaps it (pinned by
`test_a_dropped_adoption_unmaps_its_package`, xfail), so one process can adopt only about
vm.max_map_count / 6 times (~10,000 at Linux's default 65,530) before mmap fails."""

TALLY: collections.Counter[str] = collections.Counter()
"""Across the run: cases, calls, and each outcome (`compiled`, `restrided`, `rebound`,
`eager:<code>`, `strict:<code>`, `refused:config`), so the run cannot pass by never compiling."""


@pytest.fixture(scope="module")
def tiny_class(tmp_path_factory: pytest.TempPathFactory) -> type[nn.Module]:
    return entry_class(tmp_path_factory)


class Wrapped(nn.Module):
    """What an unfused adapter does to a layer: the layer moves to `base_layer`, the wrapper adds
    its own term."""

    def __init__(self, base: nn.Module, features: int, out: int) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_B = nn.Linear(features, out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(x)


@dataclass
class Case:
    """One drawn case: the live module, what serves it, and what the steps need to undo."""

    m: nn.Module
    served: Adopted
    strict: bool
    originals: dict[str, nn.Module]
    handles: list[RemovableHandle] = field(default_factory=list)
    layout: tuple[str, int] = ("contiguous", 0)
    """How the next call's input is laid out (then back to contiguous)."""
    mode: str = "plain"
    """The next call's mode (`MODES`; then back to plain)."""


MODES = ("plain", "autocast", "grad", "grad-input")


def mode(name: str) -> Any:
    """The context a call runs in: autocast on the CPU, or grad on (the case runs under no_grad)."""
    if name == "autocast":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return torch.enable_grad() if name.startswith("grad") else contextlib.nullcontext()


def move_mode(case: Case, data: st.DataObject) -> None:
    case.mode = data.draw(st.sampled_from(MODES), label="call mode")


# ---- inputs ------------------------------------------------------------------------------------
LAYOUTS = (
    "contiguous",
    "expanded-rows",  # (1, 1, 64) expanded: stride 0 on the row dimension
    "expanded-features",  # (1, 8, 1) expanded: stride 0 on the feature dimension
    "transposed",  # (1, 64, 8) transposed
    "feature-major",  # channels-last's 3D analogue: features outermost in memory
    "odd-batch-stride",  # the size-1 batch dimension with another stride: laid out as traced
    "slice",  # a feature slice of a wider buffer, at a drawn column
    "offset",  # contiguous at a drawn element offset (misaligned unless a multiple of 4)
    "float64",
    "float16",
    "bfloat16",
    "narrow-features",  # (1, 8, 32): eager raises
    "batch-2",  # (2, 8, 64): eager serves it, the static artifact does not
    "rows-4",
    "rank-2",
    "rank-4",
)


def make_input(layout: str, arg: int) -> torch.Tensor:
    if layout == "expanded-rows":
        return torch.randn(1, 1, 64).expand(*TRACED)
    if layout == "expanded-features":
        return torch.randn(1, 8, 1).expand(*TRACED)
    if layout == "transposed":
        return torch.randn(1, 64, 8).transpose(1, 2)
    if layout == "feature-major":
        return torch.randn(64, 8).t().unsqueeze(0)
    if layout == "odd-batch-stride":
        return torch.randn(8, 1, 64).transpose(0, 1)
    if layout == "slice":
        return torch.randn(1, 8, 128)[..., arg : arg + 64]
    if layout == "offset":
        return torch.randn(512 + arg)[arg:].view(*TRACED)
    if layout in ("float64", "float16", "bfloat16"):
        return torch.randn(*TRACED).to(getattr(torch, layout))
    shapes = {"narrow-features": (1, 8, 32), "batch-2": (2, 8, 64), "rows-4": (1, 4, 64)}
    shapes |= {"rank-2": (8, 64), "rank-4": (1, 1, 8, 64)}
    return torch.randn(*shapes.get(layout, TRACED))


def laid_out_as_traced(x: torch.Tensor) -> bool:
    """What the package may read in place: the traced strides on every dimension longer than one
    and a 16-byte aligned start. Anything else must be served on a copy (counted `restrided`)."""
    strides = zip(x.shape, x.stride(), TRACED_STRIDE, strict=True)
    return all(n <= 1 or s == w for n, s, w in strides) and x.data_ptr() % 16 == 0


def draw_layout(case: Case, data: st.DataObject) -> None:
    layout = data.draw(st.sampled_from(LAYOUTS), label="layout")
    arg = 0
    if layout == "slice":
        arg = data.draw(st.integers(0, 64), label="column")
    elif layout == "offset":
        arg = data.draw(st.integers(1, 4), label="elements")
    case.layout = (layout, arg)


# ---- bound tensors -----------------------------------------------------------------------------
TENSOR_MOVES = (
    "parameter",
    "parameter-other-shape",
    "data",
    "data-column-major",
    "add_",
    "mul_",
    "copy_",
    "load-state-dict-assign",
    "to-float64",
    "to-float32",
    "double",
    "float",
    *(("data-same-storage-view",) if DRAW_SAME_STORAGE_VIEWS else ()),
)


def _other_layout(t: torch.Tensor) -> torch.Tensor:
    """The same values with other strides: column-major for a matrix, every other element of a
    buffer twice as long for a vector."""
    if t.dim() == 2:
        return t.t().contiguous().t()
    return torch.empty(2 * t.numel(), dtype=t.dtype)[::2].copy_(t.reshape(-1)).view(t.shape)


def _same_storage_view(t: torch.Tensor) -> torch.Tensor:
    """Another shape or strides over the very storage `t` starts at (the pointer unchanged)."""
    if t.dim() == 2:
        rows, cols = t.shape
        return t.as_strided((rows, cols), (1, rows))
    return t[:1]


def move_tensor(case: Case, data: st.DataObject) -> None:
    m = case.m
    how = data.draw(st.sampled_from(TENSOR_MOVES), label="tensor move")
    if how in ("to-float64", "to-float32"):
        m.to(torch.float64 if how == "to-float64" else torch.float32)
        return
    if how in ("double", "float"):
        getattr(m, how)()
        return
    if how == "load-state-dict-assign":
        m.load_state_dict({k: torch.randn_like(v) * 0.2 for k, v in m.state_dict().items()}, assign=True)
        return
    names = sorted(n for n, _ in m.named_parameters()) + sorted(n for n, _ in m.named_buffers())
    if not names:
        return
    fqn = data.draw(st.sampled_from(names), label="tensor")
    prefix, _, name = fqn.rpartition(".")
    owner = m.get_submodule(prefix) if prefix else m
    t: torch.Tensor = getattr(owner, name)
    is_parameter = isinstance(t, nn.Parameter)
    if how == "parameter":
        value = torch.randn_like(t) if data.draw(st.booleans(), label="new values") else t.detach().clone()
        setattr(owner, name, nn.Parameter(value) if is_parameter else value)
    elif how == "parameter-other-shape":
        shapes = [(*t.shape[:-1], t.shape[-1] + 1), (1,) * t.dim()]
        if t.dim() == 2:
            shapes.append((t.shape[0] + 1, t.shape[1]))
        value = torch.randn(data.draw(st.sampled_from(shapes), label="shape"), dtype=t.dtype)
        setattr(owner, name, nn.Parameter(value) if is_parameter else value)
    elif how == "data":
        t.data = torch.randn_like(t)
    elif how == "data-column-major":
        t.data = _other_layout(t.data)
    elif how == "data-same-storage-view":
        t.data = _same_storage_view(t.data)
    elif how == "add_":
        t.add_(data.draw(st.sampled_from([-1.0, 0.25, 1.0]), label="added"))
    elif how == "mul_":
        t.mul_(data.draw(st.sampled_from([-1.0, 0.5, 2.0]), label="factor"))
    else:
        t.copy_(torch.randn_like(t))


# ---- the module tree ---------------------------------------------------------------------------
TREE_MOVES = (
    "fresh-eval",
    "fresh-train",
    "wrap",
    "restore",
    "delete",
    "forward-hook",
    "pre-hook",
    "remove-hook",
    "override-forward",
    "remove-override",
    "train",
    "eval",
    "shadow-weight",
    "unshadow",
    "patch-class",
    "unpatch-class",
)

LINEAR_FORWARD = nn.Linear.forward
"""What a case's `patch-class` replaces (a library patching a class) and every case ends with."""


def _patched_forward(self: nn.Linear, t: torch.Tensor) -> torch.Tensor:
    return nn.functional.linear(t, self.weight, self.bias) + 1


BEFORE_ADOPT = ("forward-hook", "pre-hook", "override-forward", "shadow-weight", "patch-class", "train")
"""Tree moves drawn before adopt: the baseline is the module as traced, so each must be seen."""


def move_tree(case: Case, data: st.DataObject, how: str | None = None) -> None:
    m = case.m
    how = how or data.draw(st.sampled_from(TREE_MOVES), label="tree move")
    if how in ("train", "eval"):
        getattr(m, how)()
        return
    if how == "remove-hook":
        if case.handles:
            case.handles.pop(data.draw(st.integers(0, len(case.handles) - 1), label="hook")).remove()
        return
    name = data.draw(st.sampled_from(sorted(DIMS)), label="submodule")
    features, out = DIMS[name]
    sub = m._modules.get(name)
    if how == "fresh-eval":
        setattr(m, name, nn.Linear(features, out).eval())
    elif how == "fresh-train":
        setattr(m, name, nn.Linear(features, out))  # a new module is in train mode
    elif how == "wrap":
        setattr(m, name, Wrapped(sub if sub is not None else case.originals[name], features, out))
    elif how == "restore":
        setattr(m, name, case.originals[name])
    elif sub is None:
        return
    elif how == "delete":
        delattr(m, name)
    elif how == "forward-hook":
        doubles = data.draw(st.booleans(), label="hook doubles")
        case.handles.append(sub.register_forward_hook(lambda _m, _i, o: o * 2 if doubles else None))
    elif how == "pre-hook":
        case.handles.append(sub.register_forward_pre_hook(lambda _m, args: (args[0] + 1,)))
    elif how == "override-forward":
        sub.forward = lambda t, sub=sub: type(sub).forward(sub, t) * 3  # type: ignore[method-assign]
    elif how == "shadow-weight":
        if isinstance(sub, nn.Linear):
            sub.__dict__["weight"] = nn.Parameter(torch.randn_like(sub.weight))
    elif how == "unshadow":
        sub.__dict__.pop("weight", None)
    elif how in ("patch-class", "unpatch-class"):
        patch = _patched_forward if how == "patch-class" else LINEAR_FORWARD
        nn.Linear.forward = patch  # type: ignore[method-assign]
    else:
        sub.__dict__.pop("forward", None)


# ---- configuration -----------------------------------------------------------------------------
CONFIG_MOVES = ("out_features", "in_features", "new-attribute", "remove-attribute", "rebind")
SCALARS = st.one_of(
    st.integers(-2, 2),
    st.sampled_from([0.5, 1e-6, math.nan]),
    st.sampled_from(["gelu", ""]),
    st.none(),
    st.booleans(),
    st.tuples(st.integers(0, 2), st.integers(0, 2)),
    st.builds(lambda: [torch.ones(2)]),  # not plain: the watch compares it by identity
)


def move_config(case: Case, data: st.DataObject) -> None:
    how = data.draw(st.sampled_from(CONFIG_MOVES), label="config move")
    if how == "rebind":
        case.served.rebind()
        return
    target = data.draw(st.sampled_from(["", *sorted(DIMS)]), label="owner")
    owner = case.m.get_submodule(target) if target in case.m._modules or not target else None
    if owner is None:
        return
    if how in ("out_features", "in_features"):
        features, out = DIMS.get(target, (64, 4))
        recorded = out if how == "out_features" else features
        setattr(
            owner,
            how,
            data.draw(st.sampled_from([recorded, recorded - 1, recorded + 1, float(recorded)]), label=how),
        )
    elif how == "new-attribute":
        setattr(owner, data.draw(st.sampled_from(["alpha", "mode"]), label="name"), data.draw(SCALARS))
    else:
        for name in ("alpha", "mode"):
            owner.__dict__.pop(name, None)


MOVES: dict[str, Callable[[Case, st.DataObject], None]] = {
    "input": draw_layout,
    "tensor": move_tensor,
    "tree": move_tree,
    "config": move_config,
    "mode": move_mode,
}


# ---- the property ------------------------------------------------------------------------------
def _outcome(thunk: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return thunk(), None
    except Exception as e:
        return None, e


def call(case: Case) -> None:
    """One call, judged against the live module's own forward on the same input.

    When eager itself raises (an input or a weight the user made incompatible), the only right
    answers are a refusal: served eager, so raising what eager raises (same type, same message),
    or `AdoptRefused` with `strict`. A compiled result there is a result the module cannot
    compute: compiled and wrong.
    """
    m, served = case.m, case.served
    x = make_input(*case.layout)
    if case.mode == "grad-input" and x.is_floating_point():
        x.requires_grad_()
    note(f"call on {case.layout[0]} {list(x.shape)} stride {x.stride()} @ {x.data_ptr() % 64}, {case.mode}")
    case.layout = ("contiguous", 0)
    before = collections.Counter(served.counters)
    with mode(case.mode):
        want, eager_error = _outcome(lambda: type(m).forward(m, x))
        got, served_error = _outcome(lambda: served(x))
    case.mode = "plain"
    delta = served.counters - before
    eager = [k for k in delta if k.startswith("eager:")]
    TALLY["calls"] += 1
    TALLY.update({k: v for k, v in delta.items() if not k.startswith("eager:")})
    assert delta["compiled"] in (0, 1), delta
    if delta["compiled"]:
        assert served_error is None and not eager, (served_error, delta)
        assert eager_error is None, f"compiled where eager raises {eager_error!r}"
        assert isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype
        assert got.requires_grad == want.requires_grad, "compiled and detached"
        assert bool(torch.isfinite(got).all()), "compiled and not finite"
        err = float((got - want).norm() / want.norm().clamp_min(1e-12))
        assert err <= TOLERANCE, f"compiled and wrong: relative error {err:.3g}"
        copied = 0 if laid_out_as_traced(x) else 1
        assert delta["restrided"] == copied, f"restrided {delta['restrided']}, expected {copied}"
        return
    assert delta["restrided"] == 0, delta
    if case.strict:
        assert isinstance(served_error, AdoptRefused), served_error
        refusal = served_error.refusal
        assert refusal.code and not eager, (refusal, delta)
        TALLY[f"strict:{refusal.code}"] += 1
    else:
        assert len(eager) == 1 and delta[eager[0]] == 1, delta
        code = eager[0].removeprefix("eager:")
        refusal = served.last_reason  # type: ignore[assignment]
        assert code and refusal is not None and refusal.code == code and refusal.detail, (delta, refusal)
        TALLY[eager[0]] += 1
        if eager_error is not None:
            assert type(served_error) is type(eager_error), (served_error, eager_error)
            assert str(served_error) == str(eager_error)
        else:
            assert served_error is None, served_error
            assert torch.equal(got, want) and got.requires_grad == want.requires_grad, "served eager differs"
    if eager_error is not None:
        TALLY["refused:eager-raises"] += 1
    if refusal.code == "config-drift" or "config-drift:" in refusal.detail:
        TALLY["refused:config"] += 1


FAMILIES = ["call", *MOVES]


def _maps() -> int | None:
    try:
        return len(Path("/proc/self/maps").read_text().splitlines())
    except OSError:
        return None


def _maps_left() -> int | None:
    try:
        limit = int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return None
    used = _maps()
    return None if used is None else limit - used


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    seed=st.integers(0, 2**31 - 1),
    strict=st.integers(0, 4).map(lambda n: n == 0),
    steps=st.lists(st.sampled_from(FAMILIES), min_size=1, max_size=4),
    data=st.data(),
)
def serve_cases(
    art_a: Path, tiny_class: type[nn.Module], seed: int, strict: bool, steps: list[str], data: st.DataObject
) -> None:
    torch.manual_seed(seed)
    m = tiny_class(64).eval()
    before = data.draw(st.lists(st.sampled_from(BEFORE_ADOPT), max_size=2), label="before adopt")
    probe = Case(m, None, strict, {"fc1": m.fc1, "fc2": m.fc2})  # type: ignore[arg-type]
    try:
        for how in before:  # what the user did to the module before adopting it
            move_tree(probe, data, how)
        TALLY["cases"] += 1
        TALLY.update(f"before:{how}" for how in before)
        try:
            served = adopt(art_a, m, strict=strict)
        except AdoptRefused as e:  # strict: refused at adopt, by name, for what was done before
            assert before and e.refusal.code == "module-changed", (before, e.refusal)
            TALLY["strict:module-changed"] += 1
            return
        case = Case(m, served, strict, probe.originals, probe.handles)
        with torch.no_grad():
            for family in [*steps, "call"]:  # closing call: every move is judged by one
                if family == "call":
                    call(case)
                else:
                    MOVES[family](case, data)
    finally:
        nn.Linear.forward = LINEAR_FORWARD  # type: ignore[method-assign]


def test_every_call_is_compiled_and_right_or_refused_by_name(
    art_a: Path, tiny_class: type[nn.Module]
) -> None:
    """Run on one intra-op thread: on a busy 2-core box, OpenMP's barriers around these tiny
    kernels cost milliseconds a call (2.5x the whole run); what is judged is routing, not kernels."""
    left = _maps_left()
    most = None if left is None else int(left / (1.4 * MAPS_PER_ADOPT))  # ~1.3 cases an example
    if most is not None and most < EXAMPLES:
        pytest.fail(f"{EXAMPLES} examples would exhaust the process's memory mappings: at most {most}")
    TALLY.clear()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        serve_cases(art_a, tiny_class)
    finally:
        torch.set_num_threads(threads)
    print(f"\n{EXAMPLES} examples: {dict(sorted(TALLY.items()))}")
    assert TALLY["cases"] >= EXAMPLES
    categories = ("compiled", "restrided", "rebound", "eager:module-changed", "refused:config")
    for category in (*categories, "eager:autocast", "eager:grad", *(f"before:{b}" for b in BEFORE_ADOPT)):
        assert TALLY[category] > 0, f"{category} never exercised: {dict(TALLY)}"
    assert any(k.startswith("strict:") for k in TALLY), dict(TALLY)


# ---- known gaps, pinned ------------------------------------------------------------------------
@pytest.mark.parametrize("fqn", ["fc2.bias", "fc2.weight"])
def test_a_data_view_of_the_bound_storage_is_seen(art_a: Path, tiny_class: type[nn.Module], fqn: str) -> None:
    torch.manual_seed(0)
    m = tiny_class(64).eval()
    served = adopt(art_a, m)
    x = torch.randn(*TRACED)
    t = m.get_parameter(fqn)
    with torch.no_grad():
        t.data = _same_storage_view(t.data)  # bias[:1] broadcasts; the weight read column-major
        want = m(x)
        got = served(x)
    assert torch.equal(got, want) and served.counters == {"eager:module-changed": 1}
    assert served.last_reason is not None and f"{fqn} is now" in served.last_reason.detail


@pytest.mark.xfail(
    strict=True,
    reason="torch's AOTIModelPackageLoader dlopens a fresh extracted copy of the model .so per load "
    "and never unmaps it: each adopt leaves 6 mappings and ~0.3 MB behind, however it is released",
)
def test_a_dropped_adoption_unmaps_its_package(art_a: Path, tiny_class: type[nn.Module]) -> None:
    m = tiny_class(64).eval()
    adopt(art_a, m)  # the first load maps what every later one shares
    gc.collect()
    before = _maps()
    if before is None:
        pytest.skip("no /proc/self/maps here")
    for _ in range(20):
        served = adopt(art_a, m)
        served.release()
        del served
    gc.collect()
    assert (_maps() or 0) - before < 20 * MAPS_PER_ADOPT // 2
