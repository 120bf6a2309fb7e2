"""cgbuild on a GPU, side by side with the paths people use today, on one model and one input.

    python benchmarks/gpu_vs_compile.py all WORK OUT_JSON [--label L] [--phases a,b,...]
                                                      [--store-archive STORE.tgz] [--commit SHA]

Phases, each in its own process so every cold start is honest:
  fp32_ref      the same module and inputs cast to float32: the reference output for errors
  eager         build the module with seed-0 random weights, first output, steady step
  compile_cold  torch.compile with an empty inductor cache: first output, steady step
  compile_warm  torch.compile in a new process over the warm cache
  bare_aoti     torch.export + aoti_compile_and_package under cgbuild's compile policy
  bare_aoti_cxx the same with the host compiler a mint uses (`cpp.cxx`: `choose_cxx()`), not
                the image's `CXX`
  bare_aoti_cxx_beside_check
                bare_aoti_cxx while a second process does what a mint's check stage does
                during the compile (import torch and the entry, build the module, wait)
  mint          `cgbuild mint LABEL` into a copy of the example workspace (wall time, phases)
  adopt         new process: adopt the minted artifact for the live module, first output, steady
  aoti_load     new process: `aoti_load_package` on the minted artifact's package (load only,
                no module built); records the `CXX` it ran under, which Inductor's probes use
`--store-archive` unpacks a store sealed by an earlier `mint` phase into the workspace, so
`adopt` can run without minting again on the same image (the key must still match).
`--no-lanes` drops the example's `[family.*.lanes]` tables (the plain program, no switches).
Errors are relative L2 norms against the fp32 reference (and against eager); peak memory is
`torch.cuda.max_memory_allocated` from the module build through the steady step.
The module, weights and inputs all come from the example entry (`build(spec)`) in "real" mode
(seed 0), so every path runs the same computation. Steady steps: 3 warm-up calls, then the
median of 15 timed with device events on CUDA (perf_counter on the CPU). Prints and writes one
JSON document with the machine, versions, date and commit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness import PhaseClock, commit_option, cuda_timed, timed, write_result
from targets import built_of, drop_lanes

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "flux2_klein"
DEFAULT_LABEL = "//flux2-klein/transformer/1024x1024-t512-b1@bf16:sm_90"
PHASES = ("fp32_ref", "eager", "compile_cold", "compile_warm", "bare_aoti", "mint", "adopt", "aoti_load")
BARE = ("bare_aoti", "bare_aoti_cxx", "bare_aoti_cxx_beside_check")
COLD = ("compile_cold", *BARE)  # phases that start from empty inductor and triton caches


def _plan_entry(ws: Path, label: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "cgbuild.cli", "-C", str(ws), "plan", label, "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    return dict(json.loads(out.stdout)["targets"][0])


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _first(fn: Any, b: Any, device: str) -> tuple[float, Any]:
    import torch

    _sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = fn(*b.args, **b.kwargs)
    _sync(device)
    return time.perf_counter() - t0, out


def _steady(fn: Any, b: Any, device: str) -> float:
    """The median of 15 steps after 3 warm-ups: CUDA events on a GPU, the host's clock on the CPU."""
    import torch

    with torch.inference_mode():
        step = (cuda_timed if device == "cuda" else timed)(lambda: fn(*b.args, **b.kwargs), reps=15, warmup=3)
    return round(step * 1e3, 3)


def _rel_err(out: Any, ref_path: Path) -> float | None:
    import torch

    if not ref_path.exists():
        return None
    ref = torch.load(ref_path)
    got = _main_output(out).float().cpu()
    return float((got - ref).norm() / ref.norm())


def _main_output(out: Any) -> Any:
    return out[0] if isinstance(out, list | tuple) else out


def _errors(rec: dict[str, Any], out: Any, work: Path) -> None:
    rec["rel_err_vs_fp32"] = _rel_err(out, work / "fp32_out.pt")
    rec["rel_err_vs_eager"] = _rel_err(out, work / "eager_out.pt")


