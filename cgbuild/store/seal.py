"""Sealed artifacts: a deterministic tar.gz of `metadata.json`, the AOTI package, and literals.

Same inputs give the same bytes, so the store's content digest of an artifact means "these
bytes" and two mints of one key can be compared byte for byte. What makes it deterministic:
a fixed member order, USTAR headers with mtime/uid/gid 0, empty user/group names and mode 0644,
canonical JSON for the metadata, and a gzip header with no file name and mtime 0 (gzip would
otherwise store the output path and the clock). The deflate stream itself depends on zlib's
version; that is a property of the sealing host, not of the artifact's identity.

Members are a closed list: unsealing refuses anything else, so an archive cannot write outside
its destination or smuggle a file the loader would pick up. Every archive is hostile until read:
the tar stream is decompressed through a byte budget, each member's size is checked against the
sizes `seal` records in the metadata (`sealed`) and the caps below before its data is read, and
every entry of the AOTI package's zip (names, types, count, unpacked bytes, CRC) is checked
before any loader sees it. A refusal is a `SealError` with a stable `code`.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import stat
import tarfile
import zipfile
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from cgbuild.core.canon import canonical_json
from cgbuild.core.codes import Code

METADATA = "metadata.json"
PACKAGE = "model.pt2"
LITERALS = "constants.safetensors"
MEMBER_ORDER = (METADATA, PACKAGE, LITERALS)
SEALED = "sealed"
"""The metadata field `seal` writes: each member's size and the package's entry count and
unpacked bytes, so a reader caps what it unpacks before unpacking it."""
MAX_MEMBER_BYTES = {METADATA: 8 << 20, PACKAGE: 1 << 30, LITERALS: 1 << 30}
MAX_PACKAGE_ENTRIES = 4096
MAX_PACKAGE_BYTES = 1 << 30
_TAR_SLACK = 64 << 10  # headers, padding and end blocks beyond the members' own bytes


class SealError(Exception):
    """An archive is not a well-formed sealed artifact (or cannot be made into one).

    `code`: `bad-archive` (not gzip, truncated, unreadable), `bad-member` (a tar member outside
    the closed list, out of order, or not a regular file), `bad-package` (a zip entry of the
    package: its name, type, duplicates, CRC), `too-large` (over a cap or the sealed sizes),
    `bad-metadata` (not a JSON object, or a malformed `sealed` block).
    """

    def __init__(self, detail: str, code: Code = Code.BAD_ARCHIVE) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


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
    The metadata gains `sealed` (member sizes, the package's entry count and unpacked bytes),
    and the package is checked as `unseal` will check it: what seals, unseals.
    """
    unknown = set(members) - set(MEMBER_ORDER[1:])
    if unknown:
        raise SealError(f"unknown members {sorted(unknown)}; a sealed artifact holds {list(MEMBER_ORDER)}")
    if PACKAGE not in members:
        raise SealError(f"{PACKAGE} is required")
    sizes = {name: Path(members[name]).stat().st_size for name in MEMBER_ORDER[1:] if name in members}
    for name, size in sizes.items():
        if size > MAX_MEMBER_BYTES[name]:
            raise SealError(
                f"{name} is {size} bytes, over the cap of {MAX_MEMBER_BYTES[name]}", Code.TOO_LARGE
            )
    entries, unpacked = check_package(members[PACKAGE])
    record = {"members": sizes, "package": {"entries": entries, "bytes": unpacked}}
    meta_bytes = (canonical_json({**metadata, SEALED: record}) + "\n").encode("ascii")
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
                        with open(members[name], "rb") as f:
                            tar.addfile(_info(name, sizes[name]), f)
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


# ---- reading: every layer checked before it is unpacked ----------------------------------------
class _Budget(io.RawIOBase):
    """The decompressed tar stream, refused past `limit` bytes: a gzip bomb stops there."""

    def __init__(self, inner: io.BufferedIOBase, limit: int, artifact: object) -> None:
        self.inner, self.limit, self.used, self.artifact = inner, limit, 0, artifact

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        want = min(len(b), self.limit - self.used + 1)
        data = self.inner.read(want)
        self.used += len(data)
        if self.used > self.limit:
            raise SealError(f"{self.artifact}: unpacks past {self.limit} bytes", Code.TOO_LARGE)
        b[: len(data)] = data
        return len(data)


def _entry_problem(name: str) -> str | None:
    """Why a zip entry name could land anywhere but inside the folder it is unpacked into."""
    if not name or name.startswith("/") or "\\" in name or any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "absolute, empty, or holding a backslash or control character"
    parts = name.removesuffix("/").split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "a '.', '..' or empty path component"
    if len(parts[0]) >= 2 and parts[0][1] == ":":
        return "a drive letter"
    return None


