"""Soak: 10,000+ generated hostile inputs through the real command line; zero tracebacks allowed.

The generators are the property tests' (tests/hostile.py): Cgfiles, plan files, toolchain locks
and command lines, each a valid document with up to three mutations (wrong types, non-finite and
huge numbers, whitespace and control characters, deletions, unknown keys, nesting thousands
deep) and possibly damaged bytes (invalid UTF-8, NUL, CR, a BOM, truncation). Each input runs
through `cgbuild.cli.main` in this process, as `plan --no-trace --json` (Cgfiles, locks),
`diff` both ways (plans) or `query`/`plan`/`why` (command lines). The contract: exit 0, or exit
2 with exactly one error line; anything else (another exit code, a traceback, an exception out of
`main`) is counted as a failure and its first examples are kept.

Counts are per kind, per category (the first mutation: `valid`, `set-<type>`, `set-deep`,
`delete`, `add`; or the byte damage: `bytes`, `truncate`; for command lines the command) and per
outcome (`ok`, `refused`, `bad:<code>`). Hypothesis generates without shrinking (nothing raises);
`--seed` fixes the run.

Writes benchmarks/results/soak_inputs.json; exits 1 if any input broke the contract.

    python benchmarks/soak_inputs.py [--cgfiles 3500] [--plans 2500] [--locks 2500] [--argvs 2000] [--seed 12]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from harness import REPO, load_average, uncommitted, write_result

sys.path.insert(0, str(REPO / "tests"))

import hostile
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

KINDS = {"cgfile": hostile.cgfiles, "plan": hostile.plans, "lock": hostile.locks, "argv": hostile.argvs}
KEEP_FAILURES = 20


def soak(
    ws: hostile.Workspace, kind: str, strategy: st.SearchStrategy[hostile.Input], n: int, at: int
) -> dict:
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    failures: list[dict[str, Any]] = []

    @seed(at)
    @settings(
        max_examples=n,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(item=strategy)
    def one(item: hostile.Input) -> None:
        outcome = ws.run(item)
        counts[item.category][outcome.name] += 1
        problem = outcome.problem()
        if problem is not None:
            counts[item.category]["contract-broken"] += 1
            if len(failures) < KEEP_FAILURES:
                failures.append(
                    {"category": item.category, "input": repr(item.raw[:600]), "problem": problem}
                )

    started = time.perf_counter()
    one()
    total = sum(sum(c[o] for o in c if o != "contract-broken") for c in counts.values())
    return {
        "inputs": total,
        "wall_s": round(time.perf_counter() - started, 1),
        "outcomes": dict(sum(counts.values(), Counter())),
        "categories": {cat: dict(sorted(c.items())) for cat, c in sorted(counts.items())},
        "failures": failures,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cgfiles", type=int, default=3500)
    ap.add_argument("--plans", type=int, default=2500)
    ap.add_argument("--locks", type=int, default=2500)
    ap.add_argument("--argvs", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=12)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "soak_inputs.json")
    args = ap.parse_args()
    wanted = {"cgfile": args.cgfiles, "plan": args.plans, "lock": args.locks, "argv": args.argvs}
    load_before = load_average()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="cgbuild-soak-") as tmp:
        ws = hostile.Workspace(Path(tmp))
        for i, (kind, n) in enumerate(wanted.items()):
            results[kind] = soak(ws, kind, KINDS[kind](), n, args.seed + i)
            print(f"{kind}: {results[kind]['inputs']} inputs, {results[kind]['outcomes']}", file=sys.stderr)
    broken = sum(r["outcomes"].get("contract-broken", 0) for r in results.values())
    numbers = {
        "what": "generated hostile Cgfiles, plan files, locks and command lines through cgbuild.cli.main",
        "load_average": {"before": load_before, "after": load_average()},
        "versions": {"worktree_clean": uncommitted("cgbuild", "tests/hostile.py") == []},
        "seed": args.seed,
        "contract": "exit 0, or exit 2 with exactly one error line; never a traceback or another exit code",
        "inputs": sum(r["inputs"] for r in results.values()),
        "contract_broken": broken,
        "kinds": results,
    }
    write_result(args.out, "soak_inputs", numbers, packages=("cgbuild", "hypothesis", "tomli-w"))
    print(f"{numbers['inputs']} inputs, {broken} broke the contract → {args.out}", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
