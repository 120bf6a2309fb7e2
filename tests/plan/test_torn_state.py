"""Torn or foreign state files (the trace cache, the last plan) are set aside with one warning
and rebuilt: never a traceback, never trusted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.cli import cli
from support.toy import copy_toy

from cgbuild.plan.laststate import SCHEMA as LAST_PLAN_SCHEMA
from cgbuild.plan.laststate import load as load_last
from cgbuild.plan.tracecache import TraceCache


@pytest.mark.parametrize("garbage", [b"not a database at all" * 100, b"SQLite format 3\0" + b"\xff" * 4000])
def test_a_garbage_trace_cache_is_set_aside_and_rebuilt(
    tmp_path: Path, garbage: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "traces.sqlite"
    path.write_bytes(garbage)
    cache = TraceCache(path)
    cache.put("k", {"graph_digest": "g"})
    assert cache.get_many(["k"]) == {"k": {"graph_digest": "g"}}
    (aside,) = tmp_path.glob("traces.sqlite.torn-*")
    assert aside.read_bytes() == garbage
    assert capsys.readouterr().err.count("warning") == 1


@pytest.mark.parametrize("text", ["[]", "{nope", '{"schema": "cgbuild.last-plan/0"}', "[" * 100000])
def test_a_torn_or_foreign_last_plan_is_set_aside(
    tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "last-plan.json"
    path.write_text(text)
    assert load_last(path) == {}
    assert not path.exists() and len(list(tmp_path.glob("last-plan.json.torn-*"))) == 1
    assert capsys.readouterr().err.count("warning") == 1
    path.write_text(json.dumps({"schema": LAST_PLAN_SCHEMA, "targets": {}}))
    assert load_last(path)["schema"] == LAST_PLAN_SCHEMA  # a sound one is read, not moved
    assert load_last(tmp_path / "absent.json") == {} and not capsys.readouterr().err


@pytest.mark.slow
def test_plan_over_torn_state_warns_and_succeeds(tmp_path: Path, toy_reference: Path) -> None:
    ws = copy_toy(tmp_path / "toy", toy_reference)
    state = ws / ".cgbuild"
    state.mkdir()
    (state / "traces.sqlite").write_bytes(b"\0garbage" * 512)
    (state / "last-plan.json").write_text("[]")
    label = "//toy/mlp/8x64-b1@fp32:cpu"
    proc = cli(ws, "plan", label, "--json")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("warning") == 2
    assert json.loads(proc.stdout)["targets"][0]["status"] == "mint"
    again = cli(ws, "plan", label, "--json")
    assert again.returncode == 0 and "warning" not in again.stderr  # rebuilt: sound now
