"""The plan JSON is a function of its inputs: the same state planned twice gives the same bytes.

A plan is recorded (the last plan advances) and may be served from what an earlier plan kept,
so this plans examples/toy (real traces), snapshots its state folder, and plans again twice:
once in that state and once in the snapshot restored, comparing the bytes of `plan --json`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import copy_toy


def plan_bytes(ws: Path) -> bytes:
    proc = subprocess.run(
        [sys.executable, "-m", "cgbuild.cli", "-C", str(ws), "plan", "--json"], capture_output=True
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    return proc.stdout


def test_same_state_plans_byte_identical(tmp_path: Path, toy_reference: Path) -> None:
    ws = copy_toy(tmp_path / "toy", toy_reference)
    first = json.loads(plan_bytes(ws))  # traces every unit, records the targets as new
    assert all(t["key"] for t in first["targets"]), "every toy target is keyed on the CPU"
    state, snapshot = ws / ".cgbuild", tmp_path / "snapshot"
    shutil.copytree(state, snapshot)
    again = plan_bytes(ws)
    shutil.rmtree(state)
    shutil.copytree(snapshot, state)
    restored = plan_bytes(ws)
    assert again == restored
    assert [t["key"] for t in json.loads(again)["targets"]] == [t["key"] for t in first["targets"]]
