"""What a mint costs beyond the compile it wraps, and what adopting its artifact costs a server.

Why: `cgbuild mint` puts a lot around one AOTInductor compile (a plan whose trace is the minting
worker's own, a worker with two stage children, a toolchain re-probe, normalization, a
verification run against eager in a fresh process, sealing, admission). That is only worth it
if it is small next to the compile itself, and the artifact only pays off at serving time if
adopting it reaches a first output faster than the alternatives. Both claims are measured here,
on the toy MLP (`//toy/mlp/8x64-b1@fp32:cpu` of examples/toy), side by side in one run.

Every measurement is a fresh process started with `subprocess`; each round runs every case once,
so load from other work on the (shared) box falls on all of them alike. Per round:

(a) `bare_cold`: export + `torch._inductor.aoti_compile_and_package` of the same graph with the
    mint policy's settings (`cgbuild.identity.policy.inductor_configs()`, the host compiler the mint
    chooses as `cpp.cxx`), in the mint's scrubbed environment with a fresh TMPDIR and
    Inductor/Triton cache (cold). Times inside the process (build + export, compile) and the
    whole process; its graph digest, computed after timing, must equal the minted artifact's.
    `bare_warm`: the same in a new process reusing those folders. The distinction matters: on
    a cold TMPDIR Inductor first builds precompiled headers (about 280 MB, most of a cold
    compile here), and a mint never sees that cold state after its first compile on a machine,
    because its sandbox is a FIXED path shared by every mint (`cgbuild_rules.mint`). Whether the
    sandbox held precompiled headers before each mint is recorded.
(b) `mint`: `cgbuild -C WS mint LABEL --json` into a fresh copy of examples/toy per round (so the
    trace cache is cold, the plan's trace is the held worker's, and the store is empty), the
    sandbox as it is; the whole command's wall time, and the phases from its summary (checked
    against the durable mint record). overhead = wall - (export + compile + verify): everything
    the mint adds around the compile and its verification, the plan and seal included, split
    into what the summary lets us attribute.
    It is compared with both bare variants; the target is overhead <= 5% of the bare path.
(c) serving, to first output, each in a fresh process: `adopt`
    (`cgbuild_rules.adopt.adopt(key, module, store=...)` on the stored artifact with a live toy
    module, then the first call; strict, and the call must run compiled); `aoti_load_package`
    (`torch._inductor.aoti_load_package(pt2)` on the unsealed package + `load_constants` from the
    live module + first call); `torch_compile` (`torch.compile(module)` with its defaults, then
    the first call). Each runs first with a fresh TMPDIR and Inductor cache (`_cold`), and the
    two baselines again in a new process reusing those folders (`_warm`). In-process times start
    just after `import torch` (its cost is reported separately); the whole-process wall too.

Writes benchmarks/results/mint_overhead.json (runs, medians, ratios, machine, versions, date).

    python benchmarks/mint_overhead.py [--reps 3] [--budget-s 720]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cgbuild_rules.mint import DEFAULT_SANDBOX
from harness import PhaseClock, load_average, scratch, write_result
from targets import built_of

from cgbuild.core.platform import normalize_arch
from cgbuild.identity import compiler, policy
from cgbuild.store.local import Store
from cgbuild.store.seal import PACKAGE, read_metadata, unseal

HERE = Path(__file__).resolve().parent
TOY = HERE.parent / "examples" / "toy"
RESULT = HERE / "results" / "mint_overhead.json"
LABEL = "//toy/mlp/8x64-b1@fp32:cpu"
TARGET_OVERHEAD_RATIO = 0.05


# ---- children (torch is imported only here) ----------------------------------------------------
def _import_torch() -> float:
    start = time.perf_counter()
    import torch  # noqa: F401

    return time.perf_counter() - start


def _toy() -> tuple[Any, Any]:
    """The toy MLP and its input as the mint's verification builds them (the same program)."""
    built = built_of(TOY, LABEL)
    return built.module, built.args[0]


