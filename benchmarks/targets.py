"""A benchmark's target as the mint builds it: the workspace's own job for a label, its module.

One place for what several benchmarks need of a workspace, so each builds exactly the program the
mint compiled (the declared lanes' switches included) and none keeps a hand-written spec.
"""

from __future__ import annotations

import shutil
import tarfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def job_of(ws: Path, label: str) -> dict[str, Any]:
    """The trace job of `label` in the workspace at `ws`, as the mint hands it to a worker (with
    this platform's toolchain components, which decide the lane values it carries)."""
    from cgbuild.config import cgfile
    from cgbuild.plan.jobs import trace_job
    from cgbuild.plan.workspace import Workspace

    return trace_job(Workspace(cgfile.load(ws / "Cgfile")), label).with_id("bench").to_json()


def built_of(ws: Path, label: str) -> Any:
    """The target's module (seed-0 weights) and inputs, as the mint's verification builds them."""
    from cgbuild_rules import trace

    return trace.build(trace.parse_job(job_of(ws, label)), "real")


def drop_lanes(cgfile: Path) -> None:
    """Remove every `[family.*.lanes]` table: the program then has no switches (the plain one)."""
    kept: list[str] = []
    skipping = False
    for line in cgfile.read_text().splitlines(keepends=True):
        if line.startswith("["):
            skipping = line.split("#")[0].strip().endswith(".lanes]")
        if not skipping:
            kept.append(line)
    cgfile.write_text("".join(kept))


def copy_workspace(src: Path, dest: Path, archives: Iterable[str | Path] = ()) -> Path:
    """`src` copied to `dest` without its state or caches, with each store archive (a `.tgz` of
    `store/` and trace caches) unpacked into the copy's `.cgbuild`: a warm workspace for a label."""
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns(".cgbuild", "__pycache__"))
    (dest / ".cgbuild").mkdir()
    for archive in archives:
        with tarfile.open(archive) as tar:
            tar.extractall(dest / ".cgbuild", filter="data")
    return dest


def add_lanes(cgfile: Path, family: str, lines: str) -> None:
    """`lines` (TOML, e.g. `qk-norm = ["unfused", "fused"]`) added to `family`'s lanes table."""
    table = f"[family.{family}.lanes]\n"
    text = cgfile.read_text()
    if table not in text:
        raise SystemExit(f"{cgfile} has no {table.strip()} to add {lines!r} to")
    cgfile.write_text(text.replace(table, table + lines + "\n", 1))
