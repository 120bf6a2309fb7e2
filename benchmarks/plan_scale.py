"""What a no-op plan of 10,000+ keyed targets costs: warm `plan --json` and the human summary.

Generates a workspace in a temporary folder: F families (default 42), each with its own entry file
(a copy of examples/toy/toy_models.py with its own config, so each family is its own graph),
modules `mlp` and `conv` with S shapes each (default 10), layouts `fp32` (plain.fp32) and `bf16`
(plain.bf16), served on twelve GPU SKUs over six sm values (sm_80, sm_86, sm_89, sm_90, sm_100,
sm_120; SKUs of one sm share a target) and, for the first C families (default 2), on the CPU:
F*S*4*6 + C*S*4 = 10,160 targets by default, every one keyed.

Keying GPU targets on this CPU-only box: a GPU target's key needs its unit's trace facts, which a
CUDA build of torch would produce (benchmarks/fleet.py installs one; this box's disk holds one
only for another Python). Instead the CPU units are traced for real (the cold plan) and each GPU
unit's facts are seeded into traces.sqlite from its CPU twin (`seed_gpu_facts`: family i mod C,
same module, shape and layout), with a graph digest derived from the GPU unit's own trace inputs
so every unit has its own graph and every target its own key. The plan only reads facts, so what
it costs does not depend on where they came from. For the no-op plan every key is then given a
ref naming one placeholder object (`seed_store`: no mint ran; plan reads refs, stats objects).

Every measured command runs in a fresh process started by `subprocess`:
  python -c pass / python -c "import networkx"   interpreter floors, side by side with the plans
  warm plan --json           every key stored (all `fresh`), nothing moved, stdout to /dev/null
  warm plan (human)          the summary of the same, to /dev/null
  warm, one target           `plan LABEL --json`: the fixed cost (cost_split)
  warm, all mint             a copy of the workspace with an empty store: every key `mint`
  warm plan --json, full     the no-op plan with its memo removed first: planned in full
After two untimed rounds (the first plans record the targets fresh; the memos are written), the
rounds alternate the commands so load on the shared box hits all of them alike; the load averages
before and after are recorded, and for each run whether the memo served it (its index was not
rewritten). Plan runs go through `python -c` that calls `cgbuild.cli.main` and exits 99 if
`torch` was imported. Wall time and the child's CPU time (user + sys) are both reported; medians
are over fresh processes. The environment's PYTHONDONTWRITEBYTECODE is dropped for the children
(an installed tool caches bytecode). A cProfile of one warm `plan --json` is recorded.

The code measured is a snapshot of a commit (`--code`, default HEAD: `git archive` of cgbuild/,
rules/ and the toy entry, first on every child's PYTHONPATH); `--code worktree` measures the
checkout as it is.

Target: a no-op warm plan (--json and human) of 10,000 keyed targets <= 0.3 s.
Writes benchmarks/results/plan_scale.json.

    python benchmarks/plan_scale.py [--families 42] [--shapes 10] [--cpu-families 2] [--reps 9] [--code HEAD]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sqlite3
import statistics
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine import (
    GPU_SKUS,
    LAYOUTS,
    Run,
    cgbuild_argv,
    family_name,
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
RESULT = HERE / "results" / "plan_scale.json"
TARGET_SECONDS = 0.3


# -- keying GPU targets on a CPU-only box -------------------------------------------------------------
def seed_gpu_facts(ws: Path, plan: dict[str, Any], cpu_families: int) -> int:
    """Key the GPU targets without a CUDA torch: write a trace fact for each GPU trace unit.

    A GPU unit's fact is its CPU twin's (same module, shape and layout of family `i % C`) with
    the graph digest re-derived from the GPU unit's own trace inputs, so every GPU unit has a
    graph of its own and its targets distinct keys, as real CUDA traces would give. The topology
    (what the layout axis reads) is the twin's, which is what a CUDA trace of the same module
    reports. Returns the units seeded. This stands in for the traces: the plan only reads facts.
    """
    db = sqlite3.connect(ws / ".cgbuild" / "traces.sqlite")
    facts = dict(db.execute("SELECT inputs, facts FROM traces"))
    by_label = {t["label"]: t for t in plan["targets"]}
    rows: dict[str, str] = {}
    for t in plan["targets"]:
        if t["sm"] == "cpu" or t["trace_inputs"] in rows:
            continue
        fam = int(t["family"][1:])
        twin_label = t["label"].replace(f"//{t['family']}/", f"//{family_name(fam % cpu_families)}/", 1)
        twin = by_label[twin_label.rsplit(":", 1)[0] + ":cpu"]
        fact = json.loads(facts[twin["trace_inputs"]])
        own = hashlib.sha256(f"{fact['graph_digest']}:{t['trace_inputs']}".encode()).hexdigest()
        rows[t["trace_inputs"]] = json.dumps({**fact, "graph_digest": own})
    with db:
        db.executemany("INSERT OR REPLACE INTO traces VALUES (?, ?)", rows.items())
    db.close()
    return len(rows)


def seed_store(ws: Path, keys: set[str]) -> None:
    """A ref for every key naming one placeholder object (a few bytes, not an artifact: no mint
    ran), laid out as the store lays refs out: plan reads the ref and stats the object only."""
    store = ws / ".cgbuild" / "store"
    blob = b"placeholder object: plan_scale seeds refs, it mints nothing\n"
    sha = hashlib.sha256(blob).hexdigest()
    obj = store / "objects" / "sha256" / sha[:2] / sha[2:]
    obj.parent.mkdir(parents=True, exist_ok=True)
    obj.write_bytes(blob)
    for key in keys:
        ref = store / "refs" / key[:2] / f"{key}.json"
        ref.parent.mkdir(parents=True, exist_ok=True)
        doc = {"schema": "cgbuild.ref/1", "key": key, "object": sha, "size": len(blob), "metadata": {}}
        ref.write_text(json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n")


@dataclass
class Keyed:
    """The generated workspace planned cold (its CPU units traced), its GPU units' facts seeded:
    every target keyed, none stored yet."""

    cold_run: Run
    cold_targets: int
    cold_traces: int
    seeded: int
    targets: list[dict[str, Any]]
    keys: set[str]


def keyed(ws: Path, env: dict[str, str], cpu_families: int) -> Keyed:
    """Cold: empty state, every CPU unit traced; then the GPU units' facts seeded (see above)."""
    cold_run, cold = plan_json(ws, env)
    cold_traces = trace_count(ws)
    seeded = seed_gpu_facts(ws, cold, cpu_families)
    _, keyed_plan = plan_json(ws, env)
    targets = keyed_plan["targets"]
    keys = {t["key"] for t in targets if t["key"]}
    assert all(t["status"] == "mint" for t in targets), Counter(t["status"] for t in targets)
    print(f"cold plan: {len(cold['targets'])} targets, {cold_traces} traces, {cold_run.wall:.1f} s")
    print(f"seeded {seeded} GPU units: {len(targets)} targets keyed, {len(keys)} distinct keys", flush=True)
    return Keyed(cold_run, len(cold["targets"]), cold_traces, seeded, targets, keys)