def child_bare(arg: Mapping[str, Any]) -> dict[str, Any]:
    imported = _import_torch()
    import torch

    clock = PhaseClock({"import_torch": imported}, digits=None)
    module, x = _toy()
    from cgbuild_rules.lanes import export, selector_of

    with torch.no_grad():  # as the trace exports it: the lanes chosen by the selector input
        ep = export(module, (x,), {}, None, selector_of(module))
    clock.lap("export")
    configs: dict[str, Any] = dict(policy.inductor_configs(normalize_arch(platform.machine())))
    configs["cpp.cxx"] = (None, arg["cxx"])
    torch._inductor.aoti_compile_and_package(
        ep, package_path=str(Path(arg["out"]) / PACKAGE), inductor_configs=configs
    )
    clock.lap("compile")
    clock.total("export_compile")
    from cgbuild_rules.digest import graph_facts  # untimed: proves it is the minted graph

    return {**clock.record, "graph_digest": graph_facts(ep).digest}


def _max_abs(got: Any, module: Any, x: Any) -> float:
    import torch

    with torch.no_grad():
        want = type(module).forward(module, x)
    return float((got - want).abs().max())


def child_adopt(arg: Mapping[str, Any]) -> dict[str, Any]:
    imported = _import_torch()
    import torch

    clock = PhaseClock({"import_torch": imported}, digits=None)
    from cgbuild_rules.adopt import adopt

    clock.lap("import_rules")
    module, x = _toy()
    clock.lap("build_module")
    adopted = adopt(arg["key"], module, store=Store(arg["store"]), strict=True)
    clock.lap("adopt")
    with torch.no_grad():
        out = adopted(x)
    clock.lap("first_call")
    clock.total("to_first_output")
    if dict(adopted.counters) != {"compiled": 1}:
        raise SystemExit(f"the first call did not run compiled: {dict(adopted.counters)}")
    return {**clock.record, "max_abs_vs_eager": _max_abs(out, module, x)}


def child_aoti(arg: Mapping[str, Any]) -> dict[str, Any]:
    imported = _import_torch()
    import torch
    from cgbuild_rules.lanes import SELECTOR, selector_of

    clock = PhaseClock({"import_torch": imported}, digits=None)
    module, x = _toy()
    sel = selector_of(module)  # the program's lane selector input (the reference lane)
    lane = {} if sel is None else {SELECTOR: sel}
    clock.lap("build_module")
    compiled = torch._inductor.aoti_load_package(arg["pt2"])
    clock.lap("load_package")
    live = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    compiled.load_constants(
        {fqn: live[fqn].detach() for fqn in compiled.get_constant_fqns()},
        check_full_update=True,
        user_managed=True,
    )
    clock.lap("load_constants")
    with torch.no_grad():
        out = compiled(x, **lane)
    clock.lap("first_call")
    clock.total("to_first_output")
    return {**clock.record, "max_abs_vs_eager": _max_abs(out, module, x)}


def child_torch_compile(arg: Mapping[str, Any]) -> dict[str, Any]:
    imported = _import_torch()
    import torch

    clock = PhaseClock({"import_torch": imported}, digits=None)
    module, x = _toy()
    clock.lap("build_module")
    compiled = torch.compile(module)
    with torch.no_grad():
        out = compiled(x)
    clock.lap("first_call")
    clock.total("to_first_output")
    return {**clock.record, "max_abs_vs_eager": _max_abs(out, module, x)}


def child_import(arg: Mapping[str, Any]) -> dict[str, Any]:
    return {"import_torch": _import_torch()}


CHILDREN: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
    "bare": child_bare,
    "adopt": child_adopt,
    "aoti_load_package": child_aoti,
    "torch_compile": child_torch_compile,
    "import": child_import,
}


# ---- parent ------------------------------------------------------------------------------------
@dataclass
class Run:
    """One fresh process: its wall time and what it reported about itself."""

    wall: float
    inner: dict[str, Any]


def _json_tail(text: str) -> dict[str, Any]:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line))
    raise ValueError("no JSON line")


def _tail(text: str, n: int = 5) -> str:
    return " | ".join(text.strip().splitlines()[-n:])


