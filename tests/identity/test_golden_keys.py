"""Keys are the product: every key the examples plan is pinned in `tests/golden/keys.json`.

The CPU keys are planned from an empty state folder in a copy of each example (its reference
checkpoints written afresh from the entry's seed weights). They depend on the torch that traced
them, so under another torch the comparison is skipped, saying why. The banked H200 plan's keys
are recomputed from the axes that plan recorded, which needs no torch at all. A change that
moves a key on purpose updates the golden file in the same commit and says why.
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

from cgbuild.identity.keys import IDENTITY_FIELDS, Axis, key_of

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = json.loads((ROOT / "tests" / "golden" / "keys.json").read_text())


def _torch() -> str | None:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def _planned_keys(example: str, dest: Path) -> dict[str, str]:
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
    return {t["label"]: t["key"] for t in json.loads(proc.stdout)["targets"] if t["key"]}


@pytest.mark.slow
def test_example_keys_match_the_golden_file(tmp_path: Path) -> None:
    if _torch() != GOLDEN["torch"]:
        pytest.skip(f"golden CPU keys were planned with torch {GOLDEN['torch']}, this is {_torch()}")
    planned: dict[str, str] = {}
    for example in ("toy", "flux2_klein"):
        planned.update(_planned_keys(example, tmp_path))
    assert planned == GOLDEN["cpu"]


def _axis(name: str, readable: dict[str, Any]) -> Axis:
    return Axis({f: readable[f] for f in IDENTITY_FIELDS[name]}, readable)


def test_banked_h200_plan_keys_match_the_golden_file() -> None:
    plan = json.loads((ROOT / "benchmarks" / "results" / "gpu_sm90_plan_lanes.json").read_text())
    recomputed = {
        t["label"]: key_of({name: _axis(name, t["axes"][name]) for name in IDENTITY_FIELDS})
        for t in plan["targets"]
    }
    assert recomputed == GOLDEN["h200"]