def cases_of(ws: Path, ws_mint: Path, one: str) -> dict[str, tuple[Path, list[str]]]:
    """Each measured command and where it runs: the floors, the no-op plans, the all-mint ones."""
    return {
        "python_pass": (ws, [sys.executable, "-c", "pass"]),
        "python_import_networkx": (ws, [sys.executable, "-c", "import networkx"]),
        "warm_plan_json": (ws, cgbuild_argv("-C", str(ws), "plan", "--json")),
        "warm_plan_human": (ws, cgbuild_argv("-C", str(ws), "plan")),
        "warm_plan_json_one_target": (ws, cgbuild_argv("-C", str(ws), "plan", one, "--json")),
        "warm_plan_json_all_mint": (ws_mint, cgbuild_argv("-C", str(ws_mint), "plan", "--json")),
        "warm_plan_human_all_mint": (ws_mint, cgbuild_argv("-C", str(ws_mint), "plan")),
        # the same no-op plan computed in full: its memo removed before each run
        "warm_plan_json_full": (ws, cgbuild_argv("-C", str(ws), "plan", "--json")),
    }


def warm_up(cases: dict[str, tuple[Path, list[str]]], env: dict[str, str]) -> dict[str, int]:
    """Two untimed rounds: the first plans record the fresh targets and write the memos. Returns
    each command's lines of output."""
    human_lines: dict[str, int] = {}
    for _ in range(2):
        for name, (cwd, argv) in cases.items():
            out = time_process(argv, cwd=cwd, env=env, stdout=subprocess.PIPE)
            human_lines[name] = out.stdout.count("\n")
    return human_lines


