"""The one atomic-write helper: whole files or none, and no temp left behind by a failed write."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cgbuild.core import fs


def test_write_json_replaces_whole_and_creates_the_folder(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b.json"
    fs.write_json(path, {"b": 1, "a": [2]})
    fs.write_json(path, {"c": 3})
    assert json.loads(path.read_text()) == {"c": 3}
    assert path.read_text() == '{"c": 3}\n'
    assert sorted(p.name for p in path.parent.iterdir()) == ["b.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "state.json"
    fs.write_json(path, {"old": True})

    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space"):
        fs.write_json(path, {"new": True})
    assert json.loads(path.read_text()) == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_stat_stamp_moves_when_a_file_is_rewritten(tmp_path: Path) -> None:
    path = tmp_path / "f"
    assert fs.stat_stamp(path) is None
    path.write_text("a")
    first = fs.stat_stamp(path)
    os.utime(path, ns=(1, 1))
    assert fs.stat_stamp(path) != first