def _as_fp32(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    if isinstance(value, list | tuple):
        return type(value)(_as_fp32(v) for v in value)
    if isinstance(value, dict):
        return {k: _as_fp32(v) for k, v in value.items()}
    return value


def phase(name: str, work: Path, label: str) -> dict[str, Any]:
    """Run one phase in this process (called in a fresh child per phase)."""
    rec: dict[str, Any] = {"phase": name}
    clock = PhaseClock(rec, digits=2)
    with clock.phase("import_torch_s"):
        import torch

    ws = work / "ws"
    device = "cpu" if label.endswith(":cpu") else "cuda"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(work / "triton")
    if name == "mint":
        return _mint(rec, ws, label)
    if name == "aoti_load":
        return _aoti_load(rec, ws, label)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    clock = PhaseClock(rec, digits=2)  # its start: the build's, which the check stage is alive from
    with clock.phase("build_s"):
        b = built_of(ws, label)
    rec["params"] = sum(p.numel() for p in b.module.parameters())
    if device == "cuda":
        rec["gpu"] = torch.cuda.get_device_name()
    if name == "fp32_ref":
        b.module.float()
        b.args, b.kwargs = _as_fp32(b.args), _as_fp32(b.kwargs)
        rec["first_s"], out = _first(b.module, b, device)
        torch.save(_main_output(out).float().cpu(), work / "fp32_out.pt")
    elif name == "eager":
        rec["first_s"], out = _first(b.module, b, device)
        rec["steady_ms"] = _steady(b.module, b, device)
        rec["rel_err_vs_fp32"] = _rel_err(out, work / "fp32_out.pt")
        torch.save(_main_output(out).float().cpu(), work / "eager_out.pt")
    elif name in ("compile_cold", "compile_warm"):
        compiled = torch.compile(b.module)
        rec["first_s"], out = _first(compiled, b, device)
        rec["steady_ms"] = _steady(compiled, b, device)
        _errors(rec, out, work)
    elif name in BARE:
        _bare(name, b, work, label, clock)
    elif name == "check_stage":  # built above, as the check stage builds; holds it until the compile ends
        while not (work / "compiled").exists():
            time.sleep(0.2)
        clock.total("alive_s")
    elif name == "adopt":
        _adopt(b, work, label, device, clock)
    if device == "cuda":
        rec["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    for k in ("first_s",):
        if isinstance(rec.get(k), float):
            rec[k] = round(rec[k], 3)
    return rec


def _mint(rec: dict[str, Any], ws: Path, label: str) -> dict[str, Any]:
    """`cgbuild mint LABEL` in a child: its wall time, summary, last progress lines and where it traced."""
    with PhaseClock(rec, digits=2).phase("wall_s"):
        proc = subprocess.run(
            [sys.executable, "-m", "cgbuild.cli", "-C", str(ws), "mint", label, "--json"],
            capture_output=True,
            text=True,
        )
    rec["rc"] = proc.returncode
    lines = proc.stdout.strip().splitlines()
    rec["summary"] = json.loads(lines[-1]) if lines else None
    rec["progress"] = [ln for ln in proc.stderr.splitlines() if ln.startswith("mint ")][-12:]
    rec["traced_here"] = [
        json.loads(p.read_text()).get("traced_here")
        for p in sorted((ws / ".cgbuild" / "mint").glob("*.json"))
    ]
    if proc.returncode:
        rec["stderr_tail"] = proc.stderr[-2000:]
    return rec


def _bare(name: str, b: Any, work: Path, label: str, clock: PhaseClock) -> None:
    """torch.export and AOTI's compile-and-package under cgbuild's compile policy, without cgbuild;
    `bare_aoti_cxx_beside_check` with a check stage's process alive beside the compile."""
    import torch

    from cgbuild.identity import compiler, policy

    rec = clock.record
    configs: dict[str, Any] = dict(policy.inductor_configs(clamps=compiler.torch_clamps_march()))
    rec["cxx"] = os.environ.get("CXX")
    if name != "bare_aoti":
        rec["cxx"] = configs["cpp.cxx"] = compiler.choose_cxx()
    with clock.phase("export_s"):
        from cgbuild_rules.lanes import export

        with torch.inference_mode():  # the program the mint compiles: the lane selector's too
            ep = export(b.module, b.args, b.kwargs, b.dynamic_shapes, b.selector)
    beside = None
    if name == "bare_aoti_cxx_beside_check":  # a mint's check stage starts with the compile
        beside = subprocess.Popen(
            [sys.executable, __file__, "phase", "check_stage", str(work), "--label", label],
            stdout=subprocess.PIPE,
            text=True,
        )
    with clock.phase("compile_s"):
        pkg = torch._inductor.aoti_compile_and_package(
            ep, package_path=str(work / f"{name}.pt2"), inductor_configs=configs
        )
    rec["package_mb"] = round(os.path.getsize(pkg) / 2**20, 2)
    if beside is not None:
        (work / "compiled").touch()
        out, _ = beside.communicate(timeout=120)
        rec["check_stage"] = json.loads(out.strip().splitlines()[-1])
        (work / "compiled").unlink()


def _adopt(b: Any, work: Path, label: str, device: str, clock: PhaseClock) -> None:
    """The minted artifact adopted for the live module: adopt time, first output, steady step, errors."""
    from cgbuild_rules.adopt import adopt

    from cgbuild.store.local import Store

    rec, ws = clock.record, work / "ws"
    key = _plan_entry(ws, label)["key"]
    _sync(device)
    with clock.phase("adopt_s", digits=3):
        served = adopt(key, b.module, store=Store(ws / ".cgbuild" / "store"))
    first, out = _first(served, b, device)
    rec["first_s"] = round(rec["adopt_s"] + first, 3)
    rec["steady_ms"] = _steady(served, b, device)
    rec["served"] = dict(served.counters)
    _errors(rec, out, work)


def _aoti_load(rec: dict[str, Any], ws: Path, label: str) -> dict[str, Any]:
    """Time torch's own package loader on the minted package, outside cgbuild's adopt path."""
    import tempfile

    import torch

    from cgbuild.store.local import Store
    from cgbuild.store.seal import PACKAGE, unseal

    key = _plan_entry(ws, label)["key"]
    rec["cxx_env"] = os.environ.get("CXX")
    with tempfile.TemporaryDirectory() as tmp:
        members = unseal(Store(ws / ".cgbuild" / "store").resolve(key).path, tmp)
        with PhaseClock(rec, digits=3).phase("load_s"):
            torch._inductor.aoti_load_package(str(members[PACKAGE]))
    return rec


def run_all(
    work: Path,
    out_json: Path,
    label: str,
    phases: list[str],
    store_archive: Path | None = None,
    no_lanes: bool = False,
    commit: str | None = None,
) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    ws = work / "ws"
    if not ws.exists():
        shutil.copytree(EXAMPLE, ws, ignore=shutil.ignore_patterns(".cgbuild", "__pycache__"))
        if no_lanes:
            drop_lanes(ws / "Cgfile")
    if store_archive is not None and not (ws / ".cgbuild" / "store").exists():
        import tarfile

        (ws / ".cgbuild").mkdir(exist_ok=True)
        with tarfile.open(store_archive) as tar:
            tar.extractall(ws / ".cgbuild", filter="data")
    results: dict[str, Any] = {}
    for name in phases:
        if name in COLD:
            shutil.rmtree(work / "inductor", ignore_errors=True)
            shutil.rmtree(work / "triton", ignore_errors=True)
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, __file__, "phase", name, str(work), "--label", label],
            capture_output=True,
            text=True,
        )
        wall = round(time.perf_counter() - t0, 2)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        rec = json.loads(lines[-1]) if lines else {"phase": name, "error": proc.stderr[-2000:]}
        rec["process_wall_s"] = wall
        # a phase run twice in one call keeps both records
        results[name if name not in results else f"{name}#{len(results)}"] = rec
        print(json.dumps(rec), flush=True)
        _write(out_json, label, results, commit)  # after every phase: a cut-short run keeps what it measured
    return _write(out_json, label, results, commit)


def _write(out_json: Path, label: str, results: dict[str, Any], commit: str | None) -> dict[str, Any]:
    numbers = {
        "label": label,
        "protocol": "one process per phase; steady = median of 15 timed calls after 3 warm-up",
        "phases": results,
    }
    return write_result(
        out_json, "gpu_vs_compile", numbers, packages=("diffusers",), torch=True, commit=commit
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("all", "phase"))
    ap.add_argument("arg1")
    ap.add_argument("arg2")
    ap.add_argument("--label", default=DEFAULT_LABEL)
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--store-archive", type=Path, help="a store sealed by an earlier mint phase")
    ap.add_argument("--no-lanes", action="store_true", help="drop the example's lane tables")
    commit_option(ap)
    args = ap.parse_args()
    if args.what == "phase":
        print(json.dumps(phase(args.arg1, Path(args.arg2), args.label)), flush=True)
    else:
        phases = args.phases.split(",")
        run_all(
            Path(args.arg1),
            Path(args.arg2),
            args.label,
            phases,
            args.store_archive,
            args.no_lanes,
            args.commit,
        )


if __name__ == "__main__":
    main()