def timed_rounds(
    cases: dict[str, tuple[Path, list[str]]], env: dict[str, str], memo: Path, reps: int, full_reps: int
) -> tuple[dict[str, list[Run]], dict[str, list[bool]]]:
    """`reps` rounds alternating the commands (the full plan in the first `full_reps`, its memo
    removed first): each command's runs and whether its memo served each."""
    (full_memo,) = [
        p for p in memo.glob("*.json") if json.loads(p.read_text())["request"]["selector"] == "//..."
    ]
    runs: dict[str, list[Run]] = {name: [] for name in cases}
    memo_hits: dict[str, list[bool]] = {name: [] for name in cases}
    for rep in range(reps):
        for name, (cwd, argv) in cases.items():
            full = name == "warm_plan_json_full"
            if full and rep >= full_reps:
                continue
            if full:
                for part in memo.glob(f"{full_memo.stem}.*"):
                    part.unlink()
            index = sorted((cwd / ".cgbuild" / "cache" / "plans").glob("*.json"))
            stamps = [(p.stat().st_mtime_ns, p.stat().st_ino) for p in index]
            runs[name].append(time_process(argv, cwd=cwd, env=env))
            after = [(p.stat().st_mtime_ns, p.stat().st_ino) for p in index if p.exists()]
            memo_hits[name].append(bool(index) and after == stamps)
    print({name: round(wall, 3) for name, wall in median_walls(runs).items()}, flush=True)
    return runs, memo_hits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", type=int, default=42)
    ap.add_argument("--shapes", type=int, default=10, help="shapes per module")
    ap.add_argument("--cpu-families", type=int, default=2, help="families that also serve on the CPU")
    ap.add_argument("--reps", type=int, default=9, help="fresh processes per warm measurement")
    ap.add_argument("--full-reps", type=int, default=5, help="runs of the plan with its memo removed")
    run_options(ap, RESULT)
    args = ap.parse_args()

    with measured_run(args, "cgbuild-plan-scale-") as bench:
        ws, ws_mint, env = bench.tmp / "ws", bench.tmp / "ws-mint", bench.env
        write_workspace(
            ws, bench.code.toy, families=args.families, shapes=args.shapes, cpu_families=args.cpu_families
        )
        state = keyed(ws, env, args.cpu_families)
        shutil.copytree(ws, ws_mint, symlinks=True)  # nothing moved, nothing stored: every key `mint`
        seed_store(ws, state.keys)  # every key stored: the no-op plan, every target `fresh`

        cases = cases_of(ws, ws_mint, state.targets[0]["label"])
        human_lines = warm_up(cases, env)
        _, warm = plan_json(ws, env)
        n = len(state.targets)
        assert all(t["status"] == "fresh" for t in warm["targets"]) and len(warm["targets"]) == n
        _, warm_mint = plan_json(ws_mint, env)
        assert [t["key"] for t in warm_mint["targets"]] == [t["key"] for t in warm["targets"]]
        assert trace_count(ws) == state.cold_traces + state.seeded
        memo = ws / ".cgbuild" / "cache" / "plans"
        runs, memo_hits = timed_rounds(cases, env, memo, args.reps, args.full_reps)

        cold = state.cold_run
        prof = bench.profile(ws, "-C", str(ws), "plan", "--json")
        numbers: dict[str, Any] = {
            "what": f"cgbuild plan over a generated workspace of {n} keyed targets: warm no-op "
            "(--json and human, every key stored), warm with nothing stored, and the same no-op plan "
            "computed in full; fresh processes",
            "workspace": workspace_facts(args),
            "targets": {
                "total": n,
                "distinct_keys": len(state.keys),
                "traced_units": state.cold_traces,
                "seeded_gpu_units": state.seeded,
                "human_summary_lines": {k: v for k, v in human_lines.items() if "human" in k},
                "plan_json_bytes": len(json.dumps(warm, sort_keys=True, separators=(",", ":"))),
            },
            "reps": args.reps,
            "full_reps": args.full_reps,
            "seconds": {
                "cold_plan_cpu_units_only": {"wall": round(cold.wall, 3), "cpu": round(cold.cpu, 3)},
                **{name: summarize(rs) for name, rs in runs.items()},
            },
            "memo_hit": {name: hits for name, hits in memo_hits.items() if name.startswith("warm")},
            **against_target(runs, n),
            "torch_imported_by_engine": False,  # every timed cgbuild run exits 99 otherwise
            "profile_warm_plan_json": prof,
        }
        result = bench.write("plan_scale", numbers)
        print(json.dumps({k: result[k] for k in ("targets", "ratios", "target", "cost_split")}, indent=2))
        print(json.dumps(result["seconds"], indent=2))