def run_child(case: str, arg: Mapping[str, Any], env: Mapping[str, str]) -> Run:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", case, json.dumps(dict(arg))]
    start = time.perf_counter()
    proc = subprocess.run(argv, env=dict(env), capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{case} child failed (exit {proc.returncode}): {_tail(proc.stderr)}")
    return Run(wall, _json_tail(proc.stdout))


def _fresh_dirs(root: Path) -> dict[str, str]:
    dirs = {
        "TMPDIR": root / "tmp",
        "TORCHINDUCTOR_CACHE_DIR": root / "inductor",
        "TRITON_CACHE_DIR": root / "triton",
    }
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    return {k: str(v) for k, v in dirs.items()}


def sandbox_env(root: Path, cxx: str) -> dict[str, str]:
    """The mint's scrubbed environment, with this round's own (empty) temp and cache folders."""
    env = policy.mint_environment(os.environ, _fresh_dirs(root))
    env["CXX"] = cxx
    return env


def serving_env(root: Path) -> dict[str, str]:
    """A serving process's environment (this one's), with its own (empty) temp and cache folders."""
    return {**os.environ, **_fresh_dirs(root)}


def cgbuild_argv() -> list[str]:
    script = Path(sys.executable).parent / "cgbuild"
    return [str(script)] if script.exists() else [sys.executable, "-m", "cgbuild.cli"]


def run_mint(ws: Path) -> Run:
    """`cgbuild -C ws mint LABEL --json` in a fresh copy of the toy workspace."""
    shutil.copytree(TOY, ws, ignore=shutil.ignore_patterns(".cgbuild", "__pycache__"))
    argv = [*cgbuild_argv(), "-C", str(ws), "mint", LABEL, "--json"]
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=ws, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"mint failed (exit {proc.returncode}): {proc.stdout[-2000:]} {_tail(proc.stderr)}")
    summary = json.loads(proc.stdout)
    if len(summary["minted"]) != 1 or summary["failed"] or summary["refused"]:
        raise SystemExit(f"expected one minted key: {summary}")
    minted = summary["minted"][0]
    if minted["admission"] != "admitted":
        raise SystemExit(f"admission {minted['admission']!r}, expected a fresh admission")
    record = json.loads((ws / ".cgbuild" / "mint" / f"{minted['key']}.json").read_text())
    if record["state"] != "ok" or record["result"]["phases"] != minted["phases"]:
        raise SystemExit("the mint record disagrees with the summary")
    if record.get("traced_here") is not True:  # the breakdown below reads the held worker's trace
        raise SystemExit("the plan's trace was not the minting worker's own (traced_here)")
    phases = minted["phases"]
    return Run(
        wall,
        {
            "key": minted["key"],
            "summary_seconds": summary["seconds"],
            "record_seconds": record["finished"] - record["started"],
            **{k: phases[k] for k in ("export", "compile", "verify", "seal", "total")},
        },
    )


def med(values: list[float]) -> float:
    return statistics.median(values)


def series(values: list[float], digits: int = 3) -> dict[str, Any]:
    return {"runs": [round(v, digits) for v in values], "median": round(med(values), digits)}


def inner_series(runs: list[Run], *fields: str) -> dict[str, Any]:
    return {f: series([r.inner[f] for r in runs]) for f in fields}


def sandbox_has_pch() -> bool:
    """Does the mint's fixed, shared sandbox already hold Inductor's precompiled headers?"""
    root = Path(DEFAULT_SANDBOX) / "tmp"
    return any(root.glob("*/precompiled_headers/*.gch"))


CASES = (
    "bare_cold",
    "bare_warm",
    "mint",
    "adopt",
    "aoti_load_package_cold",
    "aoti_load_package_warm",
    "torch_compile_cold",
    "torch_compile_warm",
)


