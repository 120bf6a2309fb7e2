"""Torn or foreign state files are set aside with a timestamp, warned about once, and rebuilt."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from hostile import Workspace, call

from cgbuild.core import statefile
from cgbuild.identity import toolchain
from cgbuild.plan.tracecache import TraceCache


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    return Workspace(tmp_path)


def plan(ws: Workspace) -> str:
    """One real plan of the valid workspace (no trace: the lock's torch is not this one); its stderr."""
    outcome = call(["-C", str(ws.valid), "plan", "--no-trace", "--json", "--toolchain", str(ws.lock)])
    assert outcome.code == 0, outcome.stderr
    return outcome.stderr


def aside(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f"{path.name}.torn-*"))


STATE = ".cgbuild"


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("last-plan.json", b"[]"),
        ("last-plan.json", b'{"schema": "cgbuild.last-plan/2", "targets": {'),
        ("last-plan.json", b'{"schema": "cgbuild.last-plan/2", "targets": {"//a": []}}'),
        ("last-plan.json", b'{"schema": "cgbuild.last-plan/2", "targets": {"//a": {"axes": {"sm": {}}}}}'),
        ("last-plan.json", b'{"schema": "cgbuild.last-plan/2", "pending": {"//a": {"key": 7}}}'),
        ("last-plan.json", b'{"schema": "cgbuild.last-plan/2", "families": {"f": {"entry": 1}}}'),
        ("last-plan.json", b'{"schema": "cgbuild.last-plan/2", "environments": {"e": {"dists": []}}}'),
        ("last-plan.json", b'{"schema": "cgbuild.last-plan/1", "targets": {}}'),
        (
            "last-plan.json",
            b'{"schema": "cgbuild.last-plan/2", "toolchains": {"f": {"t": 1.5}}}',
        ),
        ("last-plan.json", b'{"schema": "cgbuild.last-plan/0"}'),
        ("last-plan.json", b"\xff\xfe"),
        ("cache/dists.json", b"[]"),
        ("cache/dists.json", b'{"stamp": "x", "dists": {"torch": 2}}'),
        ("cache/sources.json", b"[]"),
        ("cache/sources.json", b'{"models.py": [1, 2]}'),
        ("traces.sqlite", b"this is not a database" * 100),
    ],
)
def test_torn_state_is_set_aside_and_rebuilt(
    ws: Workspace, name: str, content: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    plan(ws)
    path = ws.valid / STATE / name
    assert path.exists()
    path.write_bytes(content)
    err = plan(ws)
    assert err.count("warning:") == 1 and "set aside" in err and str(path) in err
    assert len(aside(path)) == 1 and aside(path)[0].read_bytes() == content  # kept for a post-mortem
    assert path.exists() and path.read_bytes() != content  # rebuilt
    assert "warning" not in plan(ws)  # once


def test_a_folder_where_a_state_file_goes(ws: Workspace) -> None:
    plan(ws)
    path = ws.valid / STATE / "last-plan.json"
    path.unlink()
    path.mkdir()
    assert "set aside" in plan(ws)
    assert path.is_file() and len(aside(path)) == 1


def test_foreign_trace_database_and_bad_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "traces.sqlite"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE traces (id INTEGER, blob BLOB)")  # another tool's table of that name
    db.commit()
    db.close()
    cache = TraceCache(path)
    cache.put("a", {"digest": "x"})
    assert cache.get_many(["a"]) == {"a": {"digest": "x"}}
    assert len(aside(path)) == 1 and "set aside" in capsys.readouterr().err
    with cache._db:
        cache._db.execute("INSERT INTO traces VALUES ('b', '[1]'), ('c', 'not json')")
    assert cache.get_many(["a", "b", "c"]) == {"a": {"digest": "x"}}
    assert "2 unreadable trace rows dropped" in capsys.readouterr().err
    assert cache.get_many(["b", "c"]) == {}
    assert capsys.readouterr().err == ""
    cache.close()


def test_probe_cache_torn_or_crafted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "toolchain.json"
    first = toolchain.probe(cache_path=str(path))
    doc = json.loads(path.read_text())
    for entry in doc["entries"].values():
        entry["result"]["closure"] = []  # the stats still match: only the shape check stops this
    path.write_text(json.dumps(doc))
    assert toolchain.probe(cache_path=str(path)) == first
    assert "set aside" in capsys.readouterr().err and len(aside(path)) == 1
    path.write_bytes(b'{"schema": "cgbuild.toolchain-cache/1", "entries": {')
    assert toolchain.probe(cache_path=str(path)) == first
    assert "not JSON" in capsys.readouterr().err and len(aside(path)) == 2


def test_a_state_file_that_cannot_be_set_aside_is_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "gone" / "last-plan.json"  # its folder vanished between read and rename
    with pytest.raises(statefile.UserError, match="cannot be set aside"):
        statefile.set_aside(path, "test")