def workspace_facts(args: argparse.Namespace) -> dict[str, Any]:
    """What was generated and how it was keyed and stored without a GPU."""
    return {
        "families": args.families,
        "cpu_families": args.cpu_families,
        "modules_per_family": 2,
        "shapes_per_module": args.shapes,
        "layouts": LAYOUTS,
        "gpu_skus": {name: sm for name, (sm, _) in GPU_SKUS.items()},
        "sm_values": ["cpu", *sorted({sm for sm, _ in GPU_SKUS.values()})],
        "entry": "a copy of examples/toy/toy_models.py per family (<family>_models:build)",
        "keyed_how": "CPU units traced for real; each GPU unit's trace fact is its CPU twin's "
        "(family i mod cpu_families, same module, shape and layout) with a graph digest derived "
        "from its own trace inputs, written into traces.sqlite (seed_gpu_facts): a CUDA torch "
        "would trace them; the plan only reads facts",
        "store_how": "one ref per key naming one placeholder object (seed_store): plan reads "
        "refs and stats objects, nothing was minted",
    }


def against_target(runs: dict[str, list[Run]], n: int) -> dict[str, Any]:
    """The fixed and per-target cost, the ratios to the floors, and the target met or not."""
    med = median_walls(runs)
    cpu_med = {name: statistics.median(r.cpu for r in rs) for name, rs in runs.items()}
    floor = med["python_pass"]
    fixed = cpu_med["warm_plan_json_one_target"]
    per_target_us = (cpu_med["warm_plan_json"] - fixed) / max(n - 1, 1) * 1e6
    return {
        "cost_split": {
            "basis": "median CPU seconds: the one-target no-op plan is the fixed cost; the "
            "all-targets one minus it, per extra target",
            "fixed_cpu_seconds": round(fixed, 4),
            "per_target_us": round(per_target_us, 2),
        },
        "ratios": {
            "warm_json_over_python_pass": round(med["warm_plan_json"] / floor, 2),
            "warm_json_over_import_networkx": round(med["warm_plan_json"] / med["python_import_networkx"], 2),
            "full_over_memo": round(med["warm_plan_json_full"] / med["warm_plan_json"], 2),
        },
        "target": target_met(
            med,
            "warm_plan_seconds_max",
            TARGET_SECONDS,
            "warm_plan_json",
            "warm_plan_human",
            "warm_plan_json_all_mint",
            "warm_plan_human_all_mint",
        ),
    }


if __name__ == "__main__":
    main()
