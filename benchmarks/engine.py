"""What the benchmarks of cgbuild's own commands share (plan_scale, mint_noop, fleet).

The code under test is a git snapshot, so a long run stays honest while others edit the checkout;
every measured command is a fresh process that fails if the engine imported torch; and the
workspace is generated: F toy families, each its own graph, served on twelve GPU SKUs over six sm
values and, for the first C families, on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import resource
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import harness
from harness import REPO, git

TOY = REPO / "examples" / "toy" / "toy_models.py"
PACKAGES = ("cgbuild", "networkx", "rich")  # what the engine's processes import

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


# -- the code under test -----------------------------------------------------------------------------
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
        return Code(ref, git("rev-parse", "HEAD"), None, TOY)
    commit = git("rev-parse", "--verify", f"{ref}^{{commit}}")
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


def versions(code: Code) -> dict[str, Any]:
    """What the measured processes run: the installed packages and the code under test."""
    return {**harness.versions(*PACKAGES), **code.identity()}


def measured_code(ref: str, tmp: Path) -> tuple[Code, dict[str, str], dict[str, Any]]:
    """What a run measures: the code under test (`ref` exported into `tmp`), its children's
    environment, and its versions at the start (`same_versions` checks them at the end)."""
    code = code_under_test(ref, tmp)
    return code, child_env(code), versions(code)


def same_versions(before: dict[str, Any], code: Code) -> dict[str, Any]:
    """The versions taken at the start, checked against the end: the code must not move mid-run."""
    after = versions(code)
    if after != before:
        raise SystemExit(f"the measured code changed during the run: {before} -> {after}; run it again")
    return before


def run_options(ap: argparse.ArgumentParser, result: Path) -> None:
    """What `measured_run` reads: the code to measure, where its result goes, whether to keep its folder."""
    ap.add_argument("--code", default="HEAD", help="commit to measure (exported), or 'worktree'")
    ap.add_argument("--out", type=Path, default=result)
    ap.add_argument("--keep", action="store_true", help="keep the temporary workspace")


@dataclass
class Measured:
    """One run of a benchmark on the code under test: its temporary folder, the code and its
    children's environment; `write` records what it measured."""

    tmp: Path
    code: Code
    env: dict[str, str]
    out: Path
    at_start: dict[str, Any]
    load_before: list[float]
    started: float

    def profile(self, ws: Path, *args: str) -> dict[str, Any]:
        return profile(ws, self.env, self.code, *args)

    def write(self, benchmark: str, numbers: dict[str, Any]) -> dict[str, Any]:
        """`numbers` written at --out with the load average before and after, the versions (checked
        unchanged since the start) and the run's seconds; returns the document."""
        done = {
            **numbers,
            "load_average": {"before": self.load_before, "after": harness.load_average()},
            "versions": same_versions(self.at_start, self.code),
            "benchmark_seconds": round(time.perf_counter() - self.started, 1),
        }
        return harness.write_result(self.out, benchmark, done, commit=self.code.commit)


@contextlib.contextmanager
def measured_run(args: argparse.Namespace, prefix: str) -> Iterator[Measured]:
    """A run on the code `args.code` names, in a temporary folder (`prefix`, kept with --keep),
    timed and its load average taken from here."""
    started = time.perf_counter()
    load_before = harness.load_average()
    with harness.scratch(prefix, args.keep) as tmp:
        code, env, at_start = measured_code(args.code, tmp)
        yield Measured(tmp, code, env, args.out, at_start, load_before, started)


# -- fresh processes ---------------------------------------------------------------------------------
@dataclass
class Run:
    wall: float
    cpu: float
    stdout: str = ""


def time_process(
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


def median_walls(runs: dict[str, list[Run]]) -> dict[str, float]:
    """Each case's median wall seconds over its fresh processes."""
    return {name: statistics.median(r.wall for r in rs) for name, rs in runs.items()}


def target_met(med: dict[str, float], limit_name: str, limit: float, *cases: str) -> dict[str, Any]:
    """The limit under `limit_name`, then for each case whether its median stays within it."""
    return {limit_name: limit, **{f"{case}_met": med[case] <= limit for case in cases}}


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
        run = time_process(cgbuild_argv("-C", str(ws), "plan", "--json", *args), cwd=ws, env=env, stdout=f)
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
        "# Generated by benchmarks/engine.py: a fleet-sized workspace of toy families.",
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
