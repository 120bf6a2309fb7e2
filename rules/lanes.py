"""The torch side of kernel lanes: the runtime switch entries build with, and the measurement.

An entry that provides lanes declares them as a literal `LANES = {axis: {value: needs}}` (read by
the engine without importing the entry; `cgbuild.lanes`) and builds, for each axis, one
`LaneSwitch(axis, spec["lanes"][axis])`. The switch carries EVERY value the spec names and picks
one at run time, so one sealed artifact serves every lane and the key never mentions one:

- the choice enters the compiled program as a SIZE, never as data: `export` adds one keyword
  input, `_cgbuild_lanes` (`SELECTOR`), a zero-element tensor of shape
  `(2 + i_1, ..., 2 + i_k, 0)` for the value index `i_d` of each switched axis (axes in name
  order), each dimension a symbol of range `[2, 1 + n_d]`. `select` is nested
  `torch.cond(selector.shape[d] == 2 + i, ...)`, which AOTInductor compiles into a plain host
  `if` on the input's size: no device→host read, no kernel. The offset is there because torch
  specialises sizes 0 and 1. The selector holds no data; adopt builds it once, from the
  verdict it re-fits, and passes it with every call.
- the compiled program does NOT check the selector's sizes: any size that is no other value's
  runs the last value. So a selector is checked against the program's sealed contract (rank,
  dtype, each size within its symbol's range) before it is used (`cgbuild_rules.adopt`), and
  the mint verifies every lane of the compiled artifact against eager (`verify-mismatch`).
- outside `export` (eager calls, a plain `torch.export`, `torch.compile`) a switch runs the value
  it is set to (`set_lanes`; the first value by default), as plain Python: no branch at all.
- with one value there is no selector dimension and no branch: the program is the plain one.

Artifacts sealed before the selector existed switch on `onehot`, an int64 buffer per switch read
by `torch.cond(onehot[i] != 0, ...)` (a device→host copy per switch per call on a GPU); adopt
still binds the chosen one-hot by the FQN their table names (`bindings`).

The first value of an axis (in the entry's table order) is its reference: index 0 by default, and
the baseline the other values' numerics are checked against.

`measure` is the protocol a mint runs per candidate lane, in its check stage: 3 warm-up calls,
reset the peak, 9 timed calls (CUDA events on a GPU, `perf_counter_ns` on the CPU), median and
peak bytes. On a GPU the peak is `torch.cuda.max_memory_allocated` (every byte torch's allocator
holds for the process: weights, activations, workspaces; not the CUDA context). On the CPU there
is no allocator peak to read (tracemalloc does not see ATen), so the peak comes from the process's
resident high-water mark (`VmHWM`) over the timed calls: freed heap pages are returned first
(`malloc_trim(0)`) and the high-water mark reset to the current resident size (writing 5 to
`/proc/self/clear_refs`); the bare process (interpreter and torch, read before the module is
built) is subtracted, leaving weights, the loaded package and the calls' working memory. It
counts pages touched, not bytes asked for, at 4 KiB granularity. The first timed call pays for
re-faulting the trimmed pages; the median does not see it.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import ctypes.util
import inspect
import itertools
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from cgbuild.lanes import LaneAxis, Switches

WARMUP = 3
TIMED = 9
SELECTOR = "_cgbuild_lanes"
"""The keyword input that carries the lane choice into a compiled program (a name no forward uses)."""
SELECTOR_BASE = 2
"""Value i of an axis is selector size 2 + i: torch specialises sizes 0 and 1 to constants."""
SELECTOR_DTYPE = torch.uint8

_ACTIVE: contextvars.ContextVar[Mapping[str, tuple[torch.Tensor, int]] | None] = contextvars.ContextVar(
    "cgbuild_lanes_selector", default=None
)
"""While `export` traces: axis → (the selector input, its dimension for that axis)."""


def one_hot(index: int, n: int) -> torch.Tensor:
    """The switch value of an artifact sealed with one-hot switches, selecting value `index` of `n`
    (int64, on the CPU; move it as needed)."""
    if not 0 <= index < n:
        raise IndexError(f"lane index {index} outside [0, {n})")
    t = torch.zeros(n, dtype=torch.int64)
    t[index] = 1
    return t


def _branch(
    sel: torch.Tensor, dim: int, fns: Sequence[Callable[..., Any]], operands: tuple[Any, ...], i: int
) -> Any:
    if i == len(fns) - 1:
        return fns[i](*operands)

    def take(s: torch.Tensor, *ops: Any) -> Any:
        return fns[i](*ops)

    def rest(s: torch.Tensor, *ops: Any) -> Any:
        return _branch(s, dim, fns, ops, i + 1)

    return torch.cond(sel.shape[dim] == SELECTOR_BASE + i, take, rest, (sel, *operands))


class LaneSwitch(nn.Module):
    """One lane axis of a module: every value's implementation, chosen at run time.

    `select(impls, *operands)` calls `impls[value]` for the chosen value; every implementation
    takes the same tensor operands and returns tensors of the same shape and dtype (a branch of
    `torch.cond`). Implementations must be real and distinct code paths: the mint checks each
    against eager and against the reference before it may become a candidate.
    """

    def __init__(self, axis: str, values: Sequence[str]) -> None:
        super().__init__()
        values = tuple(values)
        if not values or len(set(values)) != len(values):
            raise ValueError(f"lane axis {axis!r}: values must be non-empty and distinct, got {values}")
        self.axis = axis
        self.values = values
        self._index = 0  # private: the eager choice is no configuration of the program

    @property
    def value(self) -> str:
        """The value eager calls run."""
        return self.values[self._index]

    def select(self, impls: Mapping[str, Callable[..., Any]], *operands: Any) -> Any:
        missing = [v for v in self.values if v not in impls]
        if missing:
            raise KeyError(f"lane axis {self.axis!r}: no implementation for {missing}")
        fns = [impls[v] for v in self.values]
        active = _ACTIVE.get()
        if len(fns) == 1 or active is None or self.axis not in active:
            return fns[self._index](*operands)
        sel, dim = active[self.axis]
        return _branch(sel, dim, fns, operands, 0)

    def set(self, value: str) -> None:
        """Choose `value` for eager calls of this module."""
        if value not in self.values:
            raise ValueError(f"lane axis {self.axis!r} has no value {value!r} (it has {list(self.values)})")
        self._index = self.values.index(value)

    def extra_repr(self) -> str:
        return f"axis={self.axis!r}, values={list(self.values)}"


def switches(module: nn.Module) -> dict[str, list[str]]:
    """axis → values of the switches of a built module.

    One switch per axis: two switches of one axis could be bound to different values, a lane
    combination nobody measured.
    """
    found: dict[str, tuple[str, list[str]]] = {}
    for prefix, mod in module.named_modules():
        if isinstance(mod, LaneSwitch):
            if mod.axis in found:
                raise ValueError(
                    f"two switches for lane axis {mod.axis!r} ({found[mod.axis][0]!r}, {prefix!r}): "
                    "share one LaneSwitch per axis"
                )
            found[mod.axis] = (prefix, list(mod.values))
    return {axis: values for axis, (_, values) in found.items()}


def set_lanes(module: nn.Module, choice: Mapping[str, str]) -> None:
    """Choose per axis for EAGER calls (mint verification, a serving module's own fallback)."""
    for mod in module.modules():
        if isinstance(mod, LaneSwitch) and mod.axis in choice:
            mod.set(choice[mod.axis])


# ---- the selector: the lane choice as an input's sizes --------------------------------------------
def switch_table(axes: Sequence[LaneAxis]) -> Switches:
    """A traced program's switch table: every axis of two or more values is a dimension of the
    selector input (`SELECTOR`, value 0 at size `SELECTOR_BASE`); with none it takes no selector."""
    return Switches.selected(axes, SELECTOR, SELECTOR_BASE)


def _axes(module: nn.Module) -> list[LaneAxis]:
    return [LaneAxis(axis, tuple(values)) for axis, values in switches(module).items()]


def selector(
    table: Switches, choice: Mapping[str, str], device: torch.device | str | None = None
) -> torch.Tensor:
    """The selector input choosing `choice` (axis → value) in a program whose switch table is
    `table`: zero elements, no memory."""
    if table.selector is None:
        raise ValueError("this program takes no lane selector (no axis has two values)")
    sizes = []
    for axis in table.selector.axes:
        values = table.values(axis)
        if choice.get(axis) not in values:
            raise ValueError(f"lane axis {axis!r} has no value {choice.get(axis)!r} (it has {list(values)})")
        sizes.append(table.selector.base + values.index(choice[axis]))
    return torch.empty((*sizes, 0), dtype=SELECTOR_DTYPE, device=device)


def selector_of(module: nn.Module, device: torch.device | str | None = None) -> torch.Tensor | None:
    """The selector of the values `module`'s switches are set to (None: nothing switches); the
    trace passes the one of a freshly built module, every axis at its reference."""
    table = switch_table(_axes(module))
    if table.selector is None:
        return None
    choice = {m.axis: m.value for m in module.modules() if isinstance(m, LaneSwitch)}
    return selector(table, choice, device)


def switch_inputs(
    table: Switches, choice: Mapping[str, str], device: torch.device | str
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(constants to bind, inputs to pass) that select `choice` in a program sealed with `table`:
    the selector input, or for an artifact sealed with one-hot switches their values by FQN."""
    inputs = {table.selector.input: selector(table, choice, device)} if table.selector else {}
    return bindings(table.axes, choice, device), inputs


def bindings(
    axes: Sequence[LaneAxis], choice: Mapping[str, str], device: torch.device | str
) -> dict[str, torch.Tensor]:
    """FQN → one-hot for a lane choice, for the switched axes of a table sealed with one-hot
    switches (axes with an `fqn`); {} for any other table."""
    out: dict[str, torch.Tensor] = {}
    for row in axes:
        if row.fqn:
            out[row.fqn] = one_hot(row.values.index(choice[row.axis]), len(row.values)).to(device)
    return out


def _shapes(dynamic_shapes: Any, names: Sequence[str], dims: dict[int, Any]) -> Any:
    """The entry's `dynamic_shapes` (None, by name, or in input order) by name, with the selector's."""
    if dynamic_shapes is None:
        by_name = dict.fromkeys(names)
    elif isinstance(dynamic_shapes, Mapping):
        by_name = dict(dynamic_shapes)
    elif isinstance(dynamic_shapes, tuple | list) and len(dynamic_shapes) == len(names):
        by_name = dict(zip(names, dynamic_shapes, strict=True))
    else:
        raise ValueError(f"dynamic_shapes {type(dynamic_shapes).__name__} does not name the module's inputs")
    return {**by_name, SELECTOR: dims}


def export(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    dynamic_shapes: Any = None,
    sel: torch.Tensor | None = None,
) -> torch.export.ExportedProgram:
    """`torch.export` (non-strict) of `module` with every switch's values in the program, chosen by
    the selector input `sel` (`selector_of`: made where the inputs were, fake or real; None only
    for a module that switches nothing).

    The module's own call stays the program's: for the export only, an instance `forward` takes
    the selector as one more keyword and calls the module's own `forward` with the rest, so the
    state-dict names, the inputs' names and the entry's dynamic shapes are the module's.
    """
    found = switches(module)
    axes = sorted(a for a, values in found.items() if len(values) > 1)
    if not axes:
        return torch.export.export(module, args, dict(kwargs), dynamic_shapes=dynamic_shapes, strict=False)
    if sel is None:  # the program would silently be the one lane the switches are set to
        raise ValueError(f"{type(module).__name__} switches lanes {axes}: pass its selector (`selector_of`)")
    forward = module.forward
    signature = inspect.signature(forward)
    if SELECTOR in signature.parameters:
        raise ValueError(f"{type(module).__name__}.forward takes {SELECTOR!r}, the lane selector's name")
    names = list(signature.bind(*args, **kwargs).arguments)
    dims = {
        d: torch.export.Dim(f"cgbuild_lane{d}", min=SELECTOR_BASE, max=SELECTOR_BASE + len(found[a]) - 1)
        for d, a in enumerate(axes)
    }
    shapes = _shapes(dynamic_shapes, names, dims)

    def with_selector(*a: Any, **kw: Any) -> Any:
        token = _ACTIVE.set({axis: (kw[SELECTOR], d) for d, axis in enumerate(axes)})
        try:
            return forward(*a, **{k: v for k, v in kw.items() if k != SELECTOR})
        finally:
            _ACTIVE.reset(token)

    params = list(signature.parameters.values())
    at = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_KEYWORD), len(params))
    params.insert(at, inspect.Parameter(SELECTOR, inspect.Parameter.KEYWORD_ONLY))
    with_selector.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    with _instance_forward(module, with_selector):
        return torch.export.export(
            module, args, {**kwargs, SELECTOR: sel}, dynamic_shapes=shapes, strict=False
        )


@contextlib.contextmanager
def _instance_forward(module: nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    prior = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if prior is None:
            del module.__dict__["forward"]
        else:
            module.forward = prior


# ---- measurement --------------------------------------------------------------------------------
def _status() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _reset_cpu_peak() -> tuple[int, str]:
    """Return freed heap pages, reset the resident high-water mark; (resident bytes, method)."""
    method = "vmhwm"
    name = ctypes.util.find_library("c")
    if name:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(name).malloc_trim(0)
            method = "vmhwm+malloc_trim"
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        method += " (not reset: includes warm-up)"
    return _status()["VmRSS"], method


def process_bytes() -> int:
    """This process's resident size now: taken by the check stage before it builds anything."""
    return _status()["VmRSS"]


def measure(call: Callable[[], Any], device: torch.device, base_bytes: int = 0) -> dict[str, Any]:
    """The lane benchmark protocol on one callable (see the module docstring); integers only.

    `peak_bytes` is what the fit rule uses. GPU: torch's allocator high-water mark over the timed
    calls (weights included, the CUDA context not). CPU: the resident high-water mark over the
    timed calls minus `base_bytes`, the bare process (interpreter and torch, read before the module
    was built): weights, the loaded package and the calls' working memory, the same things the
    GPU number counts. The bare process, like the CUDA context, is what the 1 GiB allowance is for.
    """
    with torch.no_grad():
        for _ in range(WARMUP):
            call()
        samples: list[int] = []
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            reset = torch.cuda.memory_allocated(device)
            for _ in range(TIMED):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                call()
                end.record()
                end.synchronize()
                samples.append(round(start.elapsed_time(end) * 1e6))
            hwm = torch.cuda.max_memory_allocated(device)
            peak, method = hwm, "cuda max_memory_allocated"
        else:
            reset, method = _reset_cpu_peak()
            for _ in range(TIMED):
                t = time.perf_counter_ns()
                call()
                samples.append(time.perf_counter_ns() - t)
            hwm = _status()["VmHWM"]
            peak, method = max(0, hwm - base_bytes), f"VmHWM - bare process ({method})"
    return {
        "median_ns": int(statistics.median(samples)),
        "samples_ns": samples,
        "peak_bytes": int(peak),
        "high_water_bytes": int(hwm),
        "base_bytes": int(base_bytes),
        "reset_bytes": int(reset),
        "calls_bytes": int(hwm - reset),
        "peak_method": method,
        "warmup": WARMUP,
        "timed": TIMED,
    }


def device_facts(device: torch.device) -> dict[str, Any]:
    """What the evidence names the measuring device by (never sealed)."""
    import platform

    facts: dict[str, Any] = {
        "type": device.type,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts.update(
            name=props.name,
            memory_bytes=int(props.total_memory),
            cuda=torch.version.cuda,
            driver=_driver_version(),
        )
    else:
        facts.update(name=platform.processor() or platform.machine(), memory_bytes=host_memory_bytes())
    return facts


def _driver_version() -> str | None:
    try:
        import subprocess

        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def host_memory_bytes() -> int:
    """This host's total RAM (what a CPU target serves from)."""
    import os

    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def device_memory_bytes(device: torch.device) -> int:
    """Total memory of the device a module serves on: the GPU's total, or the host's RAM."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    return host_memory_bytes()


# ---- mint: the sealed switch table and the per-lane checks ---------------------------------------
def lane_rows(
    module: nn.Module, declared: Sequence[str], spec_lanes: Mapping[str, Sequence[str]]
) -> list[LaneAxis]:
    """The sealed switch table of a built module: each declared axis it uses, in declaration
    order. Refuses a switch that does not carry what the spec asked (the program would not be
    the one the key was computed for) and a switch of an undeclared axis."""
    found = switches(module)
    rows: list[LaneAxis] = []
    for axis in declared:
        if axis not in found:
            continue  # this module does not use the axis
        want = list(spec_lanes.get(axis) or [])
        if found[axis] != want:
            raise ValueError(f"LaneSwitch({axis!r}) carries {found[axis]}, the spec asked {want}")
        rows.append(LaneAxis(axis, tuple(found[axis])))
    stray = sorted(a for a, values in found.items() if a not in declared and len(values) > 1)
    if stray:
        raise ValueError(f"switches for undeclared lane axes {stray}: declare them in the Cgfile")
    return rows


def verify_lanes(
    rows: Sequence[LaneAxis],
    eager: Callable[[Mapping[str, str]], Any],
    compiled: Callable[[Mapping[str, str]], Any],
    compare: Callable[[Any, Any], list[dict[str, Any]]],
) -> dict[str, Any]:
    """Run every lane combination compiled and eager, and check each value against the reference.

    `compare(got, want)` raises on a mismatch (the artifact is wrong: the mint fails, naming the
    lane); the numerics self-check catches it instead (the value is then no candidate). Returns
    {"checked": {lane: errors}, "numerics": {axis: {value: {"ok", "rel_rms"|"detail"}}}}.
    """
    axes = [r.axis for r in rows]
    reference = {r.axis: r.values[0] for r in rows}
    want_ref = eager(reference)
    checked: dict[str, Any] = {}
    numerics: dict[str, dict[str, Any]] = {r.axis: {} for r in rows}
    for combo in itertools.product(*(r.values for r in rows)):
        choice = dict(zip(axes, combo, strict=True))
        lane = "+".join(combo)
        got = compiled(choice)
        try:
            checked[lane] = compare(got, eager(choice))
        except Exception as e:  # name the lane in the mint's failure detail
            if isinstance(getattr(e, "detail", None), str):
                e.detail = f"lane {lane}: {e.detail}"  # type: ignore[attr-defined]
            raise
        moved = [a for a in axes if choice[a] != reference[a]]
        if len(moved) == 1:
            try:
                errs = compare(got, want_ref)
                numerics[moved[0]][choice[moved[0]]] = {
                    "ok": True,
                    "rel_rms": max((x["rel_rms"] for x in errs), default=0.0),
                }
            except Exception as e:
                numerics[moved[0]][choice[moved[0]]] = {"ok": False, "detail": str(getattr(e, "detail", e))}
    for r in rows:
        numerics[r.axis][r.values[0]] = {"ok": True, "rel_rms": 0.0}
    return {"checked": checked, "numerics": numerics}
