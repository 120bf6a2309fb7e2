"""A second `cgbuild mint //...` over 1,000+ fresh targets: a no-op that must finish well under 1 s.

Generates a CPU-only workspace in a temporary folder (F families, default 10, each with its own
copy of examples/toy/toy_models.py; modules `mlp` and `conv` with S shapes each, default 25;
layouts `fp32` and `bf16`: F*S*4 = 1,000 targets, each its own key) and runs the real
`cgbuild plan` (every unit traced) to learn the keys.

The store then holds PLACEHOLDER objects: one small distinct file per key ("placeholder for key
…", not an artifact), admitted with `cgbuild.store.local.Store.admit`, because 1,000 real AOTInductor
compiles are out of reach on this box. That is sound for what is measured: deciding that a key is
fresh only reads its ref and stats its object (present, recorded size); the no-op path never
opens, hashes or loads an artifact. `verify` would flag the placeholders; it is not run.

Measured, each as the median of fresh processes started with `subprocess` (cwd = the workspace),
rounds alternating so load on the shared box hits all alike: `python -c pass`, a warm
`cgbuild plan --json`, `cgbuild mint //...` (the human summary) and `cgbuild mint //... --json`.
Each cgbuild run goes through `python -c` that calls `cgbuild.cli.main` and exits 99 if torch was
imported. Every mint run is checked: exit 0, 0 minted, N already fresh, 0 failed, 0 refused; and
after all runs the store holds the same refs and objects and no mint record was written.

The code measured is a snapshot of a commit (`--code`, default HEAD), as in plan_scale.py
(engine.py's `code_under_test`).

Writes benchmarks/results/mint_noop.json.

    python benchmarks/mint_noop.py [--families 10] [--shapes 25] [--reps 7] [--code HEAD]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from engine import (
    LAYOUTS,
    Code,
    Run,
    cgbuild_argv,
    measured_run,
    median_walls,
    plan_json,
    run_options,
    summarize,
    target_met,
    time_process,
    trace_count,
    write_workspace,
)

HERE = Path(__file__).resolve().parent
RESULT = HERE / "results" / "mint_noop.json"
TARGET_SECONDS = 1.0


def admit_placeholders(ws: Path, plan: dict[str, Any], code: Code) -> tuple[int, float]:
    """One distinct placeholder object per key, through the measured code's own store.

    Returns (keys admitted, seconds).
    """
    if code.pythonpath is not None:
        sys.path.insert(0, str(code.pythonpath))
    from cgbuild.store.local import Store

    labels: dict[str, list[str]] = {}
    for t in plan["targets"]:
        labels.setdefault(t["key"], []).append(t["label"])
    store = Store(ws / ".cgbuild" / "store")
    scratch = ws.parent / "placeholder"
    start = time.perf_counter()
    for key, names in labels.items():
        scratch.write_text(f"cgbuild benchmark placeholder for key {key}: not an artifact\n")
        admission = store.admit(key, scratch, metadata={"labels": names, "placeholder": True})
        assert admission.status == "admitted", admission
    return len(labels), time.perf_counter() - start


def store_census(ws: Path) -> tuple[int, int]:
    root = ws / ".cgbuild" / "store"
    return len(list((root / "refs").glob("*/*.json"))), len(list((root / "objects").glob("sha256/*/*")))


def check_human(run: Run, n: int) -> None:
    first = run.stdout.splitlines()[0] if run.stdout else ""
    want = f"0 minted, {n} already fresh, 0 failed, 0 refused"
    assert first.startswith(want), f"mint said {first!r}, expected {want!r}"


def check_json(run: Run, n: int) -> None:
    summary = json.loads(run.stdout)
    assert summary["schema"] == "cgbuild.mint-summary/1", summary.get("schema")
    assert (summary["minted"], summary["failed"], summary["refused"]) == ([], [], []), summary
    assert summary["fresh"] == n, summary["fresh"]


def measure(ws: Path, env: dict[str, str], n: int, reps: int) -> dict[str, list[Run]]:
    """The floor, the warm plan and both no-op mints, `reps` rounds of fresh processes after an
    untimed one; every mint run checked."""
    target = "//..."
    cases: dict[str, list[str]] = {
        "python_pass": [sys.executable, "-c", "pass"],
        "warm_plan_json": cgbuild_argv("-C", str(ws), "plan", "--json"),
        "mint_noop": cgbuild_argv("-C", str(ws), "mint", target),
        "mint_noop_json": cgbuild_argv("-C", str(ws), "mint", target, "--json"),
    }
    checks = {"mint_noop": check_human, "mint_noop_json": check_json}
    for name, argv in cases.items():  # untimed: bytecode and caches keyed to this interpreter
        run = time_process(argv, cwd=ws, env=env, stdout=subprocess.PIPE)
        if name in checks:
            checks[name](run, n)
    runs: dict[str, list[Run]] = {name: [] for name in cases}
    for _ in range(reps):
        for name, argv in cases.items():
            run = time_process(argv, cwd=ws, env=env, stdout=subprocess.PIPE)
            if name in checks:
                checks[name](run, n)
            runs[name].append(run)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", type=int, default=10)
    ap.add_argument("--shapes", type=int, default=25, help="shapes per module")
    ap.add_argument("--reps", type=int, default=7, help="fresh processes per measurement")
    run_options(ap, RESULT)
    args = ap.parse_args()

    with measured_run(args, "cgbuild-mint-noop-") as bench:
        ws, code, env = bench.tmp / "ws", bench.code, bench.env
        write_workspace(
            ws, code.toy, families=args.families, shapes=args.shapes, cpu_families=args.families, gpu=False
        )
        cold_run, cold = plan_json(ws, env)
        n = len(cold["targets"])
        assert all(t["status"] == "mint" and t["key"] for t in cold["targets"]), "every target keyed"
        print(f"cold plan: {n} targets, {trace_count(ws)} traces, {cold_run.wall:.1f} s", flush=True)

        keys, admit_seconds = admit_placeholders(ws, cold, code)
        _, fresh_plan = plan_json(ws, env)
        statuses = Counter(t["status"] for t in fresh_plan["targets"])
        assert statuses == Counter({"fresh": n}), statuses
        census = store_census(ws)
        runs = measure(ws, env, n, args.reps)
        assert store_census(ws) == census, "a no-op mint changed the store"
        assert not (ws / ".cgbuild" / "mint").exists(), "a no-op mint wrote mint records"
        summary_line = runs["mint_noop"][-1].stdout.splitlines()[0]
        prof = bench.profile(ws, "-C", str(ws), "mint", "//...", "--json")
        numbers: dict[str, Any] = {
            "what": f"a second `cgbuild mint //...` over {n} fresh CPU targets: nothing to mint",
            **setting(args, keys),
            "targets": {"total": n, "fresh": statuses["fresh"], "distinct_keys": keys},
            "mint_summary_line": summary_line.split(" into ")[0],  # the store path is this machine's
            "checks": {
                "exit_code": 0,
                "minted": 0,
                "fresh": n,
                "failed": 0,
                "refused": 0,
                "store_unchanged": True,
                "mint_records_written": 0,
                "torch_imported_by_engine": False,  # every timed cgbuild run exits 99 otherwise
            },
            "reps": args.reps,
            "seconds": {
                "cold_plan_traces": {"wall": round(cold_run.wall, 3), "traces": trace_count(ws)},
                "admit_placeholders": round(admit_seconds, 3),
                **{name: summarize(rs) for name, rs in runs.items()},
            },
            **against_target(runs),
            "profile_mint_noop_json": prof,
        }
        result = bench.write("mint_noop", numbers)
        print(
            json.dumps({k: result[k] for k in ("targets", "ratios", "target", "mint_summary_line")}, indent=2)
        )
        print(json.dumps(result["seconds"], indent=2))


def setting(args: argparse.Namespace, keys: int) -> dict[str, Any]:
    """What the store holds and what the workspace was generated with."""
    return {
        "store": (
            f"PLACEHOLDER objects: {keys} small distinct files (one per key) admitted with "
            "cgbuild.store.local.Store.admit, not compiled artifacts. Deciding a key is fresh reads "
            "its ref and stats its object; the no-op path never opens an artifact."
        ),
        "workspace": {
            "families": args.families,
            "modules_per_family": 2,
            "shapes_per_module": args.shapes,
            "layouts": LAYOUTS,
            "skus": {"cpu": "cpu"},
            "entry": "a copy of examples/toy/toy_models.py per family (<family>_models:build)",
        },
    }


def against_target(runs: dict[str, list[Run]]) -> dict[str, Any]:
    """The no-op mints against the floor and the warm plan, and the target met or not."""
    med = median_walls(runs)
    return {
        "ratios": {
            "mint_noop_over_python_pass": round(med["mint_noop"] / med["python_pass"], 2),
            "mint_noop_over_warm_plan_json": round(med["mint_noop"] / med["warm_plan_json"], 2),
            "mint_noop_json_over_warm_plan_json": round(med["mint_noop_json"] / med["warm_plan_json"], 2),
        },
        "target": target_met(med, "mint_noop_seconds_max", TARGET_SECONDS, "mint_noop", "mint_noop_json"),
    }


if __name__ == "__main__":
    main()
