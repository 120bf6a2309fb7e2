"""Sealed artifacts: a deterministic tar.gz of `metadata.json`, the AOTI package, and literals.

Same inputs give the same bytes, so the store's content digest of an artifact means "these
bytes" and two mints of one key can be compared byte for byte. What makes it deterministic:
a fixed member order, USTAR headers with mtime/uid/gid 0, empty user/group names and mode 0644,
canonical JSON for the metadata, and a gzip header with no file name and mtime 0 (gzip would
otherwise store the output path and the clock). The deflate stream itself depends on zlib's
version; that is a property of the sealing host, not of the artifact's identity.

Members are a closed list: unsealing refuses anything else, so an archive cannot write outside
its destination or smuggle a file the loader would pick up.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import tarfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cgbuild.core.canon import canonical_json

METADATA = "metadata.json"
PACKAGE = "model.pt2"
LITERALS = "constants.safetensors"
MEMBER_ORDER = (METADATA, PACKAGE, LITERALS)
_MAX_METADATA = 8 << 20


class SealError(Exception):
    """An archive is not a well-formed sealed artifact (or cannot be made into one)."""


def _info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info


def seal(
    out_path: str | os.PathLike[str],
    metadata: Mapping[str, Any],
    members: Mapping[str, str | os.PathLike[str]],
) -> str:
    """Write the sealed artifact to `out_path` atomically; return its sha256.

    `members` maps member names (`model.pt2` required, `constants.safetensors` optional) to files.
    """
    unknown = set(members) - set(MEMBER_ORDER[1:])
    if unknown:
        raise SealError(f"unknown members {sorted(unknown)}; a sealed artifact holds {list(MEMBER_ORDER)}")
    if PACKAGE not in members:
        raise SealError(f"{PACKAGE} is required")
    meta_bytes = (canonical_json(dict(metadata)) + "\n").encode("ascii")
    out = Path(out_path)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as raw:
            with (
                gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz,
                tarfile.open(fileobj=gz, mode="w", format=tarfile.USTAR_FORMAT) as tar,
            ):
                tar.addfile(_info(METADATA, len(meta_bytes)), io.BytesIO(meta_bytes))
                for name in MEMBER_ORDER[1:]:
                    if name in members:
                        src = Path(members[name])
                        with open(src, "rb") as f:
                            tar.addfile(_info(name, src.stat().st_size), f)
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    h = hashlib.sha256()
    with open(out, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _open(artifact: str | os.PathLike[str]) -> tarfile.TarFile:
    with open(artifact, "rb") as f:
        magic = f.read(2)
    if magic == b"PK":
        raise SealError(f"{artifact}: a bare AOTI .pt2 package, not a sealed artifact (seal it first)")
    if magic != b"\x1f\x8b":
        raise SealError(f"{artifact}: not a sealed artifact (no gzip header)")
    try:
        return tarfile.open(artifact, mode="r:gz")
    except tarfile.TarError as e:
        raise SealError(f"{artifact}: unreadable archive: {e}") from e


def _checked_members(tar: tarfile.TarFile, artifact: object) -> list[tarfile.TarInfo]:
    members = tar.getmembers()
    names = [m.name for m in members]
    expected = [n for n in MEMBER_ORDER if n in names]
    if names != expected or not names or names[0] != METADATA or PACKAGE not in names:
        raise SealError(f"{artifact}: members {names}, expected {list(MEMBER_ORDER)} in that order")
    for m in members:
        if not m.isreg():
            raise SealError(f"{artifact}: member {m.name} is not a regular file")
    return members


def read_metadata(artifact: str | os.PathLike[str]) -> dict[str, Any]:
    """The sealed metadata, read from the first member only (the package is not decompressed;
    the closed member list is checked by `unseal`)."""
    with _open(artifact) as tar:
        first = tar.next()
        if first is None or first.name != METADATA or not first.isreg():
            raise SealError(f"{artifact}: the first member must be {METADATA}")
        if first.size > _MAX_METADATA:
            raise SealError(f"{artifact}: metadata.json is {first.size} bytes")
        f = tar.extractfile(first)
        assert f is not None
        return json.loads(f.read())


def unseal(artifact: str | os.PathLike[str], dest: str | os.PathLike[str]) -> dict[str, Path]:
    """Unpack into `dest` (created); return member name → path."""
    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    with _open(artifact) as tar:
        members = _checked_members(tar, artifact)
        tar.extractall(out, members=members, filter="data")
    return {m.name: out / m.name for m in members}


def member_digests(artifact: str | os.PathLike[str]) -> dict[str, str]:
    """sha256 per member, and per entry inside the AOTI package (`model.pt2!<entry>`).

    The package's top-level folder is stripped from entry names so two packages compare by
    content. Used to name what differs when two mints of one key are not byte-identical.
    """
    out: dict[str, str] = {}
    with _open(artifact) as tar:
        for m in _checked_members(tar, artifact):
            f = tar.extractfile(m)
            assert f is not None
            data = f.read()
            out[m.name] = hashlib.sha256(data).hexdigest()
            if m.name == PACKAGE:
                with zipfile.ZipFile(io.BytesIO(data)) as z:
                    for entry in z.infolist():
                        rel = entry.filename.split("/", 1)[-1]
                        out[f"{PACKAGE}!{rel}"] = hashlib.sha256(z.read(entry)).hexdigest()
    return out


def diff_artifacts(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> list[str]:
    """Names of members (and package entries) whose bytes differ or exist on one side only."""
    da, db = member_digests(a), member_digests(b)
    return sorted(name for name in da.keys() | db.keys() if da.get(name) != db.get(name))


def _field_changes(a: Any, b: Any, path: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [
            c for k in sorted(a.keys() | b.keys()) for c in _field_changes(a.get(k), b.get(k), f"{path}.{k}")
        ]
    return [] if a == b else [path.lstrip(".")]


def compare_artifacts(recorded: str | os.PathLike[str], now: str | os.PathLike[str]) -> dict[str, Any]:
    """Two mints of one key: is the BUILD reproducible, and did the measured lane verdict move?

    The lane verdict is the one sealed fact that comes from timings: near the tie band's edge
    noise moves it (docs/lanes.md), which says nothing about the compile. So a difference confined to
    `lanes.verdict` keeps `reproducible` true and is reported under `verdict_moved`.
    """
    differing = diff_artifacts(recorded, now)
    fields: list[str] = []
    moved = None
    if METADATA in differing:
        ma, mb = read_metadata(recorded), read_metadata(now)
        fields = _field_changes(ma, mb, "")
        va, vb = (m.get("lanes", {}).get("verdict") for m in (ma, mb))
        if va != vb:
            moved = {"recorded": va, "now": vb}
    timed = [f for f in fields if f == "lanes.verdict" or f.startswith("lanes.verdict.")]
    build = [m for m in differing if m != METADATA] + [f for f in fields if f not in timed]
    return {"reproducible": not build, "differing": differing, "fields": fields, "verdict_moved": moved}
