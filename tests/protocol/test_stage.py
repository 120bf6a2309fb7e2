"""The mint worker's lines with its stage children: each typed message reads back as itself,
and a line that is not the message it must be is refused by name (`BadMessage`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.minted import job_for

from cgbuild.lanes import LaneAxis, Switches
from cgbuild.protocol.contract import CallContract
from cgbuild.protocol.mint import MintRequest
from cgbuild.protocol.stage import (
    AotiFacts,
    BadMessage,
    Compiled,
    Go,
    Measured,
    Served,
    StageEnv,
    StageStart,
    Traced,
    Verified,
    VerifiedLanes,
)
from cgbuild.protocol.trace import TraceJob

JOB = TraceJob.from_json(job_for(Path("/src"), "A"))
REQUEST = MintRequest(
    id="A",
    key="a" * 64,
    job=JOB,
    sm="cpu",
    graph_digest="b" * 64,
    toolchain={"platform": "cpu", "fold": "c" * 16, "components": {}},
    out="/out",
)
X = {"dtype": "float32", "device": "cpu", "shape": [1, 8], "stride": [8, 1]}
CONTRACT = CallContract.from_json({"inputs": [{"name": "x", "tree": "*", "leaves": [X]}]})
BAD_AXIS = "lanes.axes\\[0\\].values: not a list"
BAD_OK = "lanes.numerics.act.gelu.ok: not a boolean"
ANSWERS = [
    Traced("b" * 64, CONTRACT, [["fc1.weight", "F32", [4, 8]]], 18, "2.13.0", "cpu"),
    Compiled(
        graph_digest="b" * 64,
        contract=CONTRACT,
        nodes=18,
        module=None,
        toolchain={"platform": "cpu"},
        policy={"cpp.threads": 8},
        constants={"state": [], "literal": []},
        layout=None,
        aoti=AotiFacts("", {"GLIBC": "2.17"}),
        torch="2.13.0",
        forensics={"python": "3.11"},
        seconds={"export": 1.0, "compile": 2.0},
    ),
    Verified([{"output": 0, "rel_rms": 0.0}], {"type": "cpu", "visible": None}),
    Verified(
        [{"output": 0, "rel_rms": 0.0}],
        {"type": "cpu", "visible": None},
        VerifiedLanes(
            Switches.selected([LaneAxis("act", ("gelu", "relu"))], "_cgbuild_lanes", 2),
            {"gelu": [], "relu": []},
            {"act": {"gelu": {"ok": True, "rel_rms": 0.0}, "relu": {"ok": False, "detail": "differs"}}},
        ),
    ),
    Measured(),
    Served([{"output": 0}], [{"counters": {"compiled": 1}, "seconds": 0.1}]),
]


def wire(value: Any) -> Any:
    return json.loads(json.dumps(value))


@pytest.mark.parametrize("answer", ANSWERS, ids=lambda a: a.PART)
def test_every_answer_reads_back_as_itself(answer: Any) -> None:
    line = wire(answer.to_json())
    assert line["part"] == answer.PART and line["ok"] is True
    assert type(answer).from_json(line) == answer


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda line: {k: v for k, v in line.items() if k != "graph_digest"}, "missing graph_digest"),
        (lambda line: {**line, "extra": 1}, "unknown field 'extra'"),
        (lambda line: {**line, "part": "compile"}, "part 'compile'"),
        (lambda line: {**line, "ok": "yes"}, "ok 'yes'"),
        (lambda line: ["not", "an", "object"], "not a JSON object"),
    ],
)
def test_a_malformed_answer_is_refused_by_name(edit: Any, message: str) -> None:
    with pytest.raises(BadMessage, match=f"^the trace result: .*{message}"):
        Traced.from_json(edit(wire(ANSWERS[0].to_json())))


@pytest.mark.parametrize(
    ("answer", "field", "value", "message"),
    [
        (0, "contract", {"inputs": "x"}, "contract.inputs: not a list"),
        (
            1,
            "contract",
            {"inputs": [{"name": "x", "tree": "*", "leaves": [{**X, "dtype": 1}]}]},
            "leaves\\[0\\].dtype: not a string",
        ),
        (1, "aoti", {"runtime": {}}, "aoti.cpu_isa: not a string"),
        (1, "aoti", None, "aoti.cpu_isa: not a string"),
        (0, "contract", None, "contract: not an object"),
        (
            3,
            "lanes",
            {"axes": [{"axis": "act"}], "checked": {}, "numerics": {}},
            "lanes.axes\\[0\\].values: not a list",
        ),
        (
            3,
            "lanes",
            {"axes": [], "checked": {}, "numerics": {"act": {"gelu": {}}}},
            "lanes.numerics.act.gelu.ok",
        ),
        (1, "aoti", {"cpu_isa": "", "runtime": {"GLIBC": 2}}, "aoti.runtime: not a mapping"),
    ],
)
def test_a_typed_field_that_does_not_parse_is_refused_by_name(
    answer: int, field: str, value: Any, message: str
) -> None:
    """The contract and the host needs are parsed at the process edge, not passed on raw."""
    cls = type(ANSWERS[answer])
    with pytest.raises(BadMessage, match=f"^the {cls.PART} result: .*({message})"):
        cls.from_json({**wire(ANSWERS[answer].to_json()), field: value})


@pytest.mark.parametrize(
    "go",
    [
        Go("compile", request=REQUEST),
        Go("verify", request=REQUEST),
        Go("measure", candidates=("baseline", "chunked")),
        Go("serve", artifact="/out/a.tar.gz"),
    ],
    ids=lambda g: g.part,
)
def test_every_go_reads_back_as_itself(go: Go) -> None:
    assert Go.from_json(wire(go.to_json())) == go


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"part": "seal", "artifact": "x"}, "part 'seal' takes exactly its input None"),
        ({"part": "serve"}, "part 'serve' takes exactly its input 'artifact'"),
        ({"part": "serve", "artifact": "x", "candidates": []}, "takes exactly its input 'artifact'"),
        ({"part": "measure", "candidates": "baseline"}, "candidates must be a list"),
        ({"part": "serve", "artifact": 3}, "artifact must be a path"),
        ({"part": "verify", "request": {"schema": "nope"}}, "go verify: schema must be"),
    ],
)
def test_a_malformed_go_is_refused_by_name(line: dict[str, Any], message: str) -> None:
    with pytest.raises(BadMessage, match=message):
        Go.from_json(line)


def test_a_start_reads_back_held_or_with_its_request_and_refuses_what_it_lacks() -> None:
    env = StageEnv("/out/.mint-k", "/usr/bin/g++", "/tmp/sb")
    held = StageStart(JOB, env)
    keyed = StageStart(JOB, env, REQUEST)
    alone = StageStart(JOB, StageEnv("/tmp/v"), go=Go("serve", artifact="/a.tar.gz"))
    for start in (held, keyed, alone):
        assert StageStart.from_json(wire(start.to_json())) == start
    assert held.held and not keyed.held
    with pytest.raises(BadMessage, match="stage start: missing env"):
        StageStart.from_json({"job": JOB.to_json()})
    with pytest.raises(BadMessage, match="stage start env: unknown field 'device'"):
        StageStart.from_json({"job": JOB.to_json(), "env": {"work": "/w", "device": "cuda"}})
    with pytest.raises(BadMessage, match="stage start: bad job"):
        StageStart.from_json({"job": {"spec": {}}, "env": {"work": "/w"}})
