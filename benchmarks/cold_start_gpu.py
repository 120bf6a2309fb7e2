"""A serving worker's whole cold start, part by part, each worker a new process.

    python benchmarks/cold_start_gpu.py WORK OUT_JSON --store-archive STORE.tgz [--label L] [--reps N]

Every path reads the same safetensors checkpoint (written once from the entry's seed-0 weights)
the same way, `cgbuild_rules.weights.read_checkpoint` straight onto the GPU, and runs the same
inputs. Parts, timed inside the worker from its first line (the parent also times the whole
process, interpreter start included):
  import_torch   `import torch` (and CUDA's initialisation, forced by the first device call)
  import_model   importing the entry (the model's code: diffusers); the headless path skips it
  weights        the module built on the meta device (nothing initialised) and the checkpoint's
                 tensors read onto the GPU and assigned to it; headless: the read alone
  prepare        adopt (cgbuild), `torch.compile(...)` (compile paths), nothing (eager)
  first_call     the first output
The harness (reading the Cgfile for the call's shapes and making the inputs) is timed apart: a
serving process gets its call from its request; `to_first_output_less_harness` leaves it out.
Paths: eager; torch.compile over a warm cache (a cold compile fills it first, in the same WORK);
cgbuild adopt (the module from the entry, eager fallback available); cgbuild headless
(`cgbuild_rules.adopt.serve_checkpoint`: the artifact bound to the checkpoint's tensors, the
model's code never imported, no eager fallback); headless with safetensors' own tensor-by-tensor
`load_file(device="cuda")` in place of cgbuild's reader (side by side). Warm: the checkpoint in
the page cache. Cold: a fresh copy of the file written with O_DIRECT (`dd iflag=direct oflag=direct`), so no
page of it is cached when the worker reads it. A weight swap (`Adopted.rebind()` after new
tensors of the same layout are assigned) is timed in the adopt worker. Steady step: 3 warm-up
calls, median of 15 CUDA-event-timed calls. Writes one JSON document (machine, versions, date,
commit: `--commit` where the tree carries no .git).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

from harness import PhaseClock, commit_option, cuda_timed, write_result
from targets import drop_lanes, job_of

T0 = time.perf_counter()
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "flux2_klein"
DEFAULT_LABEL = "//flux2-klein/transformer/1024x1024-t512-b1@bf16:sm_90"
PATHS = ("headless", "headless_tensorwise", "adopt", "eager", "compile_warm")
SUMMARY = (
    "process_wall",
    "to_first_output",
    "to_first_output_less_harness",
    "harness",
    "import_torch",
    "import_cgbuild",
    "import_model",
    "weights",
    "prepare",
    "first_call",
    "steady_ms",
)


def _since() -> float:
    return round(time.perf_counter() - T0, 3)


def _inputs(job: dict[str, Any]) -> tuple[Any, ...]:
    """The transformer's call at this graph class, built with torch alone (no model code)."""
    import torch

    spec, model = job["spec"], job["config"]["model"]
    rows, cols, text = spec["height"] // 16, spec["width"] // 16, spec["text_len"]
    g = torch.Generator().manual_seed(0)
    img = torch.zeros(rows * cols, 4, dtype=torch.int64)
    img[:, 1] = torch.arange(rows).repeat_interleave(cols)
    img[:, 2] = torch.arange(cols).repeat(rows)
    txt = torch.zeros(text, 4, dtype=torch.int64)
    txt[:, 3] = torch.arange(text)
    dt = torch.bfloat16
    return (
        # transposed, as the pipeline packs latents and the entry traces them (`.to` keeps strides)
        torch.randn(1, model["in_channels"], rows * cols, generator=g).transpose(1, 2).to("cuda", dt),
        torch.randn(1, text, model["joint_attention_dim"], generator=g).to("cuda", dt),
        torch.rand(1, generator=g).to("cuda", dt),
        img.cuda(),
        txt.cuda(),
    )


def _steady(fn: Any, args: tuple[Any, ...]) -> float:
    import torch

    with torch.inference_mode():
        return round(cuda_timed(lambda: fn(*args), reps=15, warmup=3) * 1e3, 3)


