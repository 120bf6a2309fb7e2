"""Which key a held worker may mint: one of the unit it traced, on the sm it reported (no
process here: the choice is the executor's, from the worker's trace line)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cgbuild.config import cgfile
from cgbuild.config.targets import expand
from cgbuild.exec.held import Held
from cgbuild.plan.planner import TraceUnit
from cgbuild.protocol import spawn
from cgbuild.protocol.contract import CallContract
from cgbuild.protocol.stage import Traced
from cgbuild.protocol.trace import job_for


def traced(sm: str | None) -> dict:
    """A hold's trace line as the worker writes it: a `Traced` (its facts stand-ins)."""
    return Traced(
        graph_digest="d" * 64,
        contract=CallContract.from_json({}),
        topology=[],
        nodes=3,
        torch="2.13.0",
        sm=sm,
    ).to_json()


KLEIN = Path(__file__).resolve().parents[2] / "examples" / "flux2_klein" / "Cgfile"
TOY = KLEIN.parents[1] / "toy" / "Cgfile"


def test_a_held_worker_serves_only_its_units_targets_on_the_sm_it_traced_on(tmp_path: Path) -> None:
    cg = cgfile.load(KLEIN)
    shape = "//flux2-klein/transformer/1024x1024-t512-b1@bf16"
    by_label = {t.label: t for t in expand(cg)}
    h200, rtx = by_label[f"{shape}:sm_90"], by_label[f"{shape}:sm_120"]
    other = by_label["//flux2-klein/transformer/768x768-t512-b1@bf16:sm_90"]
    unit = TraceUnit("f" * 64, job_for(cg, h200).with_id("f" * 64), [h200, rtx])

    def held(trace: dict) -> Held:
        h = Held(unit, tmp_path, tmp_path / "held.log", None)
        h._trace(trace)  # what the worker's `{"traced": ...}` line carries
        return h

    on_h200 = held(traced("sm_90"))
    assert on_h200.serves(h200) and not on_h200.serves(rtx) and not on_h200.serves(other)
    assert not held(traced(None)).serves(h200)  # no device here: traced fake, mints nothing
    assert not held({"ok": False, "code": "entry-error", "sm": "sm_90"}).serves(h200)
    lacking = held({"part": "trace", "ok": True, "sm": "sm_90", "graph_digest": "d"})  # no facts
    assert not lacking.serves(h200) and not lacking.ok


@pytest.mark.parametrize(
    ("line", "named"),
    [
        (
            {"part": "trace", "ok": True, "sm": "cpu"},
            "missing graph_digest, contract, topology, nodes, torch",
        ),
        ({**traced("cpu"), "extra": 1}, "unknown field 'extra'"),
        ({**traced("cpu"), "part": "compile"}, "part 'compile'"),
        ({"ok": True, "graph_digest": "d"}, "missing contract"),
    ],
)
def test_a_trace_line_that_is_no_traced_is_a_typed_trace_failure_for_the_plan(
    tmp_path: Path, line: dict, named: str
) -> None:
    cg = cgfile.load(TOY)
    target = next(t for t in expand(cg) if t.label == "//toy/mlp/8x64-b1@fp32:cpu")
    heard: list[dict] = []
    h = Held(TraceUnit("u", job_for(cg, target).with_id("u"), [target]), tmp_path, tmp_path / "h.log", None)
    h._on_trace = heard.append
    h._trace(line)
    h._trace(traced("cpu"))  # one result per unit
    ((failed),) = heard
    assert failed["ok"] is False and failed["code"] == "trace-failed" and failed["id"] == "u", failed
    assert (
        failed["detail"].startswith("the worker's trace line: the trace result: ")
        and named in failed["detail"]
    )
    assert not h.ok and h.sm is None


def test_a_traced_line_reaches_the_plan_as_the_trace_rules_facts(tmp_path: Path) -> None:
    cg = cgfile.load(TOY)
    target = next(t for t in expand(cg) if t.label == "//toy/mlp/8x64-b1@fp32:cpu")
    heard: list[dict] = []
    h = Held(TraceUnit("u", job_for(cg, target).with_id("u"), [target]), tmp_path, tmp_path / "h.log", None)
    h._on_trace = heard.append
    h._trace(traced("cpu"))
    contract = CallContract.from_json({}).to_json()
    expected = {"ok": True, "graph_digest": "d" * 64, "contract": contract, "topology": [], "nodes": 3}
    assert heard == [{**expected, "torch": "2.13.0", "sm": "cpu", "id": "u"}] and h.ok and h.sm == "cpu"


def test_a_worker_that_refuses_before_tracing_gives_the_plan_its_refusal(tmp_path: Path) -> None:
    """A held worker that cannot even start its stages (no such compiler) answers with its
    result line and exits 0: that refusal, not "exited without a result", is the unit's trace."""
    cg = cgfile.load(TOY)
    target = next(t for t in expand(cg) if t.label == "//toy/mlp/8x64-b1@fp32:cpu")
    heard: list[dict] = []
    h = Held(
        TraceUnit("u", job_for(cg, target).with_id("u"), [target]),
        tmp_path,
        tmp_path / "h.log",
        "/no/such/c++",
    )
    h.start(heard.append)
    h.thread.join(120)
    (trace,) = heard
    assert trace["ok"] is False and trace["code"] == "wrong-host" and "/no/such/c++" in trace["detail"], trace


def test_a_worker_the_spawner_refuses_to_start_is_a_typed_end_for_the_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While cgbuild is stopping the spawner starts no child: the unit's trace says the worker
    did not start (typed `worker-killed`) instead of the plan waiting on a trace that never comes."""
    cg = cgfile.load(TOY)
    target = next(t for t in expand(cg) if t.label == "//toy/mlp/8x64-b1@fp32:cpu")
    heard: list[dict] = []
    h = Held(TraceUnit("u", job_for(cg, target).with_id("u"), [target]), tmp_path, tmp_path / "h.log", None)
    monkeypatch.setattr(spawn, "_stopping", True)  # what stop_children() leaves behind
    h.start(heard.append)
    h.thread.join(30)
    (trace,) = heard
    assert trace["code"] == "worker-killed" and "did not start" in trace["detail"], trace
    assert h.traced.is_set() and not h.ok and h.pid is None
