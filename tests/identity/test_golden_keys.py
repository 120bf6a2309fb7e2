"""Keys are the product: every key the examples plan is pinned in `tests/golden/keys.json`.

The CPU keys are planned from an empty state folder in a copy of each example (its reference
checkpoints written afresh from the entry's seed weights). Their axes are banked beside them
(`cpu_axes`), so every golden key is recomputed from its axes under any torch (or none); the live
plan must give the golden keys under the golden torch, and under another torch every key that
differs must say why: the toolchain (torch is a member) or the graph moved. Nothing skips. The
banked H200 plan's keys are recomputed from the axes that plan recorded. A change that moves a
key on purpose updates the golden file in the same commit and says why.

Re-banked: the toy's six keys moved (graph axis only) when a lane switch stopped reading a one-hot
literal and became a size comparison on the lane selector input: every program with a switched
axis is another program. flux2-klein-tiny declares no lanes here and kept its keys; the H200 keys
are the banked plan's, whose artifacts switch by one-hot and still adopt.

Re-banked: flux2-klein-tiny's six keys moved (graph axis only) when the FLUX.2 example began
tracing `hidden_states` as the stock pipeline passes it (a transposed view) and the traced strides
of non-contiguous inputs entered the graph digest. The toy traces contiguous inputs: its keys are
byte-identical. The H200 keys are the banked plan's (traced contiguous, served on a copy).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from cgbuild.identity.keys import KINDS, Axis, key_of

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = json.loads((ROOT / "tests" / "golden" / "keys.json").read_text())


def _torch() -> str | None:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def _planned_targets(example: str, dest: Path) -> dict[str, dict[str, Any]]:
    work = dest / example
    shutil.copytree(ROOT / "examples" / example, work, ignore=shutil.ignore_patterns(".cgbuild", "reference"))
    run = [sys.executable, "-m", "cgbuild_rules.reference", "-C", str(work)]
    subprocess.run(run, check=True, capture_output=True, cwd=dest)
    proc = subprocess.run(
        [sys.executable, "-m", "cgbuild.cli", "-C", str(work), "plan", "--json"],
        capture_output=True,
        text=True,
        cwd=dest,
    )
    assert proc.returncode == 0, proc.stderr
    return {t["label"]: t for t in json.loads(proc.stdout)["targets"] if t["key"]}


def test_banked_cpu_axes_recompute_the_golden_cpu_keys() -> None:
    """No torch needed: the key is a function of the four axes alone."""
    banked = GOLDEN["cpu_axes"]
    assert set(banked) == set(GOLDEN["cpu"])
    recomputed = {
        label: key_of({name: _axis(name, axes[name]) for name in KINDS}) for label, axes in banked.items()
    }
    assert recomputed == GOLDEN["cpu"]


@pytest.mark.slow
def test_example_keys_match_the_golden_file(tmp_path: Path) -> None:
    planned: dict[str, dict[str, Any]] = {}
    for example in ("toy", "flux2_klein"):
        planned.update(_planned_targets(example, tmp_path))
    assert set(planned) == set(GOLDEN["cpu"])
    keys = {label: t["key"] for label, t in planned.items()}
    if _torch() == GOLDEN["torch"]:
        assert keys == GOLDEN["cpu"]
        return
    for label, t in planned.items():  # another torch: each moved key names the axis that moved
        if keys[label] != GOLDEN["cpu"][label]:
            was = GOLDEN["cpu_axes"][label]
            moved = [name for name, kind in KINDS.items() if kind.moved(was[name], t["axes"][name])]
            assert moved and set(moved) <= {"toolchain", "graph"}, (label, moved)


def _axis(name: str, readable: dict[str, Any]) -> Axis:
    return KINDS[name].axis(readable)


def test_banked_h200_plan_keys_match_the_golden_file() -> None:
    plan = json.loads((ROOT / "benchmarks" / "results" / "gpu_sm90_plan_lanes.json").read_text())
    recomputed = {
        t["label"]: key_of({name: _axis(name, t["axes"][name]) for name in KINDS}) for t in plan["targets"]
    }
    assert recomputed == GOLDEN["h200"]
