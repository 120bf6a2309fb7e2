"""Kill a real toy mint with SIGKILL at many points of every phase; after each, nothing is torn.

A copy of examples/toy mints one target (`//toy/mlp/8x64-b1@fp32:cpu`: a trace, a worker, its
compile stage and its check stage (verify, two lanes measured, serve), the seal, admission and
the record). Each kill point waits for its trigger while the mint runs, then SIGKILLs the `cgbuild` process:
- `proc:<text>`: a process carrying this run's marker (an environment variable every child
  inherits, compilers included) whose command line holds the text, e.g. `--stage compile`;
- `log:<text>`: a line of the mint's own progress on stderr (`...: seal`, `...: admitting`);
- `file:<glob>`: a path under the workspace, e.g. the seal's temp or the key's ref;
- `hang:<stage>`: the stage waits on a child that never ends (`CGBUILD_MINT_FAULT`), then
  the kill comes once that child runs;
plus a delay after the trigger. The phase the mint had reached (its last progress line) is
recorded beside the trigger, since a trigger can fire later than planned on a loaded box.

After each kill: every marked process is gone within 10 s (no orphan); `Store.verify_all`
judges every ref and every object (no torn object; no ref without its whole object, i.e. no
half-admitted key); the key is `fresh` only if its ref verifies; then a re-run of the mint
exits 0 with the key minted or already fresh, and verifies. The key's ref is then removed so
the next point mints again (the compile cache in the sandbox stays warm, so later compiles are
cheaper). At the end `cgbuild gc --grace 0` sweeps the killed mints' build leftovers.

Writes benchmarks/results/kill_points.json.

    python benchmarks/kill_points.py [--only N] [--out OUT_JSON]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from harness import REPO, write_result

OUT = REPO / "benchmarks" / "results" / "kill_points.json"
LABEL = "//toy/mlp/8x64-b1@fp32:cpu"
MARK = "CGBUILD_KILL_POINT_MARK"

# (phase, trigger, delay s); "plan-trace" and "held" points run with the trace cache removed:
# the plan's trace is then the held worker's own (its compile stage traces, then waits for the
# key), so they kill the plan's trace and the hand-over of the key to that worker.
COLD = ("plan-trace", "held")
POINTS: list[tuple[str, str, float]] = [
    ("plan-trace", "proc:--stage compile", 0.0),
    ("plan-trace", "proc:--stage compile", 1.0),
    ("plan-trace", "proc:--stage compile", 2.5),
    ("held", "log:: starting", 0.0),
    ("held", "log:: compile", 0.5),
    ("worker-start", "log:: starting", 0.0),
    ("worker-start", "proc:cgbuild_rules.mint", 0.3),
    ("compile", "proc:--stage compile", 0.0),
    ("compile", "proc:--stage compile", 1.5),
    ("compile", "proc:--stage compile", 4.0),
    ("compile", "hang:compile", 0.0),
    ("verify", "proc:--stage check", 0.0),
    ("verify", "proc:--stage check", 1.5),
    ("verify", "hang:verify", 0.0),
    ("measure", "log:: lanes", 0.0),
    ("measure", "log:: lanes", 1.0),
    ("measure", "log:lanes: measuring", 0.2),
    ("measure", "hang:measure", 0.0),
    ("seal", "log:: seal", 0.0),
    ("seal", "file:.cgbuild/build/.*.tar.gz.*.tmp", 0.0),
    ("seal", "log:: seal", 0.15),
    ("admission", "file:.cgbuild/build/*.tar.gz", 0.0),
    ("admission", "log:: admitting", 0.0),
    ("admission", "file:.cgbuild/store/tmp/*.tmp", 0.0),
    ("publish-record", "file:.cgbuild/store/refs/*/*.json", 0.0),
    ("publish-record", "log:: done", 0.0),
]


def marked(token: str) -> dict[int, str]:
    want = f"{MARK}={token}".encode()
    found: dict[int, str] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if want in (proc / "environ").read_bytes().split(b"\0"):
                    found[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
    return found


def cgbuild(ws: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cgbuild.cli", "-C", str(ws), *args], capture_output=True, text=True, env=env
    )


def fired(trigger: str, ws: Path, token: str, err: Path, before: set[Path]) -> bool:
    """Whether the trigger holds now; a `file:` trigger counts only paths new since the start
    (earlier kills leave temps that gc sweeps later)."""
    kind, _, what = trigger.partition(":")
    if kind == "proc":
        return any(
            what in c and (what != "cgbuild_rules.mint" or "--stage" not in c) for c in marked(token).values()
        )
    if kind == "hang":
        return any(c.startswith("sleep 3600") for c in marked(token).values())
    if kind == "log":
        return what in err.read_text(errors="replace")
    return bool(set(ws.glob(what)) - before)


def last_phase(err: Path) -> str | None:
    lines = [ln for ln in err.read_text(errors="replace").splitlines() if ln.startswith("mint ")]
    return lines[-1].rpartition(": ")[2] if lines else None


def check_store(ws: Path, key: str | None) -> dict[str, Any]:
    from cgbuild.store.local import Store

    store = Store(ws / ".cgbuild" / "store")
    verdicts = store.verify_all() if (ws / ".cgbuild" / "store").exists() else []
    bad = [f"{v.key[:16]}: {v.status} {v.detail}" for v in verdicts if v.status != "ok"]
    state = store.ref_state(key) if key else None
    return {"bad": bad, "key_state": state, "refs": len(store.ref_keys()) if store.root.exists() else 0}


def run_point(ws: Path, key: str | None, point: tuple[str, str, float], work: Path) -> dict[str, Any]:
    phase, trigger, delay = point
    token = uuid.uuid4().hex
    env = {**os.environ, MARK: token}
    if trigger.startswith("hang:"):
        env["CGBUILD_MINT_FAULT"] = f"{trigger.partition(':')[2]}:hang"
    if phase in COLD:
        (ws / ".cgbuild" / "traces.sqlite").unlink(missing_ok=True)
    err = work / f"err-{token[:8]}"
    before = set(ws.glob(trigger.partition(":")[2])) if trigger.startswith("file:") else set()
    started = time.monotonic()
    with open(err, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cgbuild.cli", "-C", str(ws), "mint", LABEL, "--json"],
            stdout=subprocess.DEVNULL,
            stderr=f,
            env=env,
        )
    while (
        proc.poll() is None
        and not fired(trigger, ws, token, err, before)
        and time.monotonic() - started < 600
    ):
        time.sleep(0.01)
    if proc.poll() is not None:
        outcome: dict[str, Any] = {"killed": False, "why": f"the mint ended (exit {proc.returncode}) first"}
    else:
        time.sleep(delay)
        reached = last_phase(err)
        proc.kill()
        proc.wait()
        outcome = {"killed": proc.poll() == -signal.SIGKILL, "phase_reached": reached}
    outcome["seconds_to_kill"] = round(time.monotonic() - started, 2)
    deadline = time.monotonic() + 10
    while marked(token) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = marked(token)
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    outcome["orphans"] = sorted(survivors.values())
    outcome["traceback"] = "Traceback" in err.read_text(errors="replace")
    after = check_store(ws, key)
    outcome["store_bad_after_kill"] = after["bad"]
    outcome["key_after_kill"] = after["key_state"]
    rerun = cgbuild(ws, "mint", LABEL, "--json")
    summary = json.loads(rerun.stdout.strip().splitlines()[-1]) if rerun.stdout.strip() else {}
    again = check_store(ws, key)
    outcome["rerun"] = {
        "exit": rerun.returncode,
        "minted": len(summary.get("minted", [])),
        "fresh": summary.get("fresh"),
        "failed": [f.get("code") for f in summary.get("failed", [])],
        "traceback": "Traceback" in rerun.stderr,
        "store_bad": again["bad"],
        "key": again["key_state"],
    }
    outcome["passed"] = (
        not outcome["orphans"]
        and not outcome["traceback"]
        and not outcome["store_bad_after_kill"]
        and rerun.returncode == 0
        and not outcome["rerun"]["traceback"]
        and not again["bad"]
        and again["key_state"] == "fresh"
    )
    return {"phase": phase, "trigger": trigger, "delay_s": delay, **outcome}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", type=int, help="run the first N points only (a quick try)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "tests"))
    from cgbuild_rules.reference import write_references
    from conftest import copy_toy

    from cgbuild.store.local import Store

    points = POINTS[: args.only] if args.only else POINTS
    with tempfile.TemporaryDirectory(prefix="cgbuild-kill-") as tmp:
        work = Path(tmp)
        ref_ws = work / "ref" / "toy"
        shutil.copytree(
            REPO / "examples" / "toy", ref_ws, ignore=shutil.ignore_patterns(".cgbuild", "reference")
        )
        write_references(ref_ws)
        ws = copy_toy(work / "toy", ref_ws / "reference")
        plan = json.loads(cgbuild(ws, "plan", LABEL, "--json").stdout)
        key = plan["targets"][0]["key"]
        store = Store(ws / ".cgbuild" / "store")
        results = []
        t0 = time.monotonic()
        for i, point in enumerate(points):
            got = run_point(ws, key, point, work)
            results.append(got)
            print(
                f"{i + 1:2}/{len(points)} {got['phase']:14} {got['trigger']:38} +{got['delay_s']}s: "
                f"{'pass' if got['passed'] else 'FAIL'} (reached {got.get('phase_reached')})",
                flush=True,
            )
            store.ref_path(key).unlink(missing_ok=True)  # the next point mints again
        gc = json.loads(cgbuild(ws, "gc", "--grace", "0", "--json").stdout)
        left = sorted(p.name for p in (ws / ".cgbuild" / "build").iterdir())
        elapsed = time.monotonic() - t0
    killed = [r for r in results if r.get("killed")]
    numbers: dict[str, Any] = {
        "what": f"SIGKILL of `cgbuild mint {LABEL}` at {len(points)} points over every mint phase; "
        "after each: no orphan process, no torn object, no half-admitted key, a clean re-run",
        "seconds": round(elapsed, 1),
        "counts": {
            "points": len(points),
            "killed": len(killed),
            "passed": sum(r["passed"] for r in results),
            "orphans": sum(len(r["orphans"]) for r in results),
            "tracebacks": sum(r["traceback"] or r["rerun"]["traceback"] for r in results),
            "torn_or_half_admitted": sum(
                bool(r["store_bad_after_kill"] or r["rerun"]["store_bad"]) for r in results
            ),
            "by_phase_reached": {
                p: sum(str(r.get("phase_reached")) == p for r in killed)
                for p in sorted({str(r.get("phase_reached")) for r in killed})
            },
        },
        "gc_after": {"build_removed": len(gc["build_removed"]), "build_left": left},
        "points": results,
    }
    write_result(args.out, "kill_points", numbers, packages=("cgbuild",))
    print(json.dumps(numbers["counts"], indent=1))
    return 0 if numbers["counts"]["passed"] == len(points) else 1


if __name__ == "__main__":
    sys.exit(main())