def one_round(r: Path, cxx: str, runs: dict[str, list[Run]], facts: dict[str, list[Any]]) -> None:
    """Every case once, in this order; the warm variants reuse the cold run's folders."""
    out = r / "bare-out"
    out.mkdir(parents=True)
    bare_env = sandbox_env(r / "bare", cxx)
    runs["bare_cold"].append(run_child("bare", {"cxx": cxx, "out": str(out)}, bare_env))
    runs["bare_warm"].append(run_child("bare", {"cxx": cxx, "out": str(out)}, bare_env))

    facts["mint_sandbox_pch_before"].append(sandbox_has_pch())
    mint_run = run_mint(r / "ws")
    runs["mint"].append(mint_run)
    key = mint_run.inner["key"]
    store = Store(r / "ws" / ".cgbuild" / "store")
    artifact = store.resolve(key, verify=True).path
    facts["minted_digests"].append(read_metadata(artifact)["graph"]["digest"])
    files = unseal(artifact, r / "unsealed")

    runs["adopt"].append(run_child("adopt", {"key": key, "store": str(store.root)}, serving_env(r / "adopt")))
    aoti_env = serving_env(r / "aoti")
    aoti_arg = {"pt2": str(files[PACKAGE])}
    runs["aoti_load_package_cold"].append(run_child("aoti_load_package", aoti_arg, aoti_env))
    runs["aoti_load_package_warm"].append(run_child("aoti_load_package", aoti_arg, aoti_env))
    tc_env = serving_env(r / "tc")
    runs["torch_compile_cold"].append(run_child("torch_compile", {}, tc_env))
    runs["torch_compile_warm"].append(run_child("torch_compile", {}, tc_env))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="rounds (each runs every case once)")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=720.0,
        help="start no round (after the second) that would end past this",
    )
    ap.add_argument("--out", type=Path, default=RESULT)
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args()

    started = time.perf_counter()
    load_start = load_average()
    cxx = compiler.choose_cxx(None)
    runs: dict[str, list[Run]] = {name: [] for name in CASES}
    facts: dict[str, list[Any]] = {"mint_sandbox_pch_before": [], "minted_digests": [], "round_seconds": []}
    stopped = ""
    with scratch("cgbuild-mint-overhead-", args.keep) as tmp:
        run_child("import", {}, os.environ)  # untimed: torch's files into the page cache
        for rep in range(args.reps):
            elapsed = time.perf_counter() - started
            if rep >= 2 and elapsed / rep * (rep + 1) > args.budget_s:
                stopped = f"stopped after {rep} rounds: round {rep + 1} would end past {args.budget_s:.0f} s"
                break
            round_start = time.perf_counter()
            one_round(tmp / f"round{rep}", cxx, runs, facts)
            facts["round_seconds"].append(round(time.perf_counter() - round_start, 1))
            print(
                f"round {rep + 1}: bare cold {runs['bare_cold'][-1].inner['export_compile']:.1f} s, "
                f"warm {runs['bare_warm'][-1].inner['export_compile']:.1f} s, "
                f"mint {runs['mint'][-1].wall:.1f} s ({facts['round_seconds'][-1]:.0f} s in all)",
                flush=True,
            )
        numbers = summarize(runs, facts, cxx, stopped, load_start, args.reps)
        numbers["benchmark_seconds"] = round(time.perf_counter() - started, 1)
        write_result(args.out, "mint_overhead", numbers, packages=("cgbuild",))
        print(json.dumps({k: numbers[k] for k in ("medians", "ratios", "target")}, indent=2))


FIELDS: dict[str, tuple[str, ...]] = {
    "bare_cold": ("import_torch", "export", "compile", "export_compile"),
    "bare_warm": ("import_torch", "export", "compile", "export_compile"),
    "adopt": ("import_torch", "import_rules", "build_module", "adopt", "first_call", "to_first_output"),
    "aoti_load_package_cold": (
        "import_torch",
        "build_module",
        "load_package",
        "load_constants",
        "first_call",
        "to_first_output",
    ),
    "torch_compile_cold": ("import_torch", "build_module", "first_call", "to_first_output"),
}
FIELDS["aoti_load_package_warm"] = FIELDS["aoti_load_package_cold"]
FIELDS["torch_compile_warm"] = FIELDS["torch_compile_cold"]


def _inner(r: Run, k: str) -> float:
    return float(r.inner[k])


