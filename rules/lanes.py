"""The torch side of kernel lanes: the runtime switch entries build with, and the measurement.

An entry that provides lanes declares them as a literal `LANES = {axis: {value: needs}}` (read by
the engine without importing the entry; `cgbuild.lanes`) and builds, for each axis, one
`LaneSwitch(axis, spec["lanes"][axis])`. The switch carries EVERY value the spec names and picks
one at run time, so one sealed artifact serves every lane and the key never mentions one:

- with two or more values the switch holds `onehot`, a non-persistent int64 buffer of one entry per
  value, and routes through nested `torch.cond` on `onehot[i] != 0`. The buffer is a trace-baked
  literal (its default, value 0 selected, enters the digest and the artifact's
  `constants.safetensors`); adopt binds a different one-hot in its place before the first call.
- the one-hot has at least two elements on purpose: Inductor's uniform-value constant folding
  evaluates single-element constants at compile time (a scalar index would be folded to the
  value it had while compiling, and every other lane silently lost). Measured on torch 2.13.0:
  a 0-d index bound to 2 ran lane 0; the one-hot runs the lane it is bound to. The mint verifies
  every lane of the compiled artifact against eager, so a torch that folds more would fail the
  mint (`verify-mismatch`), never ship a dead lane.
- with one value there is no buffer and no branch: the program is the plain one.

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
import ctypes
import ctypes.util
import itertools
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

WARMUP = 3
TIMED = 9


def one_hot(index: int, n: int) -> torch.Tensor:
    """The switch value selecting value `index` of `n` (int64, on the CPU; move it as needed)."""
    if not 0 <= index < n:
        raise IndexError(f"lane index {index} outside [0, {n})")
    t = torch.zeros(n, dtype=torch.int64)
    t[index] = 1
    return t


def _branch(
    onehot: torch.Tensor, fns: Sequence[Callable[..., Any]], operands: tuple[Any, ...], i: int
) -> Any:
    if i == len(fns) - 1:
        return fns[i](*operands)

    def take(sel: torch.Tensor, *ops: Any) -> Any:
        return fns[i](*ops)

    def rest(sel: torch.Tensor, *ops: Any) -> Any:
        return _branch(sel, fns, ops, i + 1)

    return torch.cond(onehot[i] != 0, take, rest, (onehot, *operands))


class LaneSwitch(nn.Module):
    """One lane axis of a module: every value's implementation, chosen at run time.

    `select(impls, *operands)` calls `impls[value]` for the bound value; every implementation
    takes the same tensor operands and returns tensors of the same shape and dtype (a branch of
    `torch.cond`). Implementations must be real and distinct code paths: the mint checks each
    against eager and against the reference before it may become a candidate.
    """

    onehot: torch.Tensor
    """The buffer of a switch of two or more values (`register_buffer`)."""

    def __init__(self, axis: str, values: Sequence[str]) -> None:
        super().__init__()
        values = tuple(values)
        if not values or len(set(values)) != len(values):
            raise ValueError(f"lane axis {axis!r}: values must be non-empty and distinct, got {values}")
        self.axis = axis
        self.values = values
        if len(values) > 1:
            self.register_buffer("onehot", one_hot(0, len(values)), persistent=False)

    def select(self, impls: Mapping[str, Callable[..., Any]], *operands: Any) -> Any:
        missing = [v for v in self.values if v not in impls]
        if missing:
            raise KeyError(f"lane axis {self.axis!r}: no implementation for {missing}")
        fns = [impls[v] for v in self.values]
        if len(fns) == 1:
            return fns[0](*operands)
        return _branch(self.onehot, fns, operands, 0)

    def set(self, value: str) -> None:
        """Choose `value` for eager calls of this module (in place)."""
        if len(self.values) > 1:
            self.onehot.copy_(one_hot(self.values.index(value), len(self.values)).to(self.onehot.device))
        elif value != self.values[0]:
            raise ValueError(f"lane axis {self.axis!r} has only {self.values[0]!r}")

    def extra_repr(self) -> str:
        return f"axis={self.axis!r}, values={list(self.values)}"


def switches(module: nn.Module) -> dict[str, dict[str, Any]]:
    """axis → {"fqn": the one-hot's FQN (None for a single value), "values"} of a built module.

    One switch per axis: two switches of one axis could be bound to different values, a lane
    combination nobody measured.
    """
    found: dict[str, dict[str, Any]] = {}
    for prefix, mod in module.named_modules():
        if isinstance(mod, LaneSwitch):
            if mod.axis in found:
                raise ValueError(
                    f"two switches for lane axis {mod.axis!r} ({found[mod.axis]['owner']!r}, {prefix!r}): "
                    "share one LaneSwitch per axis"
                )
            fqn = (f"{prefix}.onehot" if prefix else "onehot") if len(mod.values) > 1 else None
            found[mod.axis] = {"fqn": fqn, "values": list(mod.values), "owner": prefix}
    return {axis: {"fqn": s["fqn"], "values": s["values"]} for axis, s in found.items()}


def set_lanes(module: nn.Module, choice: Mapping[str, str]) -> None:
    """Choose per axis for EAGER calls (mint verification, a serving module's own fallback)."""
    for mod in module.modules():
        if isinstance(mod, LaneSwitch) and mod.axis in choice:
            mod.set(choice[mod.axis])


def bindings(
    table: Sequence[Mapping[str, Any]], choice: Mapping[str, str], device: torch.device | str
) -> dict[str, torch.Tensor]:
    """FQN → one-hot for a lane choice, for the switched axes of a sealed lanes table."""
    out: dict[str, torch.Tensor] = {}
    for row in table:
        if row.get("fqn"):
            values = list(row["values"])
            out[row["fqn"]] = one_hot(values.index(choice[row["axis"]]), len(values)).to(device)
    return out


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
) -> list[dict[str, Any]]:
    """The sealed switch table of a built module: {"axis", "values", "fqn"} per declared axis it
    uses, in declaration order. Refuses a switch that does not carry what the spec asked (the
    program would not be the one the key was computed for) and a switch of an undeclared axis."""
    found = switches(module)
    rows: list[dict[str, Any]] = []
    for axis in declared:
        if axis not in found:
            continue  # this module does not use the axis
        want = list(spec_lanes.get(axis) or [])
        if found[axis]["values"] != want:
            raise ValueError(f"LaneSwitch({axis!r}) carries {found[axis]['values']}, the spec asked {want}")
        rows.append({"axis": axis, "values": found[axis]["values"], "fqn": found[axis]["fqn"]})
    stray = sorted(a for a, s in found.items() if a not in declared and s["fqn"])
    if stray:
        raise ValueError(f"switches for undeclared lane axes {stray}: declare them in the Cgfile")
    return rows


def verify_lanes(
    rows: Sequence[Mapping[str, Any]],
    eager: Callable[[Mapping[str, str]], Any],
    compiled: Callable[[Mapping[str, str]], Any],
    compare: Callable[[Any, Any], list[dict[str, Any]]],
) -> dict[str, Any]:
    """Run every lane combination compiled and eager, and check each value against the reference.

    `compare(got, want)` raises on a mismatch (the artifact is wrong: the mint fails, naming the
    lane); the numerics self-check catches it instead (the value is then no candidate). Returns
    {"checked": {lane: errors}, "numerics": {axis: {value: {"ok", "rel_rms"|"detail"}}}}.
    """
    axes = [r["axis"] for r in rows]
    reference = {r["axis"]: r["values"][0] for r in rows}
    want_ref = eager(reference)
    checked: dict[str, Any] = {}
    numerics: dict[str, dict[str, Any]] = {r["axis"]: {} for r in rows}
    for combo in itertools.product(*(r["values"] for r in rows)):
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
        numerics[r["axis"]][r["values"][0]] = {"ok": True, "rel_rms": 0.0}
    return {"checked": checked, "numerics": numerics}
