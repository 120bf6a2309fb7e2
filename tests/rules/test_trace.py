"""Trace rule: the worker protocol (real subprocesses), entry loading, quant rules, CUDA refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from cgbuild_rules.digest import TraceError
from cgbuild_rules.trace import REQUEST_SCHEMA, EntryError, apply_quant, load_entry, run_job
from support.jobs import BANKED, TOY, flux_job, make_job
from torch import nn

CPU_ONLY_TORCH = torch.version.cuda is None

CHATTY_ENTRY = """
import os
import torch
from torch import nn


def build(spec):
    print("hello from the entry")  # must not reach the protocol stream
    os.write(1, b"raw bytes on fd 1\\n")
    return nn.Linear(4, 2), (torch.randn(1, 4),), {}
"""


def run_worker(request: Any, seed: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONHASHSEED=seed)
    proc = subprocess.Popen(
        [sys.executable, "-m", "cgbuild_rules.trace"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdin is not None
    proc.stdin.write(request if isinstance(request, str) else json.dumps(request))
    proc.stdin.close()
    return proc


@pytest.fixture(scope="module")
def worker_runs(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[int, list[dict[str, Any]], str]]:
    """One request, run by two worker processes at once with different hash seeds."""
    chatty = tmp_path_factory.mktemp("chatty")
    (chatty / "chatty_entry.py").write_text(CHATTY_ENTRY)
    jobs = [
        make_job(job_id="mlp"),
        make_job(job_id="bad-entry", entry="no_such_module:build"),
        flux_job(job_id="flux"),
        make_job("no-such-module", job_id="raises"),
        make_job(job_id="chatty", entry="chatty_entry:build", root=chatty, width=4),
        make_job(job_id="cuda", device="cuda"),
        make_job(job_id="quant-mismatch", dtype="bfloat16") | {"quant": "plain.fp32"},
    ]
    request = {"schema": REQUEST_SCHEMA, "jobs": jobs}
    procs = [run_worker(request, seed) for seed in ("1", "4242")]
    runs = []
    for proc in procs:
        assert proc.stdout is not None and proc.stderr is not None
        out, err = proc.stdout.read(), proc.stderr.read()
        rc = proc.wait(timeout=300)
        runs.append((rc, [json.loads(line) for line in out.splitlines()], err))
    return runs


def by_id(lines: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {line["id"]: line for line in lines}


def test_worker_one_line_per_job_in_order(worker_runs: list[tuple[int, list[dict[str, Any]], str]]) -> None:
    for rc, lines, err in worker_runs:
        assert rc == 0, err
        assert [line["id"] for line in lines] == [
            "mlp",
            "bad-entry",
            "flux",
            "raises",
            "chatty",
            "cuda",
            "quant-mismatch",
        ]


def test_worker_results(worker_runs: list[tuple[int, list[dict[str, Any]], str]]) -> None:
    lines = by_id(worker_runs[0][1])
    mlp = lines["mlp"]
    assert mlp["ok"] is True
    assert set(mlp) == {"id", "ok", "graph_digest", "contract", "topology", "nodes", "torch", "seconds"}
    assert mlp["graph_digest"] == BANKED["toy/mlp/8x64-b1"]
    assert mlp["nodes"] == 9 and mlp["torch"] == torch.__version__
    assert lines["flux"]["graph_digest"] == BANKED["flux2-klein-tiny/transformer/64x48-t8-b1"]
    # One bad job does not stop the others, and failures are typed.
    for job_id in ("bad-entry", "raises"):
        assert lines[job_id]["ok"] is False and lines[job_id]["code"] == "entry-error"
        assert "\n" not in lines[job_id]["detail"]
    assert lines["chatty"]["ok"] is True  # the entry's prints went to stderr
    assert "hello from the entry" in worker_runs[0][2] and "raw bytes on fd 1" in worker_runs[0][2]
    assert lines["quant-mismatch"]["code"] == "trace-failed"
    if CPU_ONLY_TORCH:
        assert lines["cuda"] == {
            "id": "cuda",
            "ok": False,
            "code": "no-cuda-torch",
            "detail": lines["cuda"]["detail"],
        }


def test_worker_digests_stable_across_hash_seeds(
    worker_runs: list[tuple[int, list[dict[str, Any]], str]],
) -> None:
    (_, a, _), (_, b, _) = worker_runs
    strip = [{k: v for k, v in line.items() if k != "seconds"} for line in a]
    assert strip == [{k: v for k, v in line.items() if k != "seconds"} for line in b]


def test_worker_refuses_a_bad_request() -> None:
    proc = run_worker('{"schema": "something-else/1", "jobs": []}', "0")
    assert proc.wait(timeout=120) == 2
    assert proc.stdout is not None and proc.stdout.read() == ""


@pytest.mark.skipif(not CPU_ONLY_TORCH, reason="needs a CPU-only torch build")
def test_cuda_on_cpu_torch_is_refused_without_attempting() -> None:
    # A non-existent entry proves nothing was imported or built.
    line = run_job(make_job(device="cuda", entry="not_imported:build"))
    assert line["ok"] is False and line["code"] == "no-cuda-torch"


def test_apply_quant() -> None:
    module = nn.Linear(2, 2)
    assert apply_quant(module, "plain.fp32") is module
    with pytest.raises(TraceError, match="unknown quant rule 'fp4-magic'"):
        apply_quant(module, "fp4-magic")
    with pytest.raises(TraceError, match="disagree"):
        apply_quant(module, "plain.bf16")
    with pytest.raises(TraceError, match="disagree"):
        apply_quant(module, "fp8-rowwise")  # computes in bf16: an fp32 build is the wrong spec
    with pytest.raises(TraceError, match="computes in float32 or bfloat16 or float16, not float64"):
        apply_quant(nn.Linear(2, 2, dtype=torch.float64), "int8-rowwise", "float64")
    # Eligible Linears (2-D, both dims multiples of 16) are replaced IN PLACE: same FQNs.
    model = nn.Sequential(nn.Linear(32, 16), nn.GELU(), nn.Linear(16, 10))
    out = apply_quant(model, "int8-rowwise", "float32")
    state = {k: (str(v.dtype), list(v.shape)) for k, v in out.state_dict().items()}
    assert state == {
        "0.weight": ("torch.int8", [16, 32]),
        "0.weight_scale": ("torch.float32", [16]),
        "0.bias": ("torch.float32", [16]),
        "2.weight": ("torch.float32", [10, 16]),  # 10 rows: not a multiple of 16, left alone
        "2.bias": ("torch.float32", [10]),
    }
    # a root that is itself eligible is replaced (so the module is returned, not only mutated)
    root = apply_quant(nn.Linear(16, 16), "int8-rowwise", "float32")
    assert sorted(root.state_dict()) == ["bias", "weight", "weight_scale"]


def test_load_entry(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "twin_entry.py").write_text(f"def build(spec):\n    return {name!r}\n")
    # Two Cgfile folders may both provide a module of one name: each job gets its own.
    assert load_entry("twin_entry:build", str(tmp_path / "a"))({}) == "a"
    assert load_entry("twin_entry:build", str(tmp_path / "b"))({}) == "b"
    assert load_entry("toy_models:build", str(TOY)).__name__ == "build"
    for bad in ("toy_models", ":build", "toy_models:nope", "nope_module:build"):
        with pytest.raises(EntryError):
            load_entry(bad, str(TOY))