def _median_of(runs: dict[str, list[Run]], name: str, k: str) -> float:
    """The median of what case `name`'s runs reported as `k`."""
    return med([_inner(r, k) for r in runs[name]])


def summarize(
    runs: dict[str, list[Run]],
    facts: dict[str, list[Any]],
    cxx: str,
    stopped: str,
    load_start: list[float],
    reps: int,
) -> dict[str, Any]:
    """The result's numbers: every run, their medians and ratios, the target, the checks."""
    mint = runs["mint"]
    digests = facts["minted_digests"]
    bare_digests = {r.inner["graph_digest"] for name in ("bare_cold", "bare_warm") for r in runs[name]}
    same_graph = len(set(digests)) == 1 and bare_digests == set(digests)
    overhead = [r.wall - (_inner(r, "export") + _inner(r, "compile") + _inner(r, "verify")) for r in mint]
    first = {
        name: _median_of(runs, name, "to_first_output")
        for name in CASES
        if name.startswith(("adopt", "aoti", "torch_compile"))
    }
    comp = compiler.cxx_component(cxx)
    return {
        "what": f"toy MLP {LABEL}: bare AOTI compile vs `cgbuild mint`; adopt vs others to first output",
        "machine": {
            "loadavg_start": load_start,
            "loadavg_end": load_average(),
            "note": "other work may share the CPU while this runs (see loadavg); each round runs every "
            "case once so such load falls on all of them alike, but single runs can be inflated",
        },
        "versions": {"cxx": {k: comp.get(k) for k in ("family", "version")}},
        "label": LABEL,
        "graph_digest": digests[0] if digests else None,
        "reps_requested": reps,
        "reps": len(mint),
        "round_seconds": facts["round_seconds"],
        "stopped_early": stopped or None,
        "settings": settings(),
        "seconds": seconds(runs, overhead),
        **compared(runs, med(overhead), first),
        "checks": {
            "same_graph_digest_bare_and_minted": same_graph,
            "adopt_first_call_ran_compiled": True,  # the adopt child exits non-zero otherwise
            "mint_sandbox_had_precompiled_headers_before_each_mint": facts["mint_sandbox_pch_before"],
            "max_abs_vs_eager": {
                name: max(r.inner["max_abs_vs_eager"] for r in runs[name]) for name in first
            },
        },
    }


def settings() -> dict[str, Any]:
    """How each case ran: the compile policy, the caches and sandboxes, the first call."""
    return {
        "inductor_configs": policy.inductor_configs(normalize_arch(platform.machine())),
        "bare_cold": "mint environment (identity.policy.mint_environment) with a fresh TMPDIR and "
        "Inductor/Triton cache per round; cpp.cxx = the host compiler the mint chooses",
        "bare_warm": "the same, in a new process reusing the cold run's TMPDIR and caches (Inductor's "
        "precompiled headers live under TMPDIR): the state cgbuild's fixed mint sandbox is in "
        "after its first compile",
        "mint": "cgbuild mint LABEL --json into a fresh copy of examples/toy per round (cold trace "
        "cache, empty store); the compile runs in cgbuild's fixed, shared sandbox, as is",
        "serving": "this environment with a fresh TMPDIR and Inductor cache per round (cold); the "
        "warm variants are a new process reusing the cold run's folders. adopt resolves the "
        "key in the round's store (re-hashing the object) and unseals it; aoti_load_package "
        "gets the already-unsealed model.pt2; torch.compile uses its defaults",
        "first_call": "under torch.no_grad(), module in eval mode, seed-0 weights",
    }


