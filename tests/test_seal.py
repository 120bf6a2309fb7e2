"""Sealed artifacts are deterministic, closed, and readable without torch."""

from __future__ import annotations

import io
import os
import tarfile
import zipfile
from pathlib import Path

import pytest

from cgbuild.store.seal import SealError, compare_artifacts, diff_artifacts, read_metadata, seal, unseal

META = {"key": "ab12", "graph": {"digest": "00ff"}, "torch": "2.13.0+cpu", "facets": ["8x64-b1"]}


def _pt2(path: Path, entries: dict[str, bytes], top: str = "model") -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        for name, data in entries.items():
            z.writestr(zipfile.ZipInfo(f"{top}/{name}", date_time=(1980, 1, 1, 0, 0, 0)), data)
    return path


def test_same_inputs_give_byte_identical_archives(tmp_path: Path) -> None:
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir()
    b_dir.mkdir()
    pkg_a = _pt2(a_dir / "whatever.pt2", {"data/aotinductor/model/x.so": b"\x7fELF" * 100})
    pkg_b = b_dir / "other-name.pt2"
    pkg_b.write_bytes(pkg_a.read_bytes())
    os.utime(pkg_b, (1_000_000, 1_000_000))  # different mtime and mode on the source files
    os.chmod(pkg_b, 0o600)
    lit = a_dir / "lit.safetensors"
    lit.write_bytes(b"literal bytes")
    sha_a = seal(a_dir / "out.tar.gz", META, {"model.pt2": pkg_a, "constants.safetensors": lit})
    sha_b = seal(
        b_dir / "sealed.tgz", dict(reversed(META.items())), {"constants.safetensors": lit, "model.pt2": pkg_b}
    )
    assert sha_a == sha_b
    raw = (a_dir / "out.tar.gz").read_bytes()
    assert raw == (b_dir / "sealed.tgz").read_bytes()
    assert raw[3] == 0 and raw[4:8] == b"\0\0\0\0"  # gzip: no FNAME flag, mtime 0
    with tarfile.open(a_dir / "out.tar.gz") as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == ["metadata.json", "model.pt2", "constants.safetensors"]
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) for m in members} == {(0, 0, 0, "", "", 0o644)}
    assert read_metadata(a_dir / "out.tar.gz") == META
    out = unseal(a_dir / "out.tar.gz", tmp_path / "x")
    assert out["model.pt2"].read_bytes() == pkg_a.read_bytes()
    assert out["constants.safetensors"].read_bytes() == b"literal bytes"


def test_refusals(tmp_path: Path) -> None:
    pkg = _pt2(tmp_path / "m.pt2", {"a": b"1"})
    with pytest.raises(SealError, match="bare AOTI"):
        read_metadata(pkg)
    with pytest.raises(SealError, match="unknown members"):
        seal(tmp_path / "o.tgz", META, {"model.pt2": pkg, "extra.txt": pkg})
    with pytest.raises(SealError, match="required"):
        seal(tmp_path / "o.tgz", META, {})
    evil = tmp_path / "evil.tgz"
    with tarfile.open(evil, "w:gz") as tar:
        for name in ("metadata.json", "model.pt2", "../escape"):
            info = tarfile.TarInfo(name)
            info.size = 2
            tar.addfile(info, io.BytesIO(b"{}"))
    with pytest.raises(SealError, match="members"):
        unseal(evil, tmp_path / "dest")
    assert not (tmp_path / "escape").exists()


def test_diff_names_differing_package_entries(tmp_path: Path) -> None:
    same = {"data/aotinductor/model/k.cpp": b"int k;", "data/aotinductor/model/w.so": b"so"}
    a = seal(tmp_path / "a.tgz", META, {"model.pt2": _pt2(tmp_path / "a.pt2", same, top="pkg_a")})
    b = seal(tmp_path / "b.tgz", META, {"model.pt2": _pt2(tmp_path / "b.pt2", same, top="pkg_b")})
    assert a != b  # the package's top-level folder differs …
    assert diff_artifacts(tmp_path / "a.tgz", tmp_path / "b.tgz") == ["model.pt2"]  # … and nothing inside
    other = {**same, ".data/serialization_id": b"1234"}
    seal(tmp_path / "c.tgz", META, {"model.pt2": _pt2(tmp_path / "c.pt2", other)})
    assert diff_artifacts(tmp_path / "a.tgz", tmp_path / "c.tgz") == [
        "model.pt2",
        "model.pt2!.data/serialization_id",
    ]


def test_a_moved_lane_verdict_is_reported_apart_from_the_build(tmp_path: Path) -> None:
    """Timing noise near the tie band moves a verdict (docs/lanes.md): reported, not a build difference."""
    pkg = _pt2(tmp_path / "m.pt2", {"data/aotinductor/model/k.cpp": b"int k;"})
    speed = {"winner": "baseline", "binding": "speed", "peaks": {"baseline": 1, "chunked": 1}}
    tie = {**speed, "binding": "tie-peak"}
    lanes = {"axes": [{"axis": "linear"}], "excluded": {}}
    seal(tmp_path / "a.tgz", {**META, "lanes": {**lanes, "verdict": speed}}, {"model.pt2": pkg})
    seal(tmp_path / "b.tgz", {**META, "lanes": {**lanes, "verdict": tie}}, {"model.pt2": pkg})
    moved = compare_artifacts(tmp_path / "a.tgz", tmp_path / "b.tgz")
    assert moved["reproducible"] is True and moved["differing"] == ["metadata.json"]
    assert moved["fields"] == ["lanes.verdict.binding"]
    assert moved["verdict_moved"] == {"recorded": speed, "now": tie}
    # any other metadata field is the build's own: not reproducible, and named
    seal(
        tmp_path / "c.tgz",
        {**META, "torch": "2.14.1", "lanes": {**lanes, "verdict": tie}},
        {"model.pt2": pkg},
    )
    both = compare_artifacts(tmp_path / "a.tgz", tmp_path / "c.tgz")
    assert both["reproducible"] is False and both["fields"] == ["lanes.verdict.binding", "torch"]
    # a moved axis list is not the verdict, even though it sits beside it
    seal(tmp_path / "d.tgz", {**META, "lanes": {**lanes, "axes": [], "verdict": speed}}, {"model.pt2": pkg})
    axes = compare_artifacts(tmp_path / "a.tgz", tmp_path / "d.tgz")
    assert (
        axes["reproducible"] is False and axes["verdict_moved"] is None and axes["fields"] == ["lanes.axes"]
    )
    same = compare_artifacts(tmp_path / "a.tgz", tmp_path / "a.tgz")
    assert same == {"reproducible": True, "differing": [], "fields": [], "verdict_moved": None}
