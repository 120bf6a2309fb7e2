"""What a plan of 10,000+ targets costs: cold (tracing), warm (nothing moved), incremental (one edit).

Generates a workspace in a temporary folder: F families (default 50), each with its own entry file
(a copy of examples/toy/toy_models.py with its own config, so each family is its own graph and
editing one family re-traces that family only), modules `mlp` and `conv` with S shapes each
(default 10), layouts `fp32` (plain.fp32) and `bf16` (plain.bf16), served on twelve GPU SKUs over
six sm values (sm_80, sm_86, sm_89, sm_90, sm_100, sm_120; SKUs of one sm share a target) and, for
the first C families (default 25), on the CPU: F*S*4*6 + C*S*4 = 13,000 targets by default.

Why this shape: a CPU target's key needs a real trace (a tenth to a few tenths of a second each on
this box, plus one torch import per family), and a CPU target never shares a trace with another
target, so "every target keyed" would mean 10,000+ traces. The GPU sm values multiply targets
without multiplying traces; with this CPU-only torch their targets plan as
`blocked: no-cuda-torch` (refused before any trace; a CUDA build of torch would trace and key
them). So the warm plan covers C*S*4 keyed CPU targets (status `mint`: graph, toolchain and layout
axes, key, and a store lookup in an empty store) plus F*S*4*6 blocked GPU targets, whose plan
entries, reasons and recorded state are built in full but have no key and no store lookup. The
cold plan traces every CPU unit once; the GPU units are never traced. Because keyed targets cost
more than blocked ones, three selections split the warm cost (`cost_split`): one target, every
CPU target (keyed) and every sm_90 target (blocked); their CPU-time differences give a per-target
cost of each kind and an (extrapolated, labelled as such) all-keyed estimate.

Every measured command runs in a fresh process started by `subprocess` (cwd = the workspace):
  python -c pass / python -c "import networkx"   interpreter floors, side by side with the plans
  cold plan            `plan --json`, empty state: every CPU unit traced (once: it is the slow one)
  warm plan --json     nothing moved, stdout to /dev/null (also: the three selections above)
  warm plan (human)    the default summary and table of targets that need action, to /dev/null
                       (fewer runs, --human-reps: each takes tens of seconds)
  incremental          after a comment-only edit of one family's entry file: its CPU units
                       re-trace, find the same graph digests, and the keys stay (early cutoff)
Plan runs go through `python -c` that calls `cgbuild.cli.main` and exits 99 if `torch` was
imported, so every timed run also proves the engine process never imported torch. The warm rounds
alternate the warm commands so load on the shared box hits all of them alike; the load averages
before and after are recorded. Wall time and the child's CPU time (user + sys, including its own
children) are both reported; medians are over fresh processes. The interpreter may cache bytecode
(as an installed tool does): the environment's PYTHONDONTWRITEBYTECODE is dropped for the
children. A cProfile of one warm `plan --json` (fresh process, imports included) is recorded with
its top functions.

The code measured is a snapshot of a commit (`--code`, default HEAD: `git archive` of cgbuild/,
rules/ and the toy entry, first on every child's PYTHONPATH), so edits in the checkout during the
run cannot leak into the numbers; `--code worktree` measures the checkout as it is.

Target: warm plan of 10,000+ targets <= 1 s. Writes benchmarks/results/plan_scale.json.

    python benchmarks/plan_scale.py [--families 50] [--shapes 10] [--cpu-families 25] [--reps 7] [--code HEAD]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.metadata as md
import io
import json
import os
import platform
import re
import resource
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TOY = REPO / "examples" / "toy" / "toy_models.py"
RESULT = HERE / "results" / "plan_scale.json"
TARGET_SECONDS = 1.0

# name: (sm, memory GiB) — SKUs that share an sm share a target (its `skus` lists both).
GPU_SKUS: dict[str, tuple[str, int]] = {
    "a100-40g": ("sm_80", 40),
    "a100-80g": ("sm_80", 80),
    "a10g": ("sm_86", 24),
    "rtx3090": ("sm_86", 24),
    "l4": ("sm_89", 24),
    "l40s": ("sm_89", 48),
    "rtx4090": ("sm_89", 24),
    "h100": ("sm_90", 80),
    "h200": ("sm_90", 141),
    "b200": ("sm_100", 180),
    "rtx5090": ("sm_120", 32),
    "rtx-pro-6000": ("sm_120", 96),
}
LAYOUTS = {"fp32": "plain.fp32", "bf16": "plain.bf16"}

# Runs cgbuild's CLI in this process, then fails (99) if anything imported torch.
NO_TORCH = (
    "import sys\n"
    "from cgbuild.cli.main import main\n"
    "rc = main(sys.argv[1:])\n"
    "sys.exit(rc if 'torch' not in sys.modules else 99)\n"
)

PROFILE = """
import cProfile, io, json, pstats, sys
from contextlib import redirect_stdout
out, argv = sys.argv[1], sys.argv[2:]
prof = cProfile.Profile()
prof.enable()
from cgbuild.cli.main import main
with redirect_stdout(io.StringIO()):
    rc = main(argv)
