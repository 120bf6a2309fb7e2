"""Where a served step's time goes: each artifact adopted, stepped under torch.profiler, its
kernels grouped, beside its wall time and the host syncs it makes.

    python benchmarks/profile_gpu.py OUT_JSON --workspace WS [--label L ...] [--artifact L=KEY ...]
        [--store DIR | --store-archive STORE.tgz] [--no-lanes] [--lane LANE] [--steps 3]
        [--reps 15] [--commit SHA]

Why: a lane's kernel can win and its step still lose, when the switch that selects it costs more
than the kernel saves (a predicate read back to the host stalls the GPU once per switch). The
profile shows both: kernel time by group, and the device→host copies and synchronising runtime
calls per step.

Each artifact runs in a fresh process: the label's module built from the workspace's entry
(seed-0 weights, as the mint's verification builds it), `adopt(..., strict=True)` (the verdict's
lane re-fitted here, or `--lane`), 3 warm-up calls; wall = median of `--reps` calls timed with
CUDA events (perf_counter on a CPU label); then `--steps` calls under the profiler (CPU and CUDA
activities), reported per step:
- `kernel_ms` and `groups_ms`: on a GPU, the device time of every kernel, copy and memset, each
  named into a group by `GROUPS` (first match wins; unmatched: `other`). On a CPU label the
  profiler sees only the ATen ops the package dispatches (views, copies; their self time):
  Inductor's generated C++ loops and the matmuls its wrapper calls directly record no event, so
  there `wall_ms` is the number and the groups are the dispatch overhead;
- `dtoh_copies`: `Memcpy DtoH` device events; `sync_calls`: `cudaStreamSynchronize`,
  `cudaMemcpy`, `cudaMemcpyAsync`, `cudaEventSynchronize` runtime calls; `host_reads`:
  `aten::item` / `aten::_local_scalar_dense` ops (a tensor's value read back to the host);
- `top`: the 20 largest kernels (name, group, ms and calls per step).

`--label L` profiles the key the workspace plans for L; `--artifact L=KEY` a stored key with L's
module (a banked archive's key whose lanes switched otherwise). `--no-lanes` profiles a copy of
the workspace with its `[family.*.lanes]` tables dropped (the plain program). Writes one JSON
document (machine, versions, date, commit).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import commit_option, cuda_timed, timed, write_result
from targets import built_of, drop_lanes

GROUPS: tuple[tuple[str, str], ...] = (
    # attention first: cuDNN's SDPA kernels also name wgmma and flash, efficient's name gemm
    (r"(?i:flash|fmha|sdpa|scaled_dot_product|efficient_attention|attention|softmax_warp)", "attention"),
    # fp8 scaled-mm and cuBLAS/CUTLASS/nvjet GEMMs; `fused` is the fp8-gemm lane's Triton kernel
    # (rules/fp8_gemm.py); on a CPU label the ATen matmuls
    (r"(?i:gemm|gemv|cutlass|xmma|nvjet|cublas|scaled_mm)|^fused(_\d+)?$", "GEMM"),
    (r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm)$", "GEMM"),
    # the row-wise activation quantization: an absmax reduction fused with the fp8 cast
    (r"(?i:amax|float8|e4m3|quant)", "act-quant"),
    (r"^Memcpy|^Memset|(?i:copy_kernel|CatArrayBatchedCopy)|^aten::(copy_|clone|cat|contiguous)$", "copies"),
    (
        r"^triton_(red|per)_|(?i:reduce_kernel|norm)|^aten::(sum|mean|amax|max|var_mean|softmax)$",
        "other reductions",
    ),
    (
        r"^triton_poi_|(?i:elementwise)|^aten::(add|sub|mul|div|neg|exp|pow|rsqrt|where|clamp|ne|eq)_?$",
        "pointwise",
    ),
    (r"^aten::(gelu|silu|relu|tanh|sigmoid)_?$", "pointwise"),
)
HOST_READS = ("aten::item", "aten::_local_scalar_dense")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaMemcpy", "cudaMemcpyAsync", "cudaEventSynchronize")
WARMUP = 3
ROOT = Path(__file__).resolve().parents[1]


def group_of(name: str) -> str:
    """The group of a kernel (or, on a CPU label, an ATen op) by name: the first rule that matches."""
    return next((group for pattern, group in GROUPS if re.search(pattern, name)), "other")


def summarize(events: list[Any], steps: int, cuda: bool) -> dict[str, Any]:
    """Per-step kernel time by group, the largest kernels, and the host syncs of `events`
    (torch.profiler's `events()` over `steps` calls)."""
    from torch.autograd import DeviceType

    ms: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    names: Counter[str] = Counter()
    for e in events:
        names[e.name] += 1
        device = e.device_type == DeviceType.CUDA
        if cuda and device:
            ms[e.name] += e.time_range.elapsed_us() / 1e3
            calls[e.name] += 1
        elif not cuda and not device and e.name.startswith("aten::"):
            ms[e.name] += e.self_cpu_time_total / 1e3
            calls[e.name] += 1
    groups: Counter[str] = Counter()
    for name, t in ms.items():
        groups[group_of(name)] += t
    top = sorted(ms, key=lambda n: -ms[n])[:20]
    per = lambda x: round(x / steps, 4)  # noqa: E731
    return {
        "kernel_ms": per(sum(ms.values())),
        "kernel_count": per(sum(calls.values())),
        "groups_ms": {g: per(t) for g, t in sorted(groups.items(), key=lambda kv: -kv[1])},
        "dtoh_copies": per(sum(n for name, n in names.items() if name.startswith("Memcpy DtoH"))),
        "sync_calls": {name: per(names[name]) for name in SYNC_CALLS},
        "host_reads": {name: per(names[name]) for name in HOST_READS},
        "top": [[n[:160], group_of(n), per(ms[n]), per(calls[n])] for n in top],
    }


def profiled(call: Callable[[], Any], steps: int, cuda: bool) -> dict[str, Any]:
    """`steps` calls of `call` under torch.profiler (CPU, and CUDA on a GPU), summarized per step."""
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            call()
        if cuda:
            torch.cuda.synchronize()
    return summarize(list(prof.events()), steps, cuda)


def profile(
    ws: Path, label: str, key: str, store: Path, steps: int, reps: int, lane: str | None
) -> dict[str, Any]:
    """One artifact in this process: adopt, warm up, wall, profiled steps (see the docstring)."""
    import torch
    from cgbuild_rules.adopt import adopt

    from cgbuild.store.local import Store

    built = built_of(ws, label)
    served = adopt(key, built.module, store=Store(store), strict=True, lane=lane)
    cuda = next(built.module.parameters()).device.type == "cuda"

    def call() -> Any:
        return served(*built.args, **built.kwargs)

    with torch.inference_mode():
        for _ in range(WARMUP):
            call()
        wall = (cuda_timed if cuda else timed)(call, reps=reps)
        summary = profiled(call, steps, cuda)
    (fit,) = served.lanes.values() or [None]
    return {
        "label": label,
        "key": key,
        "lane": None if fit is None else {"lane": fit.lane, "code": fit.code},
        "device": "cuda" if cuda else "cpu",
        "wall_ms": round(wall * 1e3, 4),
        "steps": steps,
        "reps": reps,
        "counters": dict(served.counters),
        **summary,
    }


def _planned(ws: Path, labels: list[str]) -> dict[str, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "cgbuild.cli", "-C", str(ws), "plan", *labels, "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    return {t["label"]: t["key"] for t in json.loads(proc.stdout)["targets"] if t["label"] in labels}


def _store(opts: argparse.Namespace, ws: Path, work: Path) -> Path:
    if opts.store_archive is not None:
        with tarfile.open(opts.store_archive) as tar:
            tar.extractall(work, filter="data")
        return work / "store"
    return Path(opts.store) if opts.store else ws / ".cgbuild" / "store"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--workspace", type=Path, required=True)
    ap.add_argument("--label", action="append", default=[], help="profile the key the workspace plans")
    ap.add_argument("--artifact", action="append", default=[], help="LABEL=KEY: a stored key, LABEL's module")
    ap.add_argument("--store", default=None)
    ap.add_argument("--store-archive", type=Path, default=None)
    ap.add_argument("--no-lanes", action="store_true", help="a copy of the workspace without lane tables")
    ap.add_argument("--lane", default=None, help="pin this lane (default: the verdict re-fitted here)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reps", type=int, default=15)
    commit_option(ap)
    opts = ap.parse_args()
    if not opts.label and not opts.artifact:
        ap.error("name at least one --label or --artifact")
    work = Path(tempfile.mkdtemp(prefix="profile-"))
    try:
        ws = opts.workspace
        if opts.no_lanes:
            ws = work / "ws"
            shutil.copytree(opts.workspace, ws, ignore=shutil.ignore_patterns(".cgbuild", "__pycache__"))
            drop_lanes(ws / "Cgfile")
        store = _store(opts, opts.workspace, work)
        jobs = [(label, key) for label, key in _planned(ws, opts.label).items()]
        jobs += [tuple(a.split("=", 1)) for a in opts.artifact]  # type: ignore[misc]
        runs = [_spawn(ws, label, key, store, opts) for label, key in jobs]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    numbers = {"what": "served steps under torch.profiler, kernels grouped", "groups": GROUPS, "runs": runs}
    write_result(opts.out, "profile_gpu", numbers, torch=True, commit=opts.commit)
    for r in runs:
        print(
            json.dumps(
                {
                    k: r.get(k)
                    for k in ("label", "lane", "wall_ms", "kernel_ms", "groups_ms", "dtoh_copies", "error")
                }
            )
        )
    return 0


def _spawn(ws: Path, label: str, key: str, store: Path, opts: argparse.Namespace) -> dict[str, Any]:
    """`profile` in a fresh process (no allocator or cache state from another artifact)."""
    argv = [str(ws), label, key, str(store), str(opts.steps), str(opts.reps), opts.lane or ""]
    proc = subprocess.run(
        [sys.executable, __file__, "worker", *argv], capture_output=True, text=True, timeout=3600
    )
    if proc.returncode != 0:
        return {"label": label, "key": key, "error": (proc.stderr + proc.stdout)[-3000:]}
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        _, _, ws, label, key, store, steps, reps, lane = sys.argv
        out = profile(Path(ws), label, key, Path(store), int(steps), int(reps), lane or None)
        print(json.dumps(out), flush=True)
        sys.exit(0)
    sys.exit(main())
