"""The engine <-> rules contract: requests round-trip through their one serialiser, and the
rules refuse what the contract does not allow (the same types validate on both sides)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from hostile import _mutated
from hypothesis import given, settings

from cgbuild.config import cgfile
from cgbuild.config.targets import expand
from cgbuild.protocol.mint import BadRequest, MintHold, MintRequest
from cgbuild.protocol.trace import BadJob, TraceJob, job_for, request

TOY = Path(__file__).resolve().parents[2] / "examples" / "toy" / "Cgfile"


@pytest.fixture(scope="module")
def job() -> TraceJob:
    cg = cgfile.load(TOY)
    target = next(t for t in expand(cg) if t.label == "//toy/mlp/8x64-b1@fp32:cpu")
    return job_for(cg, target).with_id("j1")


def test_trace_job_round_trips(job: TraceJob) -> None:
    doc = job.to_json()
    assert TraceJob.from_json(doc) == job and TraceJob.from_json(doc).id == "j1"
    assert set(doc) == {"entry", "root", "config", "spec", "quant", "id"}
    assert request([job])["jobs"] == [doc]


def test_the_trace_job_shape_is_a_trace_input(job: TraceJob) -> None:
    """The spec is hashed into the trace inputs: its fields are pinned, so a change is deliberate."""
    assert set(job.spec) == {
        "family", "module", "graph_class", "height", "width", "text_len", "batch", "dtype", "device", "lanes",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.pop("entry"), "missing entry"),
        (lambda d: d["spec"].pop("batch"), "missing spec.batch"),
        (lambda d: d["spec"].update(device="tpu"), "device 'tpu'"),
        (lambda d: d["spec"].update(lanes={"linear": []}), "spec.lanes"),
        (lambda d: d.update(config=[1]), "config must be an object"),
        (lambda d: d.update(quant=7), "quant must be a string"),
    ],
)
def test_a_bad_trace_job_is_named(job: TraceJob, edit, message: str) -> None:
    doc = job.to_json()
    edit(doc)
    with pytest.raises(BadJob, match=message):
        TraceJob.from_json(doc)


def _mint(job: TraceJob, **extra) -> MintRequest:
    return MintRequest(
        id="k",
        key="k",
        job=job,
        sm="cpu",
        graph_digest="g",
        toolchain={"platform": "cpu", "fold": "f", "components": {}},
        out="/out",
        labels=["//toy/mlp/8x64-b1@fp32:cpu"],
        **extra,
    )


def test_mint_request_round_trips(job: TraceJob) -> None:
    req = _mint(job, empty_sandbox=True, compare_with="a.tar.gz", timeout_s=5.0)
    doc = req.to_json()
    assert doc["schema"] == "cgbuild.mint-request/1" and "cxx" not in doc
    assert MintRequest.from_json(doc) == req


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(schema="cgbuild.mint-request/0"), "schema"),
        (lambda d: d.pop("graph_digest"), "missing graph_digest"),
        (lambda d: d.update(colour="red"), "unknown field 'colour'"),
        (lambda d: d.update(sm="sm_90"), "disagree"),
        (lambda d: d["toolchain"].update(platform="cuda"), "disagree"),
        (lambda d: d["job"].pop("spec"), "missing spec"),
    ],
)
def test_a_bad_mint_request_is_named(job: TraceJob, edit, message: str) -> None:
    doc = _mint(job).to_json()
    edit(doc)
    with pytest.raises(BadRequest, match=message):
        MintRequest.from_json(doc)


def _hold(job: TraceJob, **extra: Any) -> MintHold:
    return MintHold(id="u", job=job.with_id("u"), out="/out", **extra)


def test_a_hold_round_trips_and_admits_only_the_request_it_was_started_for(job: TraceJob) -> None:
    hold = _hold(job, timeout_s=5.0)
    assert MintHold.from_json(hold.to_json()) == hold
    assert hold.admits(_mint(job, timeout_s=5.0)) is None
    other = TraceJob(job.entry, job.root, job.config, {**job.spec, "batch": 2}, job.quant, "k")
    refusals = {
        "job": _mint(other, timeout_s=5.0),
        "out": dataclasses.replace(_mint(job, timeout_s=5.0), out="/elsewhere"),
        "cxx": _mint(job, timeout_s=5.0, cxx="clang++"),
        "timeout_s": _mint(job),
        "empty_sandbox": _mint(job, timeout_s=5.0, empty_sandbox=True),
        "compare_with": _mint(job, timeout_s=5.0, compare_with="a.tar.gz"),
    }
    for word, req in refusals.items():
        why = hold.admits(req)
        assert why is not None and word.split("_")[0] in why, (word, why)


HOLD_DOC = MintHold(
    id="u", job=TraceJob("e:build", "/r", {}, dict.fromkeys(("family", "module"), "x") | {
        "graph_class": "c", "height": 1, "width": 1, "text_len": None, "batch": 1, "dtype": "float32",
        "device": "cpu"}, "plain.fp32", "u"), out="/out", sandbox="/sb",
).to_json()  # fmt: skip


@settings(max_examples=300, deadline=None, derandomize=True)
@given(mutated=_mutated(HOLD_DOC, toml=False))
def test_generated_holds_read_or_are_refused_by_name(mutated: tuple[dict[str, Any], str]) -> None:
    """Whatever first line a worker is handed, a hold reads or is refused `bad-request`, and a
    hold that reads refuses, or admits, any request without raising."""
    doc, _ = mutated
    try:
        hold = MintHold.from_json(doc)
    except BadRequest as refused:
        assert str(refused)
        return
    req = MintRequest(
        id="k", key="k", job=hold.job, sm="cpu", graph_digest="g",
        toolchain={"platform": "cpu", "fold": "f", "components": {}}, out="/out", sandbox="/sb",
    )  # fmt: skip
    assert hold.admits(req) is None or isinstance(hold.admits(req), str)


@pytest.mark.parametrize("frames", [0, -3, True, "9", 2.5])
def test_a_jobs_frame_count_is_a_positive_integer(job: TraceJob, frames: Any) -> None:
    raw = job.to_json()
    with pytest.raises(BadJob, match=r"spec\.frames"):
        TraceJob.from_json({**raw, "spec": {**raw["spec"], "frames": frames}})
    ok = TraceJob.from_json({**raw, "spec": {**raw["spec"], "frames": 9}})
    assert ok.spec["frames"] == 9
