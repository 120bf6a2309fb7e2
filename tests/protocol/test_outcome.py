"""One mint outcome: `Minted | MintFailed`, built by every producer and read back from its line.

The worker writes its outcome as one JSON line; the engine reads it back with
`outcome_from_json`, and a line that is not an outcome is the worker's `mint-error`, never a
dict passed on for each reader to interpret its own way.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from cgbuild.core.codes import RETRYABLE, Code
from cgbuild.protocol import mint as protocol
from cgbuild.protocol.mint import PHASES, BadResult, Minted, MintFailed, Phase, outcome_from_json

MINTED = Minted(
    key="a" * 64,
    artifact="/out/a.tar.gz",
    sha256="b" * 64,
    size=10,
    members={"package.pt2": "c" * 64},
    phases={"compile": 1.0, "total": 2.0},
    compared={"reproducible": True, "differing": [], "fields": [], "verdict_moved": None},
    id="a" * 64,
)


def test_minted_reads_back_as_itself() -> None:
    line = json.loads(json.dumps(MINTED.to_json()))
    assert line["ok"] is True and line["reproducible"] is True  # the wire keeps its flat fields
    assert outcome_from_json(line) == MINTED


def test_a_failure_reads_back_with_its_facts_and_retryable_from_its_code() -> None:
    failed = MintFailed(Code.GRAPH_DRIFT, Phase.COMPILE, "moved", {"old": "x", "new": "y"}, "k")
    line = json.loads(json.dumps(failed.to_json()))
    assert line == {
        "id": "k",
        "ok": False,
        "code": "graph-drift",
        "retryable": False,
        "phase": "compile",
        "detail": "moved",
        "old": "x",
        "new": "y",
    }
    assert outcome_from_json(line) == failed
    # a line that claims otherwise does not decide: retryable follows from the code alone
    lying = outcome_from_json({**line, "retryable": True})
    assert isinstance(lying, MintFailed) and lying.retryable is False
    assert MintFailed(Code.OOM, Phase.COMPILE, "").retryable is (Code.OOM in RETRYABLE) is True


@pytest.mark.parametrize(
    "line",
    [
        [],
        {"ok": "yes"},
        {"ok": False, "code": "moved-somehow", "phase": "compile", "detail": ""},
        {"ok": False, "code": "graph-drift", "phase": "somewhere", "detail": ""},
        {"ok": True, "key": "a" * 64},  # required fields missing
        {**MINTED.to_json(), "surprise": 1},
    ],
)
def test_what_is_not_an_outcome_is_refused(line: Any) -> None:
    with pytest.raises(BadResult):
        outcome_from_json(line)


def test_a_failure_takes_a_code_and_a_phase_not_their_strings() -> None:
    with pytest.raises(TypeError):
        MintFailed("graph-drift", Phase.COMPILE, "")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        MintFailed(Code.GRAPH_DRIFT, "compile", "")  # type: ignore[arg-type]


def test_a_worker_line_that_is_no_outcome_is_a_typed_mint_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that answers with something else (another version's line, a bug) fails its key
    as `mint-error` in the `worker` phase, naming its log, instead of reaching the CLI raw."""
    rules = tmp_path / "fake_rules"
    rules.mkdir()
    (rules / "__init__.py").write_text("")
    (rules / "mint.py").write_text(
        "import json, sys\nsys.stdin.readline()\n"
        'print(json.dumps({"id": "k", "ok": True, "key": "k"}), flush=True)\n'
    )
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{':'.join(sys.path)}")
    monkeypatch.setattr(protocol, "spawn", _spawn_as(protocol.spawn, "fake_rules.mint"))
    got = protocol.run_worker({"id": "k"}, tmp_path / "k.log")
    assert isinstance(got, MintFailed)
    assert (got.code, got.phase) == (Code.MINT_ERROR, Phase.WORKER)
    assert "not a mint result" in got.detail and str(tmp_path / "k.log") in got.detail


def _spawn_as(spawn: Any, module: str) -> Any:
    def spawned(_module: str, *args: Any, **kwargs: Any) -> Any:
        return spawn(module, *args, **kwargs)

    return spawned


def test_the_worker_announces_only_phases_of_the_enum() -> None:
    assert all(isinstance(p, Phase) for p in PHASES)
    assert [p.value for p in PHASES] == ["compile", "verify", "lanes", "seal", "serve"]
