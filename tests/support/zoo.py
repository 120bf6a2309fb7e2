"""The serving zoo (tests/zoo) as the tests use it: copied into a workspace, planned and minted
through the CLI, its modules rebuilt the way a serving process builds them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from cgbuild.config import cgfile
from cgbuild.store.local import Store
from support.cli import cli

ZOO = Path(__file__).resolve().parents[1] / "zoo"


def minted(
    factory: pytest.TempPathFactory, selector: str, labels: dict[str, str]
) -> tuple[Path, dict[str, Any]]:
    """(workspace, mint summary) after `cgbuild mint //SELECTOR:cpu` (a family, or `family/module`),
    every target it selects planned first: exactly `labels`, each to be minted."""
    ws = factory.mktemp(selector.replace("/", "-")) / "ws"
    shutil.copytree(ZOO, ws, ignore=shutil.ignore_patterns(".cgbuild", "__pycache__"))
    plan = json.loads(cli(ws, "plan", f"//{selector}", "--json").stdout)
    assert {t["label"] for t in plan["targets"]} == set(labels.values())
    assert all(t["status"] == "mint" for t in plan["targets"])
    proc = cli(ws, "mint", f"//{selector}:cpu", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return ws, json.loads(proc.stdout.strip().splitlines()[-1])


def manifested(
    factory: pytest.TempPathFactory, selector: str, labels: dict[str, str]
) -> tuple[Path, dict[str, Any]]:
    """(workspace, serving manifest) after `minted` and `cgbuild manifest //SELECTOR`."""
    ws, _ = minted(factory, selector, labels)
    proc = cli(ws, "manifest", f"//{selector}", "-o", str(ws / "manifest.json"))
    assert proc.returncode == 0, proc.stderr
    return ws, json.loads((ws / "manifest.json").read_text())


def served_module(
    ws: Path, label: str, seed: int = 7
) -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]:
    """The target's module and example call as a serving process holds them: built by the entry,
    weights of its own (another seed than the mint's)."""
    from cgbuild_rules import trace

    from cgbuild.plan.jobs import trace_job
    from cgbuild.plan.workspace import Workspace

    job = trace_job(Workspace(cgfile.load(ws / "Cgfile")), label)
    torch.manual_seed(seed)
    built = trace.build(trace.parse_job(job.with_id(label).to_json()), "real")
    return built.module, built.args, built.kwargs


def artifact(ws: Path, label: str) -> Path:
    """The stored artifact of a minted target (the plan must call it fresh)."""
    plan = json.loads(cli(ws, "plan", label, "--json").stdout)
    (target,) = plan["targets"]
    assert target["status"] == "fresh", target
    return Store(ws / ".cgbuild" / "store").resolve(target["key"]).path


def rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative RMS error (the mint's verify metric): ‖got − want‖ / ‖want‖."""
    return float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())