def worker(path: str, ws: Path, label: str, ckpt: Path, artifact: Path | None) -> dict[str, Any]:
    """One worker's cold start, from its first line to its first output."""
    rec: dict[str, Any] = {"path": path, "checkpoint": ckpt.name}
    import torch

    torch.cuda.init()
    torch.empty(1, device="cuda")
    rec["import_torch"] = _since()
    clock = PhaseClock(rec)
    with clock.phase("harness"):
        job = job_of(ws, label)
        args = _inputs(job)
        torch.cuda.synchronize()
    if path.startswith("headless"):
        fn, module = _headless(path, ckpt, artifact, clock), None
    else:
        fn, module = _from_module(path, ws, job, ckpt, artifact, clock)
    with clock.phase("first_call"):
        with torch.inference_mode():
            out = fn(*args)
        torch.cuda.synchronize()
    rec["to_first_output"] = _since()
    rec["to_first_output_less_harness"] = round(rec["to_first_output"] - rec["harness"], 3)
    rec["out_sum"] = float(out.float().sum())  # the same weights give the same output, either reader
    rec["steady_ms"] = _steady(fn, args)
    if path in ("adopt", "headless", "headless_tensorwise"):
        rec["served"] = dict(fn.counters)
    if path == "adopt":
        _rebind(fn, module, args, clock)
    rec["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    del out
    return rec


def _headless(path: str, ckpt: Path, artifact: Path | None, clock: PhaseClock) -> Any:
    """The artifact served from the checkpoint's tensors alone: no model code imported."""
    import torch

    with clock.phase("import_cgbuild"):
        from cgbuild_rules.adopt import serve_checkpoint
        from cgbuild_rules.weights import read_checkpoint
        from safetensors.torch import load_file

    with clock.phase("weights"):
        if path == "headless_tensorwise":  # safetensors' own loader, tensor by tensor (the old reader)
            tensors = load_file(str(ckpt), device="cuda")
        else:
            tensors = read_checkpoint(ckpt, "cuda")
        torch.cuda.synchronize()
    with clock.phase("prepare"):
        fn = serve_checkpoint(artifact, tensors)
    clock.record["model_code_imported"] = "diffusers" in sys.modules
    return fn


def _from_module(
    path: str, ws: Path, job: dict[str, Any], ckpt: Path, artifact: Path | None, clock: PhaseClock
) -> tuple[Any, Any]:
    """The model built from its code and the checkpoint, then adopted, compiled or left eager."""
    import torch

    with clock.phase("import_model"):
        sys.path.insert(0, str(ws))
        import flux2_entry  # noqa: F401  (the model's code, as a serving process imports it)

    from cgbuild_rules.weights import module_from_checkpoint, read_checkpoint

    with clock.phase("weights"):
        module = module_from_checkpoint(job, read_checkpoint(ckpt, "cuda"), "cuda")
        torch.cuda.synchronize()
    with clock.phase("prepare"):
        if path == "adopt":
            from cgbuild_rules.adopt import adopt

            fn = adopt(artifact, module)
        elif path.startswith("compile"):
            fn = torch.compile(module)
        else:
            fn = module
    return fn, module


def _rebind(fn: Any, module: Any, args: tuple[Any, ...], clock: PhaseClock) -> None:
    """A weight swap: new tensors of the same layout (a merged LoRA, say), bound without a re-mint."""
    import torch

    rec = clock.record
    with torch.no_grad():
        swapped = {k: v * 1.01 if v.is_floating_point() else v for k, v in module.state_dict().items()}
    module.load_state_dict(swapped, assign=True)
    with clock.phase("rebind_s", digits=4):
        fn.rebind()
        torch.cuda.synchronize()
    with torch.inference_mode():
        got = fn(*args).float()
        want = module(*args).float()
    rec["rebind_rel_err_vs_eager"] = float((got - want).norm() / want.norm())
    rec["served_after_rebind"] = dict(fn.counters)


def _spawn(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env)
    wall = round(time.perf_counter() - t, 3)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    rec = json.loads(lines[-1]) if lines else {"path": args[1], "error": proc.stderr[-3000:]}
    rec["process_wall"] = wall
    return rec


def _fresh_copy(src: Path, dest: Path) -> None:
    """A copy none of whose pages is cached (O_DIRECT on both sides)."""
    dest.unlink(missing_ok=True)
    subprocess.run(
        ["dd", f"if={src}", f"of={dest}", "bs=64M", "iflag=direct", "oflag=direct", "status=none"], check=True
    )


def _setup(work: Path, label: str, archive: Path, no_lanes: bool) -> tuple[Path, Path, Path]:
    import torch
    from cgbuild_rules import trace
    from cgbuild_rules.weights import write_checkpoint

    from cgbuild.store.local import Store

    ws = work / "ws"
    if not ws.exists():
        shutil.copytree(EXAMPLE, ws, ignore=shutil.ignore_patterns(".cgbuild", "__pycache__"))
        if no_lanes:
            sys.path.insert(0, str(ROOT / "benchmarks"))
            drop_lanes(ws / "Cgfile")
    store_root = work / "store"
    if not store_root.exists():
        with tarfile.open(archive) as tar:
            tar.extractall(work, filter="data")
    plan = json.loads((ROOT / "benchmarks" / "results" / "gpu_sm90_plan.json").read_text())
    key = next(t["key"] for t in plan["targets"] if t["label"] == label)
    artifact = Store(store_root).resolve(key, verify=True).path
    ckpt = work / "weights.safetensors"
    if not ckpt.exists():
        built = trace.build(trace.parse_job(job_of(ws, label)), "real")
        write_checkpoint(built.module, ckpt)
        del built
        torch.cuda.empty_cache()
    return ws, ckpt, artifact


def main_all(a: argparse.Namespace) -> dict[str, Any]:
    """Every path's workers (`--reps` rounds, then the cold page-cache ones) and their medians."""
    work, label, reps = a.work, a.label, a.reps
    work.mkdir(parents=True, exist_ok=True)
    clock = PhaseClock(digits=1)
    with clock.phase("setup_s"):
        ws, ckpt, artifact = _setup(work, label, a.store_archive, a.no_lanes)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor"), "PYTHONUNBUFFERED": "1"}
    base = [str(ws), label]
    runs: list[dict[str, Any]] = []

    def run(path: str, checkpoint: Path, page_cache: str) -> None:
        rec = _spawn(["worker", path, *base, str(checkpoint), str(artifact)], env)
        rec["page_cache"] = page_cache
        runs.append(rec)
        print(json.dumps(rec), flush=True)

    run("compile_cold", ckpt, "warm")  # fills the inductor cache the warm compile worker reads
    for _ in range(reps):
        for path in PATHS:
            run(path, ckpt, "warm")
    cold = work / "weights.cold.safetensors"
    for path in ("headless", "adopt") if not a.no_cold else ():
        _fresh_copy(ckpt, cold)
        run(path, cold, "cold")
    cold.unlink(missing_ok=True)
    numbers = {
        "what": "a serving worker's whole cold start to first output, part by part, new process each",
        "label": label,
        "checkpoint_gib": round(ckpt.stat().st_size / 2**30, 2),
        "setup_s": clock.record["setup_s"],
        "reps": reps,
        "lanes": not a.no_lanes,
        "runs": runs,
        "median": _medians(runs),
    }
    return write_result(
        a.out_json,
        "cold_start_gpu",
        numbers,
        packages=("diffusers", "safetensors"),
        torch=True,
        commit=a.commit,
    )


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per path and page cache, the median of every `SUMMARY` part all its good runs report."""
    summary: dict[str, Any] = {}
    for path in PATHS:
        for cache in ("warm", "cold"):
            done = [r for r in runs if r["path"] == path and r["page_cache"] == cache and "error" not in r]
            if done:
                summary.setdefault(path, {})[cache] = {
                    k: round(statistics.median(r[k] for r in done), 3)
                    for k in SUMMARY
                    if all(k in r for r in done)
                }
    return summary


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        _, _, path, ws, label, ckpt, artifact = sys.argv
        print(json.dumps(worker(path, Path(ws), label, Path(ckpt), Path(artifact))), flush=True)
        sys.exit(0)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("work", type=Path)
    p.add_argument("out_json", type=Path)
    p.add_argument("--store-archive", type=Path, required=True)
    p.add_argument("--label", default=DEFAULT_LABEL)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--no-lanes", action="store_true", help="drop the example's lane tables (no switches)")
    p.add_argument("--no-cold", action="store_true", help="skip the cold page-cache workers")
    commit_option(p)
    main_all(p.parse_args())