def seconds(runs: dict[str, list[Run]], overhead: list[float]) -> dict[str, Any]:
    """Every case's process wall and reported parts; the mint's phases and where its overhead goes."""
    mint = runs["mint"]
    breakdown = {
        # CLI start, workspace load, the toolchain probe, the plan, the held worker's start (its
        # Python, torch and stage) and printing: outside `mint_keys` (which counts from the key's
        # request) less the held worker's trace (`export`), which the plan waits on
        "cli_plan_worker_start": [r.wall - _inner(r, "summary_seconds") - _inner(r, "export") for r in mint],
        # record writes, the hand-over of the key, admission into the store
        "records_admit": [_inner(r, "summary_seconds") - _inner(r, "total") for r in mint],
        # from the key's request, outside the timed phases: the toolchain re-check, the check
        # stage's hand-offs, normalization, the adopt before the seal, metadata
        "worker_untimed": [
            _inner(r, "total") - sum(_inner(r, k) for k in ("compile", "verify", "seal")) for r in mint
        ],
        "seal": [_inner(r, "seal") for r in mint],
    }
    out: dict[str, Any] = {}
    for name in CASES:
        block: dict[str, Any] = {"process_wall": series([r.wall for r in runs[name]])}
        if name == "mint":
            block["phases"] = inner_series(mint, "export", "compile", "verify", "seal", "total")
            block["mint_keys"] = series([_inner(r, "summary_seconds") for r in mint])
            block["overhead"] = series(overhead)
            block["overhead_breakdown"] = {k: series(v) for k, v in breakdown.items()}
        else:
            block.update(inner_series(runs[name], *FIELDS[name]))
        out[name] = block
    return out


def compared(runs: dict[str, list[Run]], overhead_med: float, first: dict[str, float]) -> dict[str, Any]:
    """The medians, the mint's overhead and the serving paths against each other, and the target."""

    def mm(name: str, k: str) -> float:
        return _median_of(runs, name, k)

    bare_cold, bare_warm = mm("bare_cold", "export_compile"), mm("bare_warm", "export_compile")
    verify = mm("mint", "verify")
    wall = {name: med([r.wall for r in runs[name]]) for name in CASES}
    import_torch = [_inner(r, "import_torch") for name in FIELDS for r in runs[name]]
    others = [name for name in first if name != "adopt"]
    return {
        "medians": {
            "import_torch_all_children": round(med(import_torch), 3),
            "bare_cold_export_compile": round(bare_cold, 3),
            "bare_warm_export_compile": round(bare_warm, 3),
            "bare_cold_compile": round(mm("bare_cold", "compile"), 3),
            "bare_warm_compile": round(mm("bare_warm", "compile"), 3),
            "mint_wall": round(wall["mint"], 3),
            "mint_export_phase": round(mm("mint", "export"), 3),
            "mint_compile_phase": round(mm("mint", "compile"), 3),
            "mint_verify_phase": round(verify, 3),
            "mint_overhead": round(overhead_med, 3),
            "to_first_output": {k: round(v, 3) for k, v in first.items()},
            "process_wall": {k: round(v, 3) for k, v in wall.items()},
        },
        "ratios": {
            "mint_overhead_over_bare_cold_export_compile": round(overhead_med / bare_cold, 3),
            "mint_overhead_over_bare_warm_export_compile": round(overhead_med / bare_warm, 3),
            "mint_verify_over_bare_cold_export_compile": round(verify / bare_cold, 4),
            "mint_verify_over_bare_warm_export_compile": round(verify / bare_warm, 4),
            "mint_compile_phase_over_bare_warm_compile": round(
                mm("mint", "compile") / mm("bare_warm", "compile"), 3
            ),
            "mint_wall_over_bare_cold_process_wall": round(wall["mint"] / wall["bare_cold"], 3),
            "mint_wall_over_bare_warm_process_wall": round(wall["mint"] / wall["bare_warm"], 3),
            **{
                f"adopt_over_{name}_to_first_output": round(first["adopt"] / first[name], 4)
                for name in others
            },
            **{f"adopt_over_{n}_process_wall": round(wall["adopt"] / wall[n], 3) for n in others},
        },
        "target": {
            "mint_overhead_ratio_max": TARGET_OVERHEAD_RATIO,
            "met_vs_bare_cold": overhead_med / bare_cold <= TARGET_OVERHEAD_RATIO,
            "met_vs_bare_warm": overhead_med / bare_warm <= TARGET_OVERHEAD_RATIO,
        },
    }


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(CHILDREN[sys.argv[2]](json.loads(sys.argv[3]))), flush=True)
    else:
        main()
