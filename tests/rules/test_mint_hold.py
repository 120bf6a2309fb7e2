"""A held mint worker (`MintHold`): it traces the job where it will compile it, reports the
trace rule's own facts, and mints the key's request it is handed later on the same stdin.

Real parts: the engine's spawner and channel, the worker and its stages, a real trace and one
real AOTInductor compile of the tiny MLP on the CPU.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
from support.minted import job_for, request_for, session_dirs

from cgbuild.protocol.mint import HOLD_SCHEMA
from cgbuild.protocol.spawn import Channel, Ended, Talk, spawn
from cgbuild.protocol.trace import FACT_KEYS

pytestmark = pytest.mark.slow


class Worker:
    """One held worker: `traced` is its trace, `then` answers a trace that succeeded (a
    request; None ends its input, as does a failed trace), `results` its result lines."""

    def __init__(self, hold: dict[str, Any], then: Any = None, env: dict[str, str] | None = None) -> None:
        self.channel = Channel()
        self.traced: dict[str, Any] | None = None
        self.results: list[dict[str, Any]] = []
        self.then = then
        self.ended: Ended = spawn("cgbuild_rules.mint", talk=Talk(hold, self.take, self.channel), env=env)

    def take(self, message: dict[str, Any]) -> None:
        if "traced" in message:
            self.traced = message["traced"]
            request = self.then if self.traced.get("ok") else None
            if request is None:
                self.channel.close()
            else:
                self.channel.send(request)
        elif "ok" in message:
            self.results.append(message)


def hold_for(job: dict[str, Any], out: Path, sandbox: Path, **extra: Any) -> dict[str, Any]:
    return {
        "schema": HOLD_SCHEMA,
        "id": "f" * 64,
        "job": job,
        "out": str(out),
        "sandbox": str(sandbox),
        **extra,
    }


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root, sandbox = session_dirs(tmp_path_factory)
    return root, sandbox


def test_a_held_worker_reports_the_trace_rules_facts_then_mints_the_key_it_is_handed(
    dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    root, sandbox = dirs
    job = job_for(root, "A")
    request = request_for(job, tmp_path, sandbox)  # digest from a fake-mode trace, as a plan's
    worker = Worker(hold_for(job, tmp_path, sandbox), then=request)
    assert worker.traced is not None and worker.traced["ok"] is True and worker.traced["sm"] == "cpu"
    assert worker.traced["graph_digest"] == request["graph_digest"]
    assert set(FACT_KEYS) <= set(worker.traced)
    (result,) = worker.results
    assert result["ok"] is True, result
    assert result["key"] == request["key"] and Path(result["artifact"]).is_file()
    assert {"export", "compile", "verify", "seal", "serve"} <= set(result["phases"])
    assert worker.ended.status == 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".mint-")]


def test_a_held_worker_whose_input_ends_stops_without_a_result_or_a_folder(
    dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    root, sandbox = dirs
    worker = Worker(hold_for(job_for(root, "A"), tmp_path, sandbox), then=None)
    assert worker.traced is not None and worker.traced["ok"] is True
    assert worker.results == [] and worker.ended.status == 0
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("moved", ["job", "out", "schema"])
def test_a_held_worker_refuses_a_request_it_did_not_trace_or_was_not_started_for(
    dirs: tuple[Path, Path], tmp_path: Path, moved: str
) -> None:
    root, sandbox = dirs
    job = job_for(root, "A")
    if moved == "job":
        request = request_for(job_for(root, "B"), tmp_path, sandbox)
    elif moved == "schema":  # JSON, but no mint request
        request = {"schema": "cgbuild.mint-request/0", "job": job}
    else:
        (tmp_path / "elsewhere").mkdir()
        request = request_for(job, tmp_path / "elsewhere", sandbox)
    worker = Worker(hold_for(job, tmp_path, sandbox), then=request)
    (result,) = worker.results
    assert result["ok"] is False and result["code"] == "bad-request" and moved in result["detail"]


def test_a_held_worker_refuses_a_key_built_for_another_graph_than_it_traced(
    dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """The request names the graph digest its key was built for; a held worker compiles only the
        program it traced, so another digest is `graph-drift`, before any compile (its work folder
    stays, as every failed mint's does, for its stage logs)."""
    root, sandbox = dirs
    job = job_for(root, "A")
    request = {**request_for(job, tmp_path, sandbox), "graph_digest": "0" * 64}
    worker = Worker(hold_for(job, tmp_path, sandbox), then=request)
    (result,) = worker.results
    assert result["ok"] is False and result["code"] == "graph-drift" and result["phase"] == "compile", result
    assert result["old"] == "0" * 64 and result["new"] == worker.traced["graph_digest"]  # type: ignore[index]


def test_a_held_trace_that_fails_is_typed_as_the_trace_rules_and_ends_the_worker(
    dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    from cgbuild_rules.trace import run_job

    root, sandbox = dirs
    job = {**job_for(root, "A"), "entry": "tiny_entry:no_such_build"}
    worker = Worker(hold_for(job, tmp_path, sandbox), then=request_for(job_for(root, "A"), tmp_path, sandbox))
    assert worker.traced is not None and worker.traced["ok"] is False
    assert worker.traced["code"] == run_job(job)["code"] == "entry-error"
    assert worker.results == [] and worker.ended.status == 0


def test_a_held_worker_killed_while_tracing_reports_the_typed_end(
    dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    root, sandbox = dirs
    env = {**os.environ, "CGBUILD_MINT_FAULT": "trace:SIGKILL"}
    worker = Worker(hold_for(job_for(root, "A"), tmp_path, sandbox), env=env)
    assert worker.traced is not None and worker.traced["ok"] is False
    assert worker.traced["code"] == "worker-killed" and "trace stage" in worker.traced["detail"]
    assert worker.ended.status == 0


def test_hold_requests_are_validated(dirs: tuple[Path, Path], tmp_path: Path) -> None:
    root, sandbox = dirs
    good = hold_for(job_for(root, "A"), tmp_path, sandbox)
    for bad, words in [
        ({**good, "key": "0" * 64}, "unknown field 'key'"),
        ({k: v for k, v in good.items() if k != "out"}, "missing out"),
        ({**good, "job": {"spec": {}}}, "bad job"),
    ]:
        worker = Worker(bad)
        (result,) = worker.results
        assert worker.traced is None and result["code"] == "bad-request" and words in result["detail"]


@pytest.mark.parametrize(("line", "words"), [(b"{not json\n", "not JSON"), (b"null\n", "not a JSON object")])
def test_a_request_line_that_is_no_json_object_is_a_bad_request(
    dirs: tuple[Path, Path], tmp_path: Path, line: bytes, words: str
) -> None:
    root, sandbox = dirs
    done = threading.Event()

    class Raw(Worker):
        def take(self, message: dict[str, Any]) -> None:
            if "traced" in message:
                assert self.channel._pipe is not None
                self.channel._pipe.write(line)
                self.channel._pipe.flush()
                done.set()
            elif "ok" in message:
                self.results.append(message)

    worker = Raw(hold_for(job_for(root, "A"), tmp_path, sandbox))
    (result,) = worker.results
    assert done.is_set() and result["code"] == "bad-request" and words in result["detail"]
