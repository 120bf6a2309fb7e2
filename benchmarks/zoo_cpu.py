"""The serving zoo on the CPU: what a mint costs and what serving its artifact gives, per model.

Why: the zoo (tests/zoo) holds the state tables real models have (BatchNorm counters, an
encoder a `decode` graph never reads, a tied output head, non-persistent rotary buffers). The
tests prove each one serves compiled; this measures what that buys against the two other ways
to serve the same module, eager and `torch.compile`, on the same inputs and weights.

In a temporary copy of tests/zoo, for every target `cgbuild plan //zoo` lists:

- `mint`: `cgbuild -C WS mint LABEL --json`, its wall seconds and the phases of its summary;
- then PROCS rounds of three fresh processes (`subprocess`), one per path, each with its own
  empty TMPDIR and Inductor cache (TORCHINDUCTOR_CACHE_DIR), each building the module as the
  mint's own serve stage does (`cgbuild_rules.trace.build(job, "real")`: seed 0, eval mode, the
  entry's own inputs):
  - `adopt`: `adopt(key, module, store=..., strict=True)` from the workspace's store (timed:
    resolve with re-hash, unseal, load, bind), then the first call;
  - `eager`: the module's own first call;
  - `torch_compile`: `torch.compile(module)` with its defaults and its first call over the
    empty cache.
  Each then pauses (SETTLE_S), makes 3 warm-up calls and STEPS timed calls (median = steady step), all on the
  entry's inputs under `torch.no_grad()`. The adopt process reports its router counters (every
  call must be served compiled) and the relative RMS error of its outputs against the eager
  forward of the same module; the torch.compile process the same error for comparison. Every
  process reports a sha256 of the module's state and the inputs: all must agree, so every
  path ran on the same inputs and weights. Each timing is reported per process and as the
  median over the PROCS processes of its path.

"first output" = seconds from the built module to the first output (adopt: the adopt call
plus the first call; torch.compile: `torch.compile()` plus the first call; eager: the first
call). Building the module and `import torch` are reported apart.

Writes benchmarks/results/zoo_cpu.json and the section "The zoo, measured (CPU)" of
docs/adopt.md from it (`--doc-only` re-renders that section from the committed file).

    python benchmarks/zoo_cpu.py [--steps 100] [--procs 3]
    python benchmarks/zoo_cpu.py --doc-only
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from cgbuild_rules.mint import DEFAULT_SANDBOX, TOLERANCE
from harness import PhaseClock, load_average, scratch, stamp, uncommitted, wall_times, write_json
from targets import built_of

from cgbuild.core.fs import write_atomic

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ZOO = REPO / "tests" / "zoo"
RESULT = HERE / "results" / "zoo_cpu.json"
DOC = REPO / "docs" / "adopt.md"
SECTION = "## The zoo, measured (CPU)"
WARMUP = 3
# After `torch.compile`'s first call, calls on this box take ~5 ms (the interpreter's GIL switch
# interval: they run at once with sys.setswitchinterval(0.001)) for ~0.3 s on an idle box, then
# ~70 us (the rotary module); under load it lasted past 1 s in two of three processes. Every
# path waits this long after its first output before its warm-ups, so the steady step is the
# steady state for all three alike.
SETTLE_S = 3.0
SPREAD = 1.5  # process medians of a steady step further apart than this are named in the doc
PATHS = ("adopt", "eager", "torch_compile")


# ---- children (torch is imported only here) ----------------------------------------------------
def _fingerprint(module: Any, args: tuple[Any, ...]) -> str:
    """sha256 over the module's parameters and buffers (non-persistent ones too: names, dtypes,
    shapes, bytes) and the inputs."""
    import torch

    h = hashlib.sha256()
    named = [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
        *(("arg", a) for a in args),
    ]
    for name, t in named:
        if isinstance(t, torch.Tensor):
            c = t.detach().contiguous().reshape(-1)
            h.update(f"{name}|{c.dtype}|{tuple(t.shape)}|".encode())
            h.update(c.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _rel_rms(got: Any, want: Any) -> float:
    """The largest relative RMS error over the output leaves (the mint's verify measure)."""
    import torch.utils._pytree as pytree

    worst = 0.0
    for g, w in zip(pytree.tree_leaves(got), pytree.tree_leaves(want), strict=True):
        g, w = g.double(), w.double()
        worst = max(worst, float((g - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt().clamp_min(1e-30)))
    return worst


def _steps(fn: Callable[[], Any], steps: int) -> list[float]:
    time.sleep(SETTLE_S)
    return wall_times(fn, reps=steps, warmup=WARMUP)


def child(path: str, arg: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    clock = PhaseClock(out, digits=None)
    with clock.phase("import_torch"):
        import torch

    out["threads"] = torch.get_num_threads()
    with clock.phase("build_module"):
        built = built_of(Path(arg["ws"]), arg["label"])
        module, args = built.module, built.args
    out["fingerprint"] = _fingerprint(module, args)
    with torch.no_grad():
        if path == "adopt":
            from cgbuild_rules.adopt import adopt

            from cgbuild.store.local import Store

            with clock.phase("prepare"):
                served: Any = adopt(arg["key"], module, store=Store(arg["store"]), strict=True)
        elif path == "torch_compile":
            with clock.phase("prepare"):
                served = torch.compile(module)
        else:
            served, out["prepare"] = module, 0.0
        with clock.phase("first_call"):
            first = served(*args)
        out["first_output"] = out["prepare"] + out["first_call"]
        out["steps"] = _steps(lambda: served(*args), arg["steps"])
        if path != "eager":
            out["rel_rms_vs_eager"] = _rel_rms(first, module(*args))
        if path == "adopt":
            out["counters"] = dict(served.counters)
    return out


# ---- parent ------------------------------------------------------------------------------------
def _tail(text: str, n: int = 8) -> str:
    return " | ".join(text.strip().splitlines()[-n:])


def _last_json(text: str) -> dict[str, Any]:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line))
    raise ValueError("no JSON line in the output")


def cgbuild_cli(ws: Path, *args: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    argv = [sys.executable, "-m", "cgbuild.cli", "-C", str(ws), *args]
    t = time.perf_counter()
    proc = subprocess.run(argv, cwd=ws, capture_output=True, text=True)
    return time.perf_counter() - t, proc


def mint(ws: Path, label: str) -> dict[str, Any]:
    """One `cgbuild mint LABEL --json`: wall seconds and the summary's phases, or what failed."""
    pch = any((Path(DEFAULT_SANDBOX) / "tmp").glob("*/precompiled_headers/*.gch"))
    wall, proc = cgbuild_cli(ws, "mint", label, "--json")
    block: dict[str, Any] = {"wall": round(wall, 3), "exit": proc.returncode, "sandbox_had_pch": pch}
    try:
        summary = _last_json(proc.stdout)
    except ValueError:
        return {**block, "error": f"no summary: {_tail(proc.stdout + proc.stderr)}"}
    if proc.returncode != 0 or len(summary["minted"]) != 1:
        return {**block, "error": "mint failed", "failed": summary["failed"], "refused": summary["refused"]}
    (minted,) = summary["minted"]
    return {
        **block,
        "key": minted["key"],
        "admission": minted["admission"],
        "summary_seconds": summary["seconds"],
        "phases": minted["phases"],
    }


def run_child(path: str, arg: Mapping[str, Any], root: Path) -> dict[str, Any]:
    """One fresh process with its own empty TMPDIR and Inductor/Triton caches."""
    dirs = {
        "TMPDIR": root / "tmp",
        "TORCHINDUCTOR_CACHE_DIR": root / "inductor",
        "TRITON_CACHE_DIR": root / "triton",
    }
    for d in dirs.values():
        d.mkdir(parents=True)
    env = {**os.environ, **{k: str(v) for k, v in dirs.items()}}
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", path, json.dumps(dict(arg))]
    t = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        return {"process_wall": round(wall, 3), "error": f"exit {proc.returncode}: {_tail(proc.stderr)}"}
    inner = _last_json(proc.stdout)
    steps = inner.pop("steps")
    return {
        "process_wall": round(wall, 3),
        **{k: round(v, 6) if isinstance(v, float) else v for k, v in inner.items()},
        "steady_step": round(statistics.median(steps), 7),
        "step_min": round(min(steps), 7),
        "step_max": round(max(steps), 7),
    }


MEDIAN_FIELDS = ("import_torch", "build_module", "prepare", "first_call", "first_output", "steady_step")


def path_block(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Every process of one path, and the median over them of each timing."""
    block: dict[str, Any] = {"processes": runs}
    if runs and not any("error" in r for r in runs):
        block["median"] = {f: round(statistics.median(r[f] for r in runs), 7) for f in MEDIAN_FIELDS}
    return block


def checks(entry: Mapping[str, Any], steps: int) -> dict[str, Any]:
    """What must hold for the model's row to mean anything; each False is reported, not hidden."""
    paths = entry["paths"]
    if any("median" not in paths.get(p, {}) for p in PATHS):
        return {"all_paths_ran": False}
    runs = {p: paths[p]["processes"] for p in PATHS}
    calls = 1 + WARMUP + steps
    return {
        "all_paths_ran": True,
        "same_inputs_and_weights": len({r["fingerprint"] for p in PATHS for r in runs[p]}) == 1,
        "every_call_compiled": all(r["counters"] == {"compiled": calls} for r in runs["adopt"]),
        "adopt_within_verify_tolerance": all(
            r["rel_rms_vs_eager"] < float(TOLERANCE["float32"]) for r in runs["adopt"]
        ),
    }


def measure(
    steps: int, procs: int, keep: bool, only: set[str] | None = None, selector: str = "//zoo"
) -> dict[str, Any]:
    started = time.perf_counter()
    load_before = load_average()
    models: dict[str, Any] = {}
    with scratch("cgbuild-zoo-cpu-", keep) as tmp:
        ws = tmp / "ws"
        shutil.copytree(ZOO, ws, ignore=shutil.ignore_patterns(".cgbuild", "__pycache__"))
        _, proc = cgbuild_cli(ws, "plan", selector, "--json")
        if proc.returncode != 0:
            raise SystemExit(f"plan failed: {_tail(proc.stdout + proc.stderr)}")
        targets = json.loads(proc.stdout)["targets"]
        for t in targets:
            label, module = t["label"], t["module"]
            if only is not None and module not in only:
                continue
            entry: dict[str, Any] = {"label": label, "mint": mint(ws, label), "paths": {}}
            models[module] = entry
            print(f"{label}: mint {entry['mint']['wall']:.1f} s", flush=True)
            if "error" in entry["mint"]:
                print(f"  mint failed: {entry['mint']}", flush=True)
                continue
            arg = {
                "ws": str(ws),
                "label": label,
                "key": entry["mint"]["key"],
                "store": str(ws / ".cgbuild" / "store"),
                "steps": steps,
            }
            runs: dict[str, list[dict[str, Any]]] = {path: [] for path in PATHS}
            for i in range(procs):  # rounds of every path, so load from other work falls on all
                for path in PATHS:
                    row = run_child(path, arg, tmp / module / f"{path}{i}")
                    runs[path].append(row)
                    print(f"  {path}: {row.get('first_output', row.get('error'))}", flush=True)
            entry["paths"] = {path: path_block(rows) for path, rows in runs.items()}
            entry["checks"] = checks(entry, steps)
    ran = stamp("diffusers", "cgbuild")
    return {
        "benchmark": "zoo_cpu",
        "what": "per zoo target: cgbuild mint, then adopt vs eager vs torch.compile (cold cache), "
        "each in fresh processes, same inputs and weights",
        **ran,
        "machine": {
            **ran["machine"],
            "loadavg_before": load_before,
            "loadavg_after": load_average(),
            "note": "a busy 2-core box shared with other work: single runs can be inflated",
        },
        "uncommitted": uncommitted(),
        "reps": {
            "mint": 1,
            "processes_per_path": procs,
            "warmup_calls": WARMUP,
            "settle_s": SETTLE_S,
            "timed_calls": steps,
            "note": f"one mint and {procs} processes per path per model (in rounds of every path), to "
            "keep the run short on a shared box; the tables show medians over the processes",
        },
        "definitions": {
            "first_output": "seconds from the built module to its first output: adopt = adopt() + first "
            "call; torch_compile = torch.compile() + first call over an empty TORCHINDUCTOR_CACHE_DIR; "
            "eager = first call",
            "steady_step": f"median of {steps} timed calls after a {SETTLE_S} s pause and {WARMUP} "
            "warm-ups, torch.no_grad() (the pause: see SETTLE_S in the script)",
            "rel_rms_vs_eager": "relative RMS error of the first output against the module's eager "
            "forward in the same process (largest over output leaves)",
            "fingerprint": "sha256 of the module's state and the inputs, per process",
        },
        "tolerance_float32": float(TOLERANCE["float32"]),
        "models": dict(sorted(models.items())),  # by name: the order of the doc's tables
        "benchmark_seconds": round(time.perf_counter() - started, 1),
    }


# ---- the doc section ---------------------------------------------------------------------------
def _s(v: float) -> str:
    return f"{v:.3f} s" if v < 10 else f"{v:.1f} s"


def _ms(v: float) -> str:
    return f"{v * 1e3:.3f} ms" if v < 0.01 else f"{v * 1e3:.2f} ms"


def _x(other: float, adopt: float) -> str:
    """adopt's speed-up over another path: that path's seconds over adopt's (< 1: adopt is slower)."""
    return f"{other / adopt:.3g}×"


def _err(v: float) -> str:
    return "0 (bit-identical)" if v == 0 else f"{v:.1e}"


def _intro(result: Mapping[str, Any]) -> str:
    m, v, reps = result["machine"], result["versions"], result["reps"]
    n = reps["processes_per_path"]
    text = (
        f"Measured on {result['date']} by `benchmarks/zoo_cpu.py` "
        "(`benchmarks/results/zoo_cpu.json`) on a busy 2-core box shared with other work "
        f"({m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; load average "
        f"{m['loadavg_before'][0]} before, {m['loadavg_after'][0]} after), torch {v['torch']}, "
        f"diffusers {v['diffusers']}, Python {v['python']}. Per zoo target, one "
        f"`cgbuild mint LABEL --json`, then {n} fresh processes per path (in rounds of the three "
        "paths), each with its own empty Inductor cache, each building the module as the mint's "
        "serve stage does (seed 0; the same weights and inputs in every process, checked by a "
        "sha256). First output counts from the built module: adopt = `adopt()` from the store + "
        "first call; `torch.compile` = `torch.compile()` + first call over the empty cache; "
        f"eager = first call. Steady step: median of {reps['timed_calls']} timed calls after "
        f"{reps['warmup_calls']} warm-ups, which follow a {reps['settle_s']} s pause after the "
        "first output in every path (right after its first call `torch.compile` serves ~5 ms "
        "calls for ~0.3 s or more on this box, waiting on the GIL). Every timing "
        f"is the median over the {n} processes; one mint per model and {n} processes per path "
        "(few reps, to keep the run short on a shared box), so numbers can be inflated by the "
        "other work on it. Speed-ups are the other path's seconds over adopt's (below 1: adopt "
        "is slower). Relative error: RMS of the path's output minus eager's over eager's, in "
        "one process, the largest over the processes."
    )
    return textwrap.fill(text, 100, break_long_words=False, break_on_hyphens=False)


def _served(e: Mapping[str, Any]) -> str:
    """The adopt processes' router counters, e.g. `{"compiled": 104}` in each of 3 processes."""
    seen = {json.dumps(r["counters"]) for r in e["paths"]["adopt"]["processes"]}
    n = len(e["paths"]["adopt"]["processes"])
    return f"`{seen.pop()}` in each of {n} processes" if len(seen) == 1 else f"`{sorted(seen)}`"


def _overview(models: Mapping[str, Any]) -> list[str]:
    rows = [
        "| model | mint | first output: adopt / eager / `torch.compile` | steady step: adopt / eager "
        "/ `torch.compile` | served |",
        "|---|---|---|---|---|",
    ]
    for module, e in models.items():
        if not e.get("checks", {}).get("all_paths_ran"):
            rows.append(f"| `{module}` | failed (below) | | | |")
            continue
        ad, ea, tc = (e["paths"][k]["median"] for k in PATHS)
        rows.append(
            f"| `{module}` | {_s(e['mint']['wall'])} | {_s(ad['first_output'])} / "
            f"{_s(ea['first_output'])} / {_s(tc['first_output'])} | {_ms(ad['steady_step'])} / "
            f"{_ms(ea['steady_step'])} / {_ms(tc['steady_step'])} | {_served(e)} |"
        )
    return rows


def _model(module: str, e: Mapping[str, Any]) -> list[str]:
    lines = [f"### `{module}` (`{e['label']}`)", ""]
    mt = e["mint"]
    if "error" in mt:
        failed = {k: mt.get(k) for k in ("exit", "error", "failed", "refused")}
        return [*lines, f"The mint failed: `{json.dumps(failed)}`."]
    ph = mt["phases"]
    parts = ", ".join(f"{k} {ph[k]:.2f}" for k in ("export", "compile", "verify", "seal", "adopt") if k in ph)
    lines.append(f"Mint: **{_s(mt['wall'])}** wall ({parts} s inside the worker).")
    p = e["paths"]
    if not e.get("checks", {}).get("all_paths_ran"):
        errors = {k: [r["error"] for r in b["processes"] if "error" in r] for k, b in p.items()}
        return [*lines, "", f"A serving path failed: `{json.dumps(errors)}`."]
    ad, ea, tc = (p[k]["median"] for k in PATHS)
    worst = {k: max(r["rel_rms_vs_eager"] for r in p[k]["processes"]) for k in ("adopt", "torch_compile")}
    c = e["checks"]
    notes = [
        *([] if c["every_call_compiled"] else ["NOT every call was served compiled"]),
        *([] if c["same_inputs_and_weights"] else ["the processes did NOT see the same inputs and weights"]),
        *([] if c["adopt_within_verify_tolerance"] else ["adopt's error is OVER the verify tolerance"]),
    ]
    for k in PATHS:
        steps = [r["steady_step"] for r in p[k]["processes"]]
        if max(steps) > SPREAD * min(steps):
            each = ", ".join(_ms(v) for v in steps)
            notes.append(f"{k}'s steady step differed between its processes ({each}; median shown)")
    return [
        *lines,
        "",
        "| path | `adopt()` / `torch.compile()` | first call | first output | adopt's speed-up "
        "| steady step | adopt's speed-up | rel. error vs eager |",
        "|---|---|---|---|---|---|---|---|",
        f"| **adopt** (store) | {_s(ad['prepare'])} | {_s(ad['first_call'])} | "
        f"**{_s(ad['first_output'])}** | — | **{_ms(ad['steady_step'])}** | — | "
        f"{_err(worst['adopt'])} |",
        f"| eager | — | {_s(ea['first_call'])} | {_s(ea['first_output'])} | "
        f"{_x(ea['first_output'], ad['first_output'])} | {_ms(ea['steady_step'])} | "
        f"{_x(ea['steady_step'], ad['steady_step'])} | — |",
        f"| `torch.compile`, empty cache | {_s(tc['prepare'])} | {_s(tc['first_call'])} | "
        f"{_s(tc['first_output'])} | {_x(tc['first_output'], ad['first_output'])} | "
        f"{_ms(tc['steady_step'])} | {_x(tc['steady_step'], ad['steady_step'])} | "
        f"{_err(worst['torch_compile'])} |",
        "",
        f"Served: {_served(e)}" + "".join(f"; {n}" for n in notes) + ". "
        f"Building the module: {_s(ad['build_module'])} (adopt's processes); "
        f"`import torch`: {_s(ad['import_torch'])}.",
    ]


def _later(result: Mapping[str, Any]) -> list[str]:
    """A line per later run merged into the file (`--merge`): which models it measured, when."""
    return [
        f"`{'`, `'.join(run['models'])}` were measured in a later run of the same script "
        f"({run['date']}, {run['benchmark_seconds']} s, load as the file records; `later_runs` there)."
        for run in result.get("later_runs", [])
    ]


def render(result: Mapping[str, Any]) -> str:
    later = _later(result)
    lines = [SECTION, "", _intro(result), *(["", *later] if later else []), "", *_overview(result["models"])]
    for module, e in result["models"].items():
        lines += ["", *_model(module, e)]
    return "\n".join(lines) + "\n"


def write_doc(result: Mapping[str, Any]) -> None:
    """Replace (or add, before "## Kernel lanes") the zoo section of docs/adopt.md."""
    text = DOC.read_text()
    section = render(result)
    if SECTION in text:
        text = re.sub(
            rf"{re.escape(SECTION)}\n.*?(?=^## |\Z)", lambda _: section + "\n", text, flags=re.S | re.M
        )
    else:
        text = text.replace("## Kernel lanes", section + "\n## Kernel lanes", 1)
    write_atomic(DOC, text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100, help="timed calls per process, after 3 warm-ups")
    ap.add_argument("--procs", type=int, default=3, help="fresh processes per path and model")
    ap.add_argument("--out", type=Path, default=RESULT)
    ap.add_argument("--doc-only", action="store_true", help="re-render docs/adopt.md from --out")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    ap.add_argument("--modules", help="only these zoo modules (comma-separated)")
    ap.add_argument(
        "--selector", default="//zoo", help="the zoo targets to plan (//zoo-heavy: the heavy zoo)"
    )
    ap.add_argument(
        "--merge", action="store_true", help="add the measured models to --out (each keeps its run's facts)"
    )
    args = ap.parse_args()
    if args.doc_only:
        write_doc(json.loads(args.out.read_text()))
        return
    only = set(args.modules.split(",")) if args.modules else None
    result = measure(args.steps, args.procs, args.keep, only, args.selector)
    if args.merge and args.out.exists():
        doc = json.loads(args.out.read_text())
        keys = ("date", "commit", "machine", "versions", "uncommitted", "reps", "benchmark_seconds")
        doc.setdefault("later_runs", []).append(
            {**{k: result[k] for k in keys}, "models": sorted(result["models"])}
        )
        later = {k: {**v, "run": len(doc["later_runs"])} for k, v in result["models"].items()}
        doc["models"] = dict(sorted({**doc["models"], **later}.items()))
        write_json(args.out, doc)
    else:
        write_json(args.out, result)
    write_doc(json.loads(args.out.read_text()))  # the doc from the file alone, as --doc-only
    failed = {
        k: e.get("checks")
        for k, e in result["models"].items()
        if not all(e.get("checks", {0: False}).values())
    }
    print(f"{result['benchmark_seconds']} s; " + (f"FAILED: {failed}" if failed else "all checks hold"))
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(child(sys.argv[2], json.loads(sys.argv[3]))), flush=True)
    else:
        main()
