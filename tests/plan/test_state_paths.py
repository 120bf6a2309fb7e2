"""The workspace owns its state folder's paths: every reader asks `StateDir`, none joins names."""

from __future__ import annotations

import ast
from pathlib import Path

from cgbuild.plan.workspace import StateDir

ROOT = Path(__file__).resolve().parents[2]
NAMES = {"last-plan.json", "traces.sqlite", "traces.sqlite-wal", "mint", "build", "cache", "plans"}


def _joined_names(path: Path) -> list[str]:
    """`<something> / "<state name>"` in `path`'s code (docstrings may name the files)."""
    return [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Div)
        and isinstance(node.right, ast.Constant)
        and node.right.value in NAMES
    ]


def test_state_paths_are_named_in_one_place() -> None:
    found = [
        hit
        for path in ROOT.glob("cgbuild/**/*.py")
        if path.name != "workspace.py"
        for hit in _joined_names(path)
    ]
    assert found == []
    assert _joined_names(ROOT / "cgbuild" / "plan" / "workspace.py")  # the scan sees a join


def test_the_paths_a_plan_reads_are_the_ones_it_writes() -> None:
    state = StateDir(Path("/ws/.cgbuild"))
    assert state.record("k") == Path("/ws/.cgbuild/mint/k.json")
    assert state.log("k", "check") == Path("/ws/.cgbuild/mint/k.check.log") != state.log("k")
    assert state.last_plan in state.planned_from() and state.traces in state.planned_from()
    assert state.plans.parent == state.cache