def check_package(
    pt2: str | os.PathLike[str] | IO[bytes], recorded: Mapping[str, Any] | None = None
) -> tuple[int, int]:
    """Check every entry of an AOTI package's zip before anything unpacks it; return (entries,
    unpacked bytes).

    Refused: a name that is absolute or climbs out (`..`), entries outside one top-level folder,
    duplicates, links, devices and other non-regular types, encryption, more than
    `MAX_PACKAGE_ENTRIES` entries or `MAX_PACKAGE_BYTES` unpacked, counts that differ from the
    sealed record, and bytes that do not match their CRC or their recorded size (every entry
    is read once, through zipfile, which also refuses a local header naming another file).
    """
    try:
        with zipfile.ZipFile(pt2) as z:
            infos = z.infolist()
            if not infos:
                raise SealError(f"{PACKAGE}: an empty package", Code.BAD_PACKAGE)
            if len(infos) > MAX_PACKAGE_ENTRIES:
                raise SealError(
                    f"{PACKAGE}: {len(infos)} entries, over {MAX_PACKAGE_ENTRIES}", Code.TOO_LARGE
                )
            total = sum(i.file_size for i in infos)
            if total > MAX_PACKAGE_BYTES:
                raise SealError(
                    f"{PACKAGE}: unpacks to {total} bytes, over {MAX_PACKAGE_BYTES}", Code.TOO_LARGE
                )
            if recorded is not None and (recorded.get("entries"), recorded.get("bytes")) != (
                len(infos),
                total,
            ):
                raise SealError(
                    f"{PACKAGE}: {len(infos)} entries of {total} bytes, sealed as "
                    f"{recorded.get('entries')} of {recorded.get('bytes')}",
                    Code.TOO_LARGE,
                )
            tops: set[str] = set()
            seen: set[str] = set()
            for info in infos:
                name = info.filename
                why = _entry_problem(name)
                if why is None and name in seen:
                    why = "a duplicate"
                mode = info.external_attr >> 16
                kind = stat.S_IFMT(mode)
                if why is None and kind not in (0, stat.S_IFREG, stat.S_IFDIR):
                    why = f"not a regular file (mode {oct(mode)})"
                if why is None and info.flag_bits & 0x1:
                    why = "encrypted"
                if why is not None:
                    raise SealError(f"{PACKAGE}: entry {name!r}: {why}", Code.BAD_PACKAGE)
                seen.add(name)
                tops.add(name.split("/", 1)[0])
            if len(tops) != 1:
                raise SealError(
                    f"{PACKAGE}: entries under {sorted(tops)[:3]}, not one folder", Code.BAD_PACKAGE
                )
            for info in infos:
                read = 0
                with z.open(info) as f:
                    while block := f.read(1 << 20):
                        read += len(block)
                if read != info.file_size:
                    raise SealError(
                        f"{PACKAGE}: entry {info.filename!r} is not its recorded size", Code.BAD_PACKAGE
                    )
            return len(infos), total
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, zlib.error, NotImplementedError) as e:
        raise SealError(f"{PACKAGE}: unreadable package: {e}", Code.BAD_PACKAGE) from e


def _recorded(meta: Any, artifact: object) -> dict[str, Any] | None:
    """The metadata's `sealed` block, checked; None for an artifact sealed before it existed
    (its tar headers are then checked against the caps alone)."""
    if not isinstance(meta, dict):
        raise SealError(f"{artifact}: {METADATA} is not a JSON object", Code.BAD_METADATA)
    block = meta.get(SEALED)
    if block is None:
        return None
    sizes = block.get("members") if isinstance(block, dict) else None
    package = block.get("package") if isinstance(block, dict) else None
    if not (
        isinstance(block, dict)
        and isinstance(sizes, dict)
        and isinstance(package, dict)
        and PACKAGE in sizes
        and set(sizes) <= set(MEMBER_ORDER[1:])
        and all(
            type(v) is int and v >= 0 for v in (*sizes.values(), package.get("entries"), package.get("bytes"))
        )
    ):
        raise SealError(f"{artifact}: malformed '{SEALED}' block in {METADATA}", Code.BAD_METADATA)
    for name, size in sizes.items():
        if size > MAX_MEMBER_BYTES[name]:
            raise SealError(
                f"{artifact}: {name} is sealed as {size} bytes, over {MAX_MEMBER_BYTES[name]}", Code.TOO_LARGE
            )
    if package["entries"] > MAX_PACKAGE_ENTRIES or package["bytes"] > MAX_PACKAGE_BYTES:
        raise SealError(f"{artifact}: the package is sealed over the caps ({package})", Code.TOO_LARGE)
    return block


@contextlib.contextmanager
def _stream(artifact: str | os.PathLike[str]) -> Iterator[tuple[tarfile.TarFile, _Budget]]:
    """The archive as a forward-only tar stream behind a byte budget; read errors are SealErrors."""
    with open(artifact, "rb") as raw:
        magic = raw.read(2)
        if magic == b"PK":
            raise SealError(f"{artifact}: a bare AOTI .pt2 package, not a sealed artifact (seal it first)")
        if magic != b"\x1f\x8b":
            raise SealError(f"{artifact}: not a sealed artifact (no gzip header)")
        raw.seek(0)
        budget = _Budget(
            gzip.GzipFile(fileobj=raw, mode="rb"), MAX_MEMBER_BYTES[METADATA] + _TAR_SLACK, artifact
        )
        try:
            with tarfile.open(fileobj=budget, mode="r|") as tar:
                yield tar, budget
        except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise SealError(f"{artifact}: unreadable archive: {type(e).__name__}: {e}") from e


