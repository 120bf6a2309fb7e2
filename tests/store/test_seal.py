"""Sealed artifacts are deterministic, closed, and readable without torch."""

from __future__ import annotations

import gzip
import io
import json
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
    sizes = {"model.pt2": pkg_a.stat().st_size, "constants.safetensors": 13}
    sealed = {"members": sizes, "package": {"entries": 1, "bytes": 400}}
    assert read_metadata(a_dir / "out.tar.gz") == {**META, "sealed": sealed}
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
        "metadata.json",  # the sealed sizes: one entry more
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


# ---- hostile archives: every layer is checked before anything is unpacked ----------------------
def _forge(path: Path, members: list[tarfile.TarInfo | tuple[str, bytes]], *, cut: int | None = None) -> Path:
    """A tar.gz written member by member, with no check: what an attacker would hand over.
    `cut` truncates the compressed file to that many bytes."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        for m in members:
            if isinstance(m, tarfile.TarInfo):
                tar.addfile(m, io.BytesIO(b"\0" * m.size) if m.isreg() else None)
            else:
                info = tarfile.TarInfo(m[0])
                info.size = len(m[1])
                tar.addfile(info, io.BytesIO(m[1]))
    path.write_bytes(buf.getvalue()[:cut])
    return path


def _meta(pkg: bytes, **sealed: object) -> bytes:
    record = {"members": {"model.pt2": len(pkg)}, "package": {"entries": 1, "bytes": 1}, **sealed}
    return json.dumps({**META, "sealed": record}).encode()


@pytest.mark.parametrize(
    ("kind", "code"),
    [
        ("dotdot", "bad-member"),
        ("absolute", "bad-member"),
        ("symlink", "bad-member"),
        ("hardlink", "bad-member"),
        ("device", "bad-member"),
        ("fifo", "bad-member"),
        ("extra", "bad-member"),
        ("order", "bad-member"),
        ("pax", "bad-member"),
    ],
)
def test_tar_members_outside_the_closed_list_are_refused_before_unpacking(
    tmp_path: Path, kind: str, code: str
) -> None:
    pkg = _pt2(tmp_path / "m.pt2", {"a": b"1"}).read_bytes()
    head: list[tarfile.TarInfo | tuple[str, bytes]] = [("metadata.json", _meta(pkg)), ("model.pt2", pkg)]
    odd = tarfile.TarInfo(
        {"dotdot": "../escape", "absolute": str(tmp_path / "escape")}.get(kind, "constants.safetensors")
    )
    if kind in ("symlink", "hardlink"):
        odd.type, odd.linkname = (tarfile.SYMTYPE if kind == "symlink" else tarfile.LNKTYPE), "/etc/passwd"
    elif kind == "device":
        odd.type, odd.devmajor, odd.devminor = tarfile.CHRTYPE, 1, 3
    elif kind == "fifo":
        odd.type = tarfile.FIFOTYPE
    elif kind == "pax":
        odd.size, odd.pax_headers = 1, {"comment": "x"}
    members = [*head, odd]
    if kind == "extra":
        members = [*head, ("notes.txt", b"hi")]
    elif kind == "order":
        members = [("model.pt2", pkg), ("metadata.json", _meta(pkg))]
    bad = _forge(tmp_path / "bad.tgz", members)
    with pytest.raises(SealError) as e:
        unseal(bad, tmp_path / "dest")
    assert e.value.code == code
    assert not (tmp_path / "escape").exists() and not (tmp_path / "dest" / "constants.safetensors").exists()


def test_a_member_over_its_sealed_size_or_the_cap_is_refused_from_its_header(tmp_path: Path) -> None:
    """A gzip bomb announces its size in the tar header before its data: refused there, unread."""
    pkg = _pt2(tmp_path / "m.pt2", {"a": b"1"}).read_bytes()
    huge = tarfile.TarInfo("model.pt2")
    huge.size = 2 << 30
    for meta in (
        _meta(pkg),  # the seal says a few bytes, the header 2 GiB
        json.dumps(META).encode(),  # sealed before sizes were recorded: the cap decides
        _meta(pkg, members={"model.pt2": 2 << 30}),  # the seal itself claims 2 GiB
    ):
        # 2 GiB of zeros cost 2.5 s to compress; the header alone is what is judged, so the
        # stream stops after 1 MiB of them (without the checks this is an unreadable archive)
        first = tarfile.TarInfo("metadata.json")
        first.size = len(meta)
        pad = b"\0" * (-len(meta) % 512)
        tar = first.tobuf(tarfile.USTAR_FORMAT) + meta + pad + huge.tobuf(tarfile.USTAR_FORMAT)
        bomb = tmp_path / "bomb.tgz"
        bomb.write_bytes(gzip.compress(tar + b"\0" * (1 << 20)))
        with pytest.raises(SealError) as e:
            unseal(bomb, tmp_path / "dest")
        assert e.value.code == "too-large", e.value
        assert not (tmp_path / "dest" / "model.pt2").exists()


def test_a_pax_header_bomb_before_the_metadata_is_stopped_by_the_byte_budget(tmp_path: Path) -> None:
    info = tarfile.TarInfo("metadata.json")
    info.size = 2
    info.pax_headers = {"comment": "x" * (16 << 20)}  # read whole by tarfile before any check
    bomb = _forge(tmp_path / "pax.tgz", [info])
    with pytest.raises(SealError) as e:
        read_metadata(bomb)
    assert e.value.code == "too-large"


def test_truncated_garbled_and_foreign_archives_are_seal_errors(tmp_path: Path) -> None:
    pkg = _pt2(tmp_path / "m.pt2", {"data/x.so": os.urandom(4096)})
    good = seal(tmp_path / "good.tgz", META, {"model.pt2": pkg}) and tmp_path / "good.tgz"
    raw = good.read_bytes()
    cases = {
        "truncated": raw[: len(raw) // 2],
        "garbled": raw[:20] + bytes(b ^ 0x5A for b in raw[20:60]) + raw[60:],
        "not-json": _forge(
            tmp_path / "nj.tgz", [("metadata.json", b"{no"), ("model.pt2", b"PK")]
        ).read_bytes(),
        "a-list": _forge(tmp_path / "l.tgz", [("metadata.json", b"[]"), ("model.pt2", b"PK")]).read_bytes(),
        "sealed-shape": _forge(
            tmp_path / "s.tgz", [("metadata.json", json.dumps({"sealed": {"members": []}}).encode())]
        ).read_bytes(),
    }
    codes = {}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(SealError) as e:
            unseal(tmp_path / name, tmp_path / f"out-{name}")
        codes[name] = e.value.code
    assert codes == {
        "truncated": "bad-archive",
        "garbled": "bad-archive",
        "not-json": "bad-metadata",
        "a-list": "bad-metadata",
        "sealed-shape": "bad-metadata",
    }


def _zip(path: Path, entries: list[zipfile.ZipInfo | tuple[str, bytes]]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for e in entries:
            if isinstance(e, zipfile.ZipInfo):
                z.writestr(e, b"x")
            else:
                z.writestr(e[0], e[1])
    return path


@pytest.mark.filterwarnings("ignore:Duplicate name")
@pytest.mark.parametrize(
    "name",
    [
        "model/data/aotinductor/model/../../../outside/x",
        "/abs/x",
        "model/./x",
        "model//x",
        "model\\..\\x",
        "model/x\n",
        "C:/x",
        "other/x",  # a second top-level folder
        "model/a",  # a duplicate
        "symlink",
        "device",
    ],
)
def test_every_package_entry_is_checked_before_any_loader_sees_it(tmp_path: Path, name: str) -> None:
    entries: list[zipfile.ZipInfo | tuple[str, bytes]] = [("model/a", b"1")]
    if name in ("symlink", "device"):
        info = zipfile.ZipInfo("model/link")
        info.create_system = 3
        info.external_attr = (0o120777 if name == "symlink" else 0o020644) << 16
        entries.append(info)
    else:
        entries.append((name, b"evil"))
    pkg = _zip(tmp_path / "m.pt2", entries)
    with pytest.raises(SealError) as e:
        seal(tmp_path / "o.tgz", META, {"model.pt2": pkg})  # what seals, unseals: refused here too
    assert e.value.code == "bad-package"
    # forged past seal, with a truthful size record: unseal refuses it all the same
    data = pkg.read_bytes()
    with zipfile.ZipFile(pkg) as z:
        record = {"entries": len(z.infolist()), "bytes": sum(i.file_size for i in z.infolist())}
    forged = _forge(tmp_path / "f.tgz", [("metadata.json", _meta(data, package=record)), ("model.pt2", data)])
    with pytest.raises(SealError) as e:
        unseal(forged, tmp_path / "dest")
    assert e.value.code == "bad-package"


def test_package_counts_and_crc_must_match(tmp_path: Path) -> None:
    pkg = _zip(tmp_path / "m.pt2", [("model/a", b"1" * 100), ("model/b", b"2")])
    data = pkg.read_bytes()
    lying = _forge(
        tmp_path / "l.tgz",
        [("metadata.json", _meta(data, package={"entries": 2, "bytes": 50})), ("model.pt2", data)],
    )
    with pytest.raises(SealError, match="sealed as 2 of 50") as e:
        unseal(lying, tmp_path / "d1")
    assert e.value.code == "too-large"
    flipped = bytearray(data)
    flipped[data.index(b"1" * 100) + 5] ^= 1
    bad_crc = _forge(
        tmp_path / "c.tgz",
        [("metadata.json", _meta(data, package={"entries": 2, "bytes": 101})), ("model.pt2", bytes(flipped))],
    )
    with pytest.raises(SealError) as e:
        unseal(bad_crc, tmp_path / "d2")
    assert e.value.code == "bad-package"