prof.disable()
rows = [
    {"file": f, "line": ln, "function": fn, "calls": nc, "tottime": round(tt, 4), "cumtime": round(ct, 4)}
    for (f, ln, fn), (cc, nc, tt, ct, _) in pstats.Stats(prof).stats.items()
]
total = sum(r["tottime"] for r in rows)
with open(out, "w") as fh:
    json.dump({"rc": rc, "total": total, "rows": rows, "torch_imported": "torch" in sys.modules}, fh)
"""


# -- shared helpers (also used by mint_noop.py) ------------------------------------------------------
@dataclass
class Run:
    wall: float
    cpu: float
    stdout: str = ""


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


@dataclass
class Code:
    """The engine and rules the measured children import: a git snapshot, or the working tree."""

    ref: str
    commit: str
    pythonpath: Path | None  # first on PYTHONPATH (ahead of the editable install), or None
    toy: Path

    def identity(self) -> dict[str, Any]:
        if self.pythonpath is not None:
            return {
                "code": f"git archive of {self.commit}: committed cgbuild/ and rules/ only",
                "cgbuild_commit": self.commit,
            }
        return {
            "code": "working tree",
            "cgbuild_commit": self.commit,
            "uncommitted_engine_changes": _worktree_changes() or None,
        }


def _worktree_changes() -> str:
    """sha256 over uncommitted changes to cgbuild/ and rules/ (tracked diffs and untracked files)."""
    h = hashlib.sha256(git("diff", "HEAD", "--", "cgbuild", "rules").encode())
    for name in git("ls-files", "--others", "--exclude-standard", "--", "cgbuild", "rules").splitlines():
        h.update(name.encode() + b"\0" + (REPO / name).read_bytes())
    clean = h.hexdigest() == hashlib.sha256(b"").hexdigest()
    return "" if clean else h.hexdigest()


def code_under_test(ref: str, tmp: Path) -> Code:
    """`ref` (a commit-ish, default HEAD) exported to `tmp/code`; `worktree` measures the checkout.

    A snapshot keeps a long run honest while others edit the checkout: the code cannot move.
    """
    if ref == "worktree":
        return Code(ref, git("rev-parse", "--short", "HEAD"), None, TOY)
    commit = git("rev-parse", "--short", "--verify", f"{ref}^{{commit}}")
    dest = tmp / "code"
    archive = subprocess.run(
        ["git", "archive", commit, "cgbuild", "rules", "examples/toy/toy_models.py"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    (dest / "rules").rename(dest / "cgbuild_rules")  # installed as cgbuild_rules
    return Code(ref, commit, dest, dest / "examples" / "toy" / "toy_models.py")


def child_env(code: Code) -> dict[str, str]:
    """The environment for measured children: bytecode caching on, as for an installed tool, and
    the code under test first on the import path."""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if code.pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(code.pythonpath), env.get("PYTHONPATH")) if p)
        where = subprocess.run(
            [
                sys.executable,
                "-c",
                "import cgbuild, cgbuild_rules; print(cgbuild.__file__, cgbuild_rules.__file__)",
            ],
            env=env,
            cwd=code.pythonpath.parent,  # as the measured children: never the checkout (it would shadow)
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        assert all(Path(f).is_relative_to(code.pythonpath) for f in where), f"snapshot not imported: {where}"
    return env


def timed(
    argv: list[str], *, cwd: Path, env: dict[str, str], stdout: int | IO[str] = subprocess.DEVNULL
) -> Run:
    """Run one fresh process; its wall time and CPU time (user + sys, its children included).

    With `stdout=subprocess.PIPE` the output is kept in `Run.stdout` (e.g. a summary to check).
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        why = "the engine process imported torch" if proc.returncode == 99 else proc.stderr[-2000:]
        raise SystemExit(f"{' '.join(argv[:3])} ... exited {proc.returncode}: {why}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Run(wall, cpu, proc.stdout or "")


def cgbuild_argv(*args: str) -> list[str]:
    return [sys.executable, "-c", NO_TORCH, *args]


def summarize(runs: list[Run]) -> dict[str, Any]:
    walls = [round(r.wall, 4) for r in runs]
    cpus = [round(r.cpu, 4) for r in runs]
    return {
        "runs": walls,
        "median": round(statistics.median(walls), 4),
        "cpu_runs": cpus,
        "cpu_median": round(statistics.median(cpus), 4),
    }


def same_versions(before: dict[str, Any], code: Code) -> dict[str, Any]:
    """The versions taken at the start, checked against the end: the code must not move mid-run."""
    after = versions(code)
    if after != before:
        raise SystemExit(f"the measured code changed during the run: {before} -> {after}; run it again")
    return before


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages: the box is shared, so they say how quiet a run was."""
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict[str, Any]:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    mem = re.search(r"^MemTotal:\s*(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
    return {
        "cpu": model.group(1).strip() if model else platform.processor(),
        "cores": os.cpu_count(),
        "memory_gib": round(int(mem.group(1)) / (1 << 20), 1) if mem else None,
        "system": f"{platform.system()} {platform.machine()}",
    }


def versions(code: Code) -> dict[str, Any]:
    def version(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    return {
        "python": platform.python_version(),
        "torch": version("torch"),
        "cgbuild": version("cgbuild"),
        **code.identity(),
        "networkx": version("networkx"),
        "rich": version("rich"),
    }


def trace_count(ws: Path) -> int:
    db = ws / ".cgbuild" / "traces.sqlite"
    if not db.exists():
        return 0
    con = sqlite3.connect(db)
    try:
        return int(con.execute("SELECT COUNT(*) FROM traces").fetchone()[0])
    finally:
        con.close()


def plan_json(ws: Path, env: dict[str, str], *args: str) -> tuple[Run, dict[str, Any]]:
    """A timed `plan --json` whose output is kept and parsed."""
    out = ws.parent / "plan-out.json"
    with open(out, "w") as f:
        run = timed(cgbuild_argv("-C", str(ws), "plan", "--json", *args), cwd=ws, env=env, stdout=f)
    return run, json.loads(out.read_text())


def short_path(path: str, code: Code) -> str:
    """A profile's file name without this machine's folders (the code under test: repo-relative)."""
    for root in (code.pythonpath, REPO):
        if root is not None and path.startswith(str(root) + os.sep):
            rel = path[len(str(root)) + 1 :]
            return "rules" + rel[len("cgbuild_rules") :] if rel.startswith("cgbuild_rules/") else rel
    for marker in ("site-packages/", "/lib/python3."):
        if marker in path:
            rest = path.split(marker, 1)[1]
            return (
                f"<site-packages>/{rest}"
                if marker == "site-packages/"
                else f"<stdlib>/{rest.split('/', 1)[-1]}"
            )
    return path


def profile(ws: Path, env: dict[str, str], code: Code, *args: str, top: int = 25) -> dict[str, Any]:
    """cProfile of one fresh `cgbuild <args>` process (imports included): the top functions."""
    out = ws.parent / "profile.json"
    subprocess.run([sys.executable, "-c", PROFILE, str(out), *args], cwd=ws, env=env, check=True)
    data = json.loads(out.read_text())
    rows = data["rows"]
    for r in rows:
        r["file"] = short_path(r["file"], code)

    def where(r: dict[str, Any]) -> str:
        return f"{r['file']}:{r['line']}({r['function']})"

    by_self = sorted(rows, key=lambda r: -r["tottime"])[:top]
    by_cum = sorted(rows, key=lambda r: -r["cumtime"])[:top]
    return {
        "command": " ".join(args).replace(str(ws), "WORKSPACE"),
        "profiled_seconds": round(data["total"], 3),
        "torch_imported": data["torch_imported"],
        "top_self": [{"where": where(r), "calls": r["calls"], "self": r["tottime"]} for r in by_self],
        "top_cumulative": [{"where": where(r), "calls": r["calls"], "cum": r["cumtime"]} for r in by_cum],
    }


# -- the workspace -----------------------------------------------------------------------------------
def write_workspace(
    ws: Path, toy: Path, *, families: int, shapes: int, cpu_families: int, gpu: bool = True
) -> None:
    """The Cgfile and one entry file per family (a copy of `toy`); `gpu=False`: the CPU SKU only."""
    ws.mkdir(parents=True)
    lines = [
        "# Generated by benchmarks/plan_scale.py: a fleet-sized workspace of toy families.",
        "[workspace]",
        'state = ".cgbuild"',
        "",
        "[sku.cpu]",
        'sm = "cpu"',
        "memory_gib = 16",
    ]
    for name, (sm, gib) in GPU_SKUS.items() if gpu else ():
        lines += ["", f"[sku.{name}]", f'sm = "{sm}"', f"memory_gib = {gib}"]
    for name, quant in LAYOUTS.items():
        lines += ["", f"[layout.{name}]", f'quant = "{quant}"']
    mlp = ", ".join(f'"{8 * (i + 1)}x64"' for i in range(shapes))
    conv = ", ".join(f'"{8 * (i + 1)}x{8 * (i + 1)}"' for i in range(shapes))
    for i in range(families):
        fam = family_name(i)
        shutil.copyfile(toy, ws / f"{fam}_models.py")
        skus = (["cpu"] if i < cpu_families else []) + (list(GPU_SKUS) if gpu else [])
        lines += [
            "",
            f"[family.{fam}]",
            f'entry = "{fam}_models:build"',
            f'sources = ["{fam}_models.py"]',
            f"skus = [{', '.join(json.dumps(s) for s in skus)}]",
            f"layouts = [{', '.join(json.dumps(name) for name in LAYOUTS)}]",
            f"config = {{ hidden = {32 + 8 * i}, out = 10, channels = {8 + i} }}",  # one graph per family
            "",
            f"[family.{fam}.module.mlp]",
            f"shapes = [{mlp}]",
            "batch_sizes = [1]",
            "",
            f"[family.{fam}.module.conv]",
            f"shapes = [{conv}]",
            "batch_sizes = [1]",
        ]
    (ws / "Cgfile").write_text("\n".join(lines) + "\n")


def family_name(i: int) -> str:
    return f"f{i:02d}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", type=int, default=50)
    ap.add_argument("--shapes", type=int, default=10, help="shapes per module")
    ap.add_argument("--cpu-families", type=int, default=25, help="families that also serve on the CPU")
    ap.add_argument("--reps", type=int, default=7, help="fresh processes per warm measurement")
    ap.add_argument("--human-reps", type=int, default=3, help="runs of the human summary (slow)")
    ap.add_argument("--inc-reps", type=int, default=3, help="incremental plans (one edit each)")
    ap.add_argument("--code", default="HEAD", help="commit to measure (exported), or 'worktree'")
    ap.add_argument("--out", type=Path, default=RESULT)
    ap.add_argument("--keep", action="store_true", help="keep the temporary workspace")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="cgbuild-plan-scale-"))
    ws = tmp / "ws"
    started = time.perf_counter()
    load_before = load_average()
    try:
        code = code_under_test(args.code, tmp)
        env = child_env(code)
        at_start = versions(code)
        write_workspace(
            ws, code.toy, families=args.families, shapes=args.shapes, cpu_families=args.cpu_families
        )

        # Cold: empty state, every CPU unit traced.
        cold_run, cold = plan_json(ws, env)
        cold_traces = trace_count(ws)
        targets = cold["targets"]
        statuses = Counter(t["status"] for t in targets)
        keyed = {t["label"]: t["key"] for t in targets if t["key"]}
        cpu_targets = sum(1 for t in targets if t["sm"] == "cpu")
        assert statuses["mint"] == cpu_targets == len(keyed), statuses
        assert statuses["blocked"] == len(targets) - cpu_targets, statuses
        assert all(t["reasons"][0]["code"] == "no-cuda-torch" for t in targets if t["status"] == "blocked")
        print(f"cold plan: {len(targets)} targets, {cold_traces} traces, {cold_run.wall:.1f} s", flush=True)

        # Warm: one untimed run of each command (bytecode, caches keyed to this interpreter's path).
        warm_json_argv = cgbuild_argv("-C", str(ws), "plan", "--json")
        warm_human_argv = cgbuild_argv("-C", str(ws), "plan")
        one = targets[0]["label"]
        cases: dict[str, list[str]] = {
            "python_pass": [sys.executable, "-c", "pass"],
            "python_import_networkx": [sys.executable, "-c", "import networkx"],
            "warm_plan_json": warm_json_argv,
            "warm_plan_human": warm_human_argv,
            # Selections split the cost: per keyed CPU target, per blocked GPU target, and the rest
            # (expanding every target, caches, the recorded last plan) paid whatever is selected.
            "warm_plan_json_one_target": cgbuild_argv("-C", str(ws), "plan", one, "--json"),
            "warm_plan_json_cpu_keyed": cgbuild_argv("-C", str(ws), "plan", ":cpu", "--json"),
            "warm_plan_json_sm_90_blocked": cgbuild_argv("-C", str(ws), "plan", ":sm_90", "--json"),
        }
        selected = {
            "warm_plan_json_one_target": 1,
            "warm_plan_json_cpu_keyed": cpu_targets,
            "warm_plan_json_sm_90_blocked": sum(1 for t in targets if t["sm"] == "sm_90"),
        }
        human_lines = 0
        for name, argv in cases.items():
            warmup = timed(argv, cwd=ws, env=env, stdout=subprocess.PIPE)
            if name == "warm_plan_human":
                human_lines = warmup.stdout.count("\n")
        _, warm = plan_json(ws, env)
        assert {t["label"]: t["key"] for t in warm["targets"] if t["key"]} == keyed
        assert not any(
            r["code"] in ("new-target", "trace-input-moved") for t in warm["targets"] for r in t["reasons"]
        )
        warm_traces = trace_count(ws)
        assert warm_traces == cold_traces

        runs: dict[str, list[Run]] = {name: [] for name in cases}
        for rep in range(args.reps):
            for name, argv in cases.items():
                if name == "warm_plan_human" and rep >= args.human_reps:
                    continue  # tens of seconds each (see the profile in the report): fewer runs
                runs[name].append(timed(argv, cwd=ws, env=env))
        print(
            {name: round(statistics.median(r.wall for r in rs), 3) for name, rs in runs.items()}, flush=True
        )

        # Incremental: a comment-only edit of one CPU family's entry file, once per run.
        fam = family_name(0)
        source = ws / f"{fam}_models.py"
        fam_cpu = sum(1 for t in targets if t["family"] == fam and t["sm"] == "cpu")
        inc_runs: list[Run] = []
        inc_checks: list[dict[str, Any]] = []
        for i in range(args.inc_reps):
            with open(source, "a") as f:  # in place: the workspace folder's mtime does not move
                f.write(f"# benchmark edit {i}: a comment, so the graph does not change\n")
            before = trace_count(ws)
            run, plan = plan_json(ws, env)
            inc_runs.append(run)
            now = {t["label"]: t for t in plan["targets"]}
            cutoff = [t for t in plan["targets"] if any(r["code"] == "early-cutoff" for r in t["reasons"])]
            moved = [
                t for t in plan["targets"] if any(r["code"] == "trace-input-moved" for r in t["reasons"])
            ]
            check = {
                "traces_run": trace_count(ws) - before,
                "early_cutoff_targets": len(cutoff),
                "trace_input_moved_targets": len(moved),
                "keys_unchanged": all(now[label]["key"] == key for label, key in keyed.items()),
                "only_this_family_moved": {t["family"] for t in moved} == {fam},
            }
            assert check["traces_run"] == fam_cpu and check["keys_unchanged"], check
            assert check["only_this_family_moved"] and len(cutoff) == fam_cpu, check
            inc_checks.append(check)
        print(f"incremental: {[round(r.wall, 2) for r in inc_runs]}", flush=True)

        prof = profile(ws, env, code, "-C", str(ws), "plan", "--json")

        warm_json = statistics.median(r.wall for r in runs["warm_plan_json"])
        warm_human = statistics.median(r.wall for r in runs["warm_plan_human"])
        floor = statistics.median(r.wall for r in runs["python_pass"])
        nx = statistics.median(r.wall for r in runs["python_import_networkx"])
        # Marginal cost per selected target over the one-target plan, CPU time (steadier than wall).
        cpu_med = {name: statistics.median(r.cpu for r in rs) for name, rs in runs.items()}
        floor_cpu = cpu_med["warm_plan_json_one_target"]
        per_keyed = (cpu_med["warm_plan_json_cpu_keyed"] - floor_cpu) / max(
            selected["warm_plan_json_cpu_keyed"] - 1, 1
        )
        per_blocked = (cpu_med["warm_plan_json_sm_90_blocked"] - floor_cpu) / max(
            selected["warm_plan_json_sm_90_blocked"] - 1, 1
        )
        split = {
            "basis": "median CPU seconds of the selection runs minus the one-target run, per extra target",
            "selected_targets": selected,
            "fixed_cpu_seconds": round(floor_cpu, 4),
            "per_keyed_target_ms": round(per_keyed * 1000, 4),
            "per_blocked_target_ms": round(per_blocked * 1000, 4),
            "estimate_all_keyed_cpu_seconds": round(floor_cpu + len(targets) * per_keyed, 3),
            "estimate_note": f"the same {len(targets)} targets if every one were keyed (a CUDA build of "
            "torch traces the GPU units): fixed + N x per-keyed, an extrapolation, not a measurement",
        }
        result: dict[str, Any] = {
            "benchmark": "plan_scale",
            "what": "cgbuild plan over a generated workspace of "
            f"{len(targets)} targets: cold, warm (--json and human) and incremental, fresh processes",
            "date": datetime.date.today().isoformat(),
            "machine": machine(),
            "load_average": {"before": load_before, "after": load_average()},
            "versions": same_versions(at_start, code),
            "workspace": {
                "families": args.families,
                "cpu_families": args.cpu_families,
                "modules_per_family": 2,
                "shapes_per_module": args.shapes,
                "layouts": LAYOUTS,
                "gpu_skus": {name: sm for name, (sm, _) in GPU_SKUS.items()},
                "sm_values": ["cpu", *sorted({sm for sm, _ in GPU_SKUS.values()})],
                "entry": "a copy of examples/toy/toy_models.py per family (<family>_models:build)",
            },
            "targets": {
                "total": len(targets),
                "by_status": dict(sorted(statuses.items())),
                "keyed_cpu_targets": len(keyed),
                "blocked_gpu_targets": statuses["blocked"],
                "distinct_keys": len(set(keyed.values())),
                "distinct_trace_units": len({t["trace_inputs"] for t in targets}),
                "traced_units": cold_traces,
                "human_summary_lines": human_lines,
                "plan_json_bytes": len(json.dumps(warm, sort_keys=True, separators=(",", ":"))),
            },
            "reps": args.reps,
            "human_reps": args.human_reps,
            "seconds": {
                "cold_plan": {"wall": round(cold_run.wall, 3), "cpu": round(cold_run.cpu, 3)},
                "cold_traces": cold_traces,
                "cold_seconds_per_trace": round(cold_run.wall / max(cold_traces, 1), 4),
                **{name: summarize(rs) for name, rs in runs.items()},
                "incremental_plan": summarize(inc_runs),
            },
            "cost_split": split,
            "incremental": {
                "edit": f"append a comment line to {fam}_models.py (its CPU units re-trace, digests hold)",
                "family_cpu_units": fam_cpu,
                "checks": inc_checks,
            },
            "ratios": {
                "warm_json_over_python_pass": round(warm_json / floor, 2),
                "warm_json_over_import_networkx": round(warm_json / nx, 2),
                "warm_human_over_warm_json": round(warm_human / warm_json, 2),
                "cold_over_warm_json": round(cold_run.wall / warm_json, 1),
                "incremental_over_warm_json": round(
                    statistics.median(r.wall for r in inc_runs) / warm_json, 1
                ),
            },
            "target": {
                "warm_plan_json_seconds_max": TARGET_SECONDS,
                "warm_plan_json_met": warm_json <= TARGET_SECONDS,
                "warm_plan_human_met": warm_human <= TARGET_SECONDS,
            },
            "torch_imported_by_engine": False,  # every timed cgbuild run exits 99 otherwise
            "profile_warm_plan_json": prof,
            "benchmark_seconds": round(time.perf_counter() - started, 1),
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps({k: result[k] for k in ("targets", "ratios", "target")}, indent=2))
        print(json.dumps(result["seconds"], indent=2))
    finally:
        if args.keep:
            print(f"workspace kept: {ws}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