def _members(
    tar: tarfile.TarFile, budget: _Budget, artifact: object
) -> Iterator[tuple[str, IO[bytes], dict[str, Any] | None]]:
    """Each member in order as (name, data, the sealed record), every header checked before its
    data is read: closed names in order, regular files, sizes within the record and the caps."""
    order = list(MEMBER_ORDER)
    recorded: dict[str, Any] | None = None
    names: list[str] = []
    for m in tar:
        names.append(m.name)
        if m.name not in order or (not names[:-1] and m.name != METADATA):
            raise SealError(
                f"{artifact}: members {names}, expected {list(MEMBER_ORDER)} in that order", Code.BAD_MEMBER
            )
        order = order[order.index(m.name) + 1 :]
        if not m.isreg() or m.pax_headers:
            raise SealError(f"{artifact}: member {m.name} is not a plain regular file", Code.BAD_MEMBER)
        want = MAX_MEMBER_BYTES[m.name]
        if recorded is not None:
            want = recorded["members"].get(m.name, -1)
            if m.size != want:
                raise SealError(
                    f"{artifact}: member {m.name} is {m.size} bytes, sealed as {want}", Code.TOO_LARGE
                )
        elif m.size > want:
            raise SealError(
                f"{artifact}: member {m.name} is {m.size} bytes, over the cap of {want}", Code.TOO_LARGE
            )
        f = tar.extractfile(m)
        assert f is not None
        if m.name == METADATA:
            data = f.read()
            recorded = _recorded(_parse_metadata(data, artifact), artifact)
            # nothing precedes the metadata; after it, no more than the sealed sizes (or the caps)
            rest = (
                recorded["members"].values() if recorded else (MAX_MEMBER_BYTES[n] for n in MEMBER_ORDER[1:])
            )
            budget.limit = budget.used + sum(rest) + _TAR_SLACK
            yield m.name, io.BytesIO(data), recorded
            continue
        yield m.name, f, recorded
    if PACKAGE not in names:
        raise SealError(
            f"{artifact}: members {names}, expected {list(MEMBER_ORDER)} in that order", Code.BAD_MEMBER
        )
    if recorded is not None and set(recorded["members"]) - set(names):
        raise SealError(
            f"{artifact}: sealed members {sorted(recorded['members'])}, found {names}", Code.BAD_MEMBER
        )


def _parse_metadata(data: bytes, artifact: object) -> dict[str, Any]:
    try:
        meta = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise SealError(f"{artifact}: {METADATA} is not JSON: {e}", Code.BAD_METADATA) from e
    if not isinstance(meta, dict):
        raise SealError(f"{artifact}: {METADATA} is not a JSON object", Code.BAD_METADATA)
    return meta


def read_metadata(artifact: str | os.PathLike[str]) -> dict[str, Any]:
    """The sealed metadata, read from the first member only (the package is not decompressed;
    the rest is checked by `unseal`)."""
    with _stream(artifact) as (tar, budget):
        for _, f, _ in _members(tar, budget, artifact):
            return _parse_metadata(f.read(), artifact)
    raise SealError(f"{artifact}: an empty archive", Code.BAD_MEMBER)


def unseal(artifact: str | os.PathLike[str], dest: str | os.PathLike[str]) -> dict[str, Path]:
    """Unpack into `dest` (created); return member name → path.

    Each member is written by this function to its own fixed name (no tar extraction), and the
    package's zip is checked entry by entry (`check_package`) before it is returned.
    """
    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    recorded: dict[str, Any] | None = None
    with _stream(artifact) as (tar, budget):
        for name, f, sealed in _members(tar, budget, artifact):
            recorded = sealed
            path = out / name
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as w:
                while block := f.read(1 << 20):
                    w.write(block)
            files[name] = path
    check_package(files[PACKAGE], recorded["package"] if recorded else None)
    return files


def member_digests(artifact: str | os.PathLike[str]) -> dict[str, str]:
    """sha256 per member, and per entry inside the AOTI package (`model.pt2!<entry>`).

    The package's top-level folder is stripped from entry names so two packages compare by
    content. Used to name what differs when two mints of one key are not byte-identical.
    """
    out: dict[str, str] = {}
    with _stream(artifact) as (tar, budget):
        for name, f, recorded in _members(tar, budget, artifact):
            data = f.read()
            out[name] = hashlib.sha256(data).hexdigest()
            if name == PACKAGE:
                check_package(io.BytesIO(data), recorded["package"] if recorded else None)
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
