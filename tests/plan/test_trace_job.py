"""`trace_job` gives a label the job the mint sends its worker, with its platform's components.

The mint's job is read from the real path: a plan (its traces' facts put in the trace cache as
a machine that traced them would publish them, so no trace runs here), `approved`, and the
worker request `request_for` writes. Whether the platform's toolchain has triton decides the
fp8 layout's `fp8-gemm` values on sm_90, so a job built without the components (`job_for(cg,
target)`) is another program there: a module built from it is refused by the minted artifact.
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
from pathlib import Path
from typing import Any

import pytest
from support.cgfiles import KLEIN_ENTRY, KLEIN_LANES, klein

from cgbuild.config import cgfile
from cgbuild.config.labels import parse_selector
from cgbuild.config.targets import expand
from cgbuild.exec.mint import approved, request_for
from cgbuild.identity import toolchain
from cgbuild.plan.jobs import trace_job
from cgbuild.plan.planner import make_plan
from cgbuild.plan.tracecache import TraceCache
from cgbuild.plan.workspace import Workspace
from cgbuild.protocol.trace import TraceJob, job_for

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
MLP8 = "//toy/mlp/8x64-b1@fp32:cpu"
FP8 = "//klein/transformer/64x64-b1@fp8:sm_90"

KLEIN = klein(
    KLEIN_LANES, workspace='state = ".cgbuild"\n\n[toolchain]\nlock = "toolchain.lock"', layouts=("fp8",)
)
TRITON = {"dist": "triton", "version": "3.6.0", "digest": "36" * 32}
FACTS = {
    "graph_digest": "ab" * 32,
    "contract": {},
    "topology": [["proj.weight", "torch.float32", [64, 64]]],
    "nodes": 3,
    "torch": "2.13.0",
}
"""A trace's facts, for the plan to key the target on: its job was decided before any trace."""


def mint_job(ws: Workspace, label: str, out: Path) -> TraceJob:
    """The job in the worker request the mint writes for `label`."""
    selector = parse_selector(label)
    (entry,) = make_plan(ws, selector, run_traces=False).entries
    with contextlib.closing(TraceCache(ws.state.traces)) as cache:
        cache.put(entry.trace_inputs, FACTS)
    plan = make_plan(ws, selector, run_traces=False)
    (mk,) = approved(plan, ws)
    assert mk.labels == [label]
    return TraceJob.from_json(request_for(ws, mk, out)["job"])


def _klein(root: Path, triton: bool) -> Workspace:
    """The klein workspace, keyed by its Cgfile's lock: CUDA components with triton, or without."""
    root.mkdir()
    (root / "klein_entry.py").write_text(KLEIN_ENTRY)
    (root / "Cgfile").write_text(KLEIN)
    probed = toolchain.probe()
    probed["cuda"]["components"]["triton"] = TRITON if triton else {"absent": True}
    toolchain.write_lock(str(root / "toolchain.lock"), toolchain.lock_document(probed))
    return Workspace(cgfile.load(root / "Cgfile"))


def _benchmark_job_of(ws: Path, label: str) -> dict[str, Any]:
    """benchmarks/targets.py's `job_of`, the job every GPU benchmark builds its module from."""
    spec = importlib.util.spec_from_file_location("bench_targets", BENCHMARKS / "targets.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    job: dict[str, Any] = module.job_of(ws, label)
    return job


def test_a_cpu_label_gets_the_mints_job(tmp_path: Path) -> None:
    root = tmp_path / "toy"
    shutil.copytree(EXAMPLES / "toy", root, ignore=shutil.ignore_patterns(".cgbuild", "__pycache__"))
    ws = Workspace(cgfile.load(root / "Cgfile"))  # the toolchain probed here, as the plan probes it
    minted = mint_job(ws, MLP8, tmp_path / "build")
    assert trace_job(ws, MLP8) == minted
    assert minted.spec["lanes"] == {"linear": ["baseline", "chunked"]}  # triton needs a cuda device
    assert TraceJob.from_json(_benchmark_job_of(root, MLP8)) == minted


@pytest.mark.parametrize("triton", [True, False], ids=["triton", "no-triton"])
def test_the_fp8_lanes_follow_the_platforms_components(tmp_path: Path, triton: bool) -> None:
    root = tmp_path / "klein"
    ws = _klein(root, triton)
    minted = mint_job(ws, FP8, tmp_path / "build")
    assert trace_job(ws, FP8) == minted
    gemm = ["scaled-mm", "triton"] if triton else ["scaled-mm"]
    assert minted.spec["lanes"] == {"attention": ["flash", "math"], "fp8-gemm": gemm}
    assert TraceJob.from_json(_benchmark_job_of(root, FP8)) == minted
    # without the platform's components the job drops triton: another program where triton is there
    (target,) = (t for t in expand(ws.cg) if t.label == FP8)
    assert job_for(ws.cg, target).spec["lanes"]["fp8-gemm"] == ["scaled-mm"]
    assert (job_for(ws.cg, target) == minted) is not triton
