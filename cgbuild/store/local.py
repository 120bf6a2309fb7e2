"""The embedded local store: content-addressed objects, one ref per key, mint-once, quarantine.

Layout under the store root::

    objects/sha256/<aa>/<rest>        immutable object files (mode 0444), named by their sha256
    refs/<key[:2]>/<key>.json         {"schema": "cgbuild.ref/1", "key", "object", "size", "metadata"}
    quarantine/<key>.json             why a key's artifact was pulled, plus the ref it had
    quarantine/objects/<sha256>       the pulled object, kept for forensics
    tmp/                              writers' temporaries (swept by gc)
    evidence/<key>/<host>.json        lane evidence: raw timings per mint, beside the artifact
    lock                              flock: shared for admission, exclusive for gc and quarantine

Why it is built this way:

- Crash safety. Every file is written to `tmp/`, fsynced, then installed with `os.link`, which
  never clobbers, and the directory is fsynced. A reader therefore sees a whole object or none, and
  an object is durable before the ref that names it exists: a kill -9 at any point leaves at most
  a stray temp or an unreferenced object (both swept by gc), never a torn object or a ref without
  its object.
- Mint-once without a lock between writers. The ref is created by `os.link(temp, ref)`: exactly
  one concurrent writer of a key gets the link, the others get EEXIST and read the winner's ref:
  same object → `already`, different object → `conflict`. An admitted key is never overwritten;
  it is retired only by quarantine (corruption), repaired only by a new verified admission.
- Refs change in two ways only: created by link while absent, removed by quarantine or gc under
  the exclusive lock. Holding the exclusive lock therefore freezes every existing ref, so
  quarantine and gc can judge and act without a race; admissions take the lock shared so gc never
  deletes an object between its install and its ref.
- Cost. `ref_state` is what `plan` asks for every target: one small read of the ref and one
  `stat` of the object (present, recorded size). It never hashes: a flipped byte inside an object
  is found by `verify`/`resolve(verify=True)`, which re-hash and quarantine on mismatch.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any, BinaryIO, cast

from cgbuild.core import fs
from cgbuild.core.canon import NotCanonical, canonical_json, file_digest
from cgbuild.core.codes import Code
from cgbuild.store import refs
from cgbuild.store.errors import (
    Corrupt,
    DiskFull,
    MalformedRef,
    Missing,
    Quarantined,
    StoreError,
)
from cgbuild.store.records import Admission, GCReport, Ref, Resolved, Verdict
from cgbuild.store.refs import REF_SCHEMA, RefState

QUARANTINE_SCHEMA = "cgbuild.quarantine/1"
_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,199}$")
_HOST_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}$")
EVIDENCE_SCHEMA = "cgbuild.lane-evidence/1"
_CHUNK = 1 << 20


def validated_key(key: str) -> str:
    """Keys name files: refuse anything that could escape `refs/` or hide as a dotfile."""
    if not isinstance(key, str) or not _KEY_RE.match(key):
        raise StoreError(key if isinstance(key, str) else None, f"not a valid key: {key!r}")
    return key


class Store:
    """A local store rooted at `root` (created on first use). Safe for concurrent processes."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._root_s = os.fspath(self.root)
        self._lock_path = self.root / "lock"
        self._laid_out = False

    def ensure_layout(self) -> None:
        """Create the folders and the lock on the first write: a reader (plan, verify of a
        read-only store, adopt) never creates or locks anything."""
        if not self._laid_out:
            for sub in ("objects/sha256", "refs", "quarantine/objects", "tmp"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
            self._lock_path.touch(exist_ok=True)
            self._laid_out = True

    # ---- paths -------------------------------------------------------------------------------
    def object_path(self, sha: str) -> Path:
        return self.root / "objects" / "sha256" / sha[:2] / sha[2:]

    def ref_path(self, key: str) -> Path:
        return self.root / "refs" / key[:2] / f"{key}.json"

    def quarantine_path(self, key: str) -> Path:
        return self.root / "quarantine" / f"{key}.json"

    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        try:
            self.ensure_layout()
            fd = os.open(self._lock_path, os.O_RDWR)
        except OSError as exc:  # `lock` a folder, a store this user cannot write
            raise StoreError(
                None,
                f"cannot lock the store: {exc.filename or self._lock_path}: {exc.strerror}; its lock "
                "must be a regular file in a folder this user can write: move aside what is there "
                "(the store lays itself out again on its next write)",
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # closing releases the flock; so does the death of the process

    def prove_writable(self) -> None:
        """Lay out and lock the store once, as a write does: `StoreError` where it cannot."""
        with self._locked(exclusive=False):
            pass

    def temp_dir(self) -> Path:
        """The store's own temp folder, for a writer that fills a file before admitting it (a
        pull): laid out on first use like every write."""
        self.ensure_layout()
        return self.root / "tmp"

    def _temp(self) -> tuple[Path, BinaryIO]:
        self.ensure_layout()
        path = self.root / "tmp" / f"{os.getpid()}-{secrets.token_hex(8)}.tmp"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        return path, os.fdopen(fd, "wb")

    # ---- writing -----------------------------------------------------------------------------
    def _install_object(self, src: Path, expected_sha: str | None, *, owned: bool = False) -> tuple[str, int]:
        """Copy `src` into the store; return (sha256, size). Idempotent for identical content.
        An `owned` `src` is linked in instead (`_link_owned`)."""
        if owned:
            return self._link_owned(src, expected_sha)
        tmp, out = self._temp()
        try:
            h = hashlib.sha256()
            size = 0
            with out, open(src, "rb") as f:
                while block := f.read(_CHUNK):
                    h.update(block)
                    out.write(block)
                    size += len(block)
                out.flush()
                os.fsync(out.fileno())
            sha = h.hexdigest()
            if expected_sha is not None and sha != expected_sha:
                raise StoreError(None, f"{src}: sha256 {sha} is not the expected {expected_sha}")
            # Verify on admission: re-read what is on disk, not what we meant to write.
            if file_digest(tmp) != (sha, size):
                raise StoreError(None, f"{src}: the written copy does not hash back to {sha}")
            os.chmod(tmp, 0o444)
            self._place(tmp, sha, size)
            return sha, size
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def _link_owned(self, src: Path, expected_sha: str | None) -> tuple[str, int]:
        """Link `src`, a file in this store's temp folder that its writer hands over (a pull's
        download), into place without copying it: synced, then re-read and hashed where it lies,
        as a copy would be. The caller keeps and removes `src`, so a retried admission links it
        again. Anything outside that folder is refused: it would be made read-only and shared."""
        if src.resolve().parent != self.temp_dir().resolve():
            raise StoreError(None, f"{src}: an owned admission takes a file of {self.temp_dir()} only")
        with open(src, "rb") as f:
            os.fsync(f.fileno())
        sha, size = file_digest(src)
        if expected_sha is not None and sha != expected_sha:
            raise StoreError(None, f"{src}: sha256 {sha} is not the expected {expected_sha}")
        os.chmod(src, 0o444)
        self._place(src, sha, size)
        return sha, size

    def _place(self, src: Path, sha: str, size: int) -> None:
        """Link verified `src` in as object `sha`; a resident that does not hash to it is
        replaced (a corrupt resident repaired by verified bytes), atomically."""
        dest = self.object_path(sha)
        dest.parent.mkdir(exist_ok=True)
        try:
            os.link(src, dest)
        except FileExistsError:
            if file_digest(dest) != (sha, size):
                repair = self.root / "tmp" / f"{os.getpid()}-{secrets.token_hex(8)}.repair"
                os.link(src, repair)
                os.replace(repair, dest)
        fs.fsync_dir(dest.parent)

    def _write_new(self, dest: Path, data: bytes) -> bool:
        """Create `dest` with `data` unless it exists (no clobber). True when this call created it."""
        tmp, out = self._temp()
        try:
            with out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            dest.parent.mkdir(exist_ok=True)
            try:
                os.link(tmp, dest)
            except FileExistsError:
                return False
            fs.fsync_dir(dest.parent)
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def admit(
        self,
        key: str,
        artifact: str | os.PathLike[str],
        *,
        metadata: dict[str, Any] | None = None,
        expected_sha256: str | None = None,
        owned: bool = False,
    ) -> Admission:
        """Admit `artifact` as the one artifact of `key` (mint-once: first writer wins).

        `metadata` is a small canonical-JSON summary kept in the ref for listings (never the
        sealed metadata itself). A different object for an admitted key is refused as
        `conflict`, never overwritten. A key whose ref has lost its object (or that was
        quarantined) is repaired by this admission. `owned`: `artifact` lies in `temp_dir()`
        and nobody else writes it, so it is linked in, not copied (it stays the caller's to
        remove).
        """
        validated_key(key)
        summary = dict(metadata or {})
        try:
            canonical_json(summary)  # refuse floats and foreign types before touching the disk
        except NotCanonical as e:
            raise StoreError(key, f"ref metadata: {e}") from e
        for _ in range(3):
            try:
                with self._locked(exclusive=False):
                    sha, size = self._install_object(Path(artifact), expected_sha256, owned=owned)
                    ref = Ref(key, sha, size, summary)
                    if self._write_new(self.ref_path(key), (canonical_json(ref.to_json()) + "\n").encode()):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(self.quarantine_path(key))  # repaired by a verified admission
                        return Admission("admitted", key, sha, size)
                    standing = self.read_ref(key)
            except MalformedRef as e:
                self.heal(key, e)  # a ref that is no ref stands in nobody's way: retire it, retry
                continue
            except OSError as e:
                # temps are removed on the way out and the ref is the last thing written, so a
                # refused write leaves at most an unreferenced object (swept by gc)
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise DiskFull(key, f"no space left in the store at admission: {e}") from e
                raise StoreError(key, f"the store refused a write at admission: {e}") from e
            if standing is None:
                continue  # removed by gc/quarantine between our link and our read: try again
            if self._object_intact_stat(standing):
                if standing.object == sha:
                    return Admission("already", key, sha, size)
                if (why := self.crossed(standing)) is not None:  # it stands in nobody's way
                    self._quarantine(key, standing, f"key-mismatch: {why}")
                    continue
                return Admission("conflict", key, sha, size, existing=standing.object)
            # The standing ref names an object that is gone or truncated: retire it, then retry.
            self._quarantine(key, standing, "object missing or truncated at admission")
        raise StoreError(key, "admission kept racing with removals; giving up")

    # ---- reading -----------------------------------------------------------------------------
    def read_ref(self, key: str) -> Ref | None:
        """The key's ref, or None. Never blocks and never hashes."""
        path = self.ref_path(validated_key(key))
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            raise MalformedRef(key, f"ref {path} is a folder") from None
        why = refs.raw_problem(raw, key, REF_SCHEMA)
        if why:
            raise MalformedRef(key, f"ref {path}: {why}")
        doc = json.loads(raw)
        return Ref(doc["key"], doc["object"], doc["size"], doc.get("metadata") or {})

    def _object_intact_stat(self, ref: Ref) -> bool:
        try:
            return self.object_path(ref.object).stat().st_size == ref.size
        except FileNotFoundError:
            return False

    def ref_state(self, key: str) -> RefState:
        """`fresh` | `missing` | `quarantined`, cheaply: one small read and one or two stats.

        `fresh` means a ref exists and its object exists with the recorded size. It does not
        re-hash (plan asks this for every target); `resolve(verify=True)` and `verify` do.
        A ref whose object vanished reads `missing` (the key must be minted again).
        """
        # Plain strings, not pathlib: this runs 10,000 times in a warm plan, and pathlib was
        # two thirds of its cost.
        root = self._root_s
        try:
            with open(f"{root}/refs/{key[:2]}/{validated_key(key)}.json", "rb") as f:
                doc = json.loads(f.read())
        except FileNotFoundError:
            doc = None
        except (OSError, ValueError):
            return RefState.MALFORMED  # a folder, bytes that are not JSON
        if doc is not None:
            if refs.doc_problem(doc, key, REF_SCHEMA) is not None:
                return RefState.MALFORMED  # the one check read_ref makes: never `missing` for a crafted ref
            sha, size = doc["object"], doc["size"]
            with contextlib.suppress(OSError):
                if os.stat(f"{root}/objects/sha256/{sha[:2]}/{sha[2:]}").st_size == size:
                    return RefState.FRESH
        return RefState.QUARANTINED if os.path.exists(f"{root}/quarantine/{key}.json") else RefState.MISSING

    def iter_refs(self) -> Iterator[Ref]:
        """Every ref, in key order."""
        for key in self.ref_keys():
            with contextlib.suppress(MalformedRef):
                ref = self.read_ref(key)
                if ref is not None:
                    yield ref

    def ref_keys(self) -> list[str]:
        """The key of every ref file, well-formed or not, in key order."""
        names = (p.name[: -len(".json")] for p in (self.root / "refs").glob("*/*.json"))
        return sorted(k for k in names if _KEY_RE.match(k))

    def quarantine_record(self, key: str) -> dict[str, Any] | None:
        try:
            return cast(dict[str, Any], json.loads(self.quarantine_path(validated_key(key)).read_bytes()))
        except FileNotFoundError:
            return None

    def resolve(self, key: str, *, verify: bool = True) -> Resolved:
        """The key's artifact. With `verify` (the default) the object is re-hashed; a mismatch
        quarantines the key and raises `Corrupt`. Raises `Missing` / `Quarantined` otherwise."""
        ref = self.read_ref(key)
        if ref is None:
            record = self.quarantine_record(key)
            if record is not None:
                raise Quarantined(key, f"quarantined: {record.get('reason')}")
            raise Missing(key, "no artifact in the store")
        path = self.object_path(ref.object)
        if not self._object_intact_stat(ref):
            raise Missing(key, f"ref names object {ref.object[:12]} which is missing or truncated")
        if verify:
            found, size = file_digest(path)
            if (found, size) != (ref.object, ref.size):
                try:
                    self._quarantine(key, ref, f"object hashes to {found}, not {ref.object}")
                    done = "quarantined"
                except OSError as e:  # a read-only store: reported, left for a writer
                    done = f"not quarantined ({e.strerror or e})"
                raise Corrupt(key, f"object {ref.object[:12]} hashes to {found[:12]}: {done}")
        return Resolved(ref, path)

    def verify(self, key: str) -> Verdict:
        """Re-hash one key's object; corruption quarantines it."""
        try:
            self.resolve(key, verify=True)
        except MalformedRef as e:
            try:
                self.heal(key, e)
                done = "quarantined"
            except OSError as err:  # a read-only store: reported, left for a writer
                done = f"not quarantined ({err.strerror or err})"
            return Verdict(key, Code.MALFORMED_REF, f"{e.detail}: {done}")
        except StoreError as e:
            return Verdict(key, e.code, e.detail)
        return Verdict(key, "ok")

    def sealed_problem(self, ref: Ref) -> tuple[Code, str] | None:
        """Why `ref`'s object is not its key's sealed artifact: (`key-mismatch`, why) when its
        sealed metadata names another key, (the seal's code, why) when it is no sealed artifact,
        (`bad-metadata`, why) when its metadata is not what adopt and `inspect` read (the one
        check, `cgbuild.store.metadata`); None when it is the key's own. Reads the metadata
        member only (no package is unpacked)."""
        from cgbuild.store.metadata import metadata_problem
        from cgbuild.store.seal import SealError, read_metadata

        try:
            meta = read_metadata(self.object_path(ref.object))
        except SealError as e:
            return e.code, e.detail
        other = meta.get("key")
        if other != ref.key:
            return Code.KEY_MISMATCH, f"its object's sealed metadata names key {str(other)[:16]!r}"
        if problem := metadata_problem(meta):
            return Code.BAD_METADATA, f"its sealed metadata: {problem}"
        return None

    def crossed(self, ref: Ref) -> str | None:
        """Why `ref` names another key's sealed artifact, or None. Unlike `sealed_problem` it
        passes bytes that are no sealed artifact: admission and gc also serve stores of other
        blobs, and adopt judges those."""
        problem = self.sealed_problem(ref)
        return problem[1] if problem is not None and problem[0] == Code.KEY_MISMATCH else None

    def check_sealed_key(self, key: str) -> Verdict | None:
        """After a clean re-hash: quarantine a ref whose object is not this key's sealed artifact
        (`sealed_problem`), with that reason, since adopt would refuse it forever while
        `ref_state` says fresh. None when the object is this key's own."""
        ref = self.read_ref(key)
        if ref is None or (problem := self.sealed_problem(ref)) is None:
            return None
        code, why = problem
        try:
            self._quarantine(key, ref, f"{code}: {why}")
            done = "quarantined"
        except OSError as e:  # a read-only store: reported, left for a writer
            done = f"not quarantined ({e.strerror or e})"
        return Verdict(key, code, f"{why}: {done}")

    def verify_all(self) -> list[Verdict]:
        """Verify every ref, and every object against its own name (quarantining bad ones)."""
        verdicts = [self.verify(key) for key in self.ref_keys()]
        for obj in sorted((self.root / "objects" / "sha256").glob("*/*")):
            sha = obj.parent.name + obj.name
            if refs.SHA_RE.match(sha) and file_digest(obj)[0] != sha:
                with self._locked(exclusive=True):
                    self._move_to_quarantine(sha)
                verdicts.append(Verdict(f"object:{sha}", "corrupt", "object bytes do not match its name"))
        return verdicts

    # ---- retiring ----------------------------------------------------------------------------
    def _move_to_quarantine(self, sha: str) -> None:
        src = self.object_path(sha)
        with contextlib.suppress(FileNotFoundError):
            os.replace(src, self.root / "quarantine" / "objects" / sha)
            fs.fsync_dir(src.parent)

    def _quarantine(self, key: str, seen: Ref, reason: str) -> None:
        """Pull `key`'s artifact: record why, move the object aside, drop the ref.

        Runs under the exclusive lock and acts only if the ref is still the one judged, so a
        racing repair that already replaced it is left alone.
        """
        with self._locked(exclusive=True):
            self._quarantine_locked(key, seen, reason)

    def _quarantine_locked(self, key: str, seen: Ref, reason: str) -> None:
        """`_quarantine`'s work, for a caller already holding the exclusive lock (gc)."""
        if self.read_ref(key) != seen:
            return
        record = {"schema": QUARANTINE_SCHEMA, "key": key, "reason": reason, "ref": seen.to_json()}
        fs.write_atomic(self.quarantine_path(key), canonical_json(record) + "\n")
        obj = self.object_path(seen.object)
        if not self._object_intact_stat(seen) or file_digest(obj)[0] != seen.object:
            self._move_to_quarantine(seen.object)
        os.unlink(self.ref_path(key))
        fs.fsync_dir(self.ref_path(key).parent)

    def heal(self, key: str, why: MalformedRef | None = None) -> str | None:
        """Quarantine `key`'s ref if it is malformed (a writer's duty; readers only report it):
        the record keeps the reason and the ref's first bytes, the ref goes, and the key reads
        `quarantined` until a new admission. Returns the reason, or None if the ref was sound."""
        if why is None:
            try:
                self.read_ref(key)
                return None
            except MalformedRef as e:
                why = e
        with self._locked(exclusive=True):
            self._retire_malformed(key, why.detail)
        return why.detail

    def _retire_malformed(self, key: str, reason: str) -> None:
        """Under the exclusive lock: record and remove a ref that is still malformed."""
        path = self.ref_path(key)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return
        except IsADirectoryError:
            raw = b"<a folder>"
        if not refs.raw_problem(raw, key, REF_SCHEMA) and not path.is_dir():
            return  # repaired meanwhile
        record = {
            "schema": QUARANTINE_SCHEMA,
            "key": key,
            "reason": f"malformed-ref: {reason}",
            "ref": None,
            "raw": raw[:2048].decode("ascii", "backslashreplace"),
        }
        fs.write_atomic(self.quarantine_path(key), canonical_json(record) + "\n")
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        fs.fsync_dir(path.parent)

    def retire(self, key: str, reason: str) -> None:
        """Quarantine a key for a reason found outside this store (e.g. a shared store holds
        another artifact for it): the same record, and the same repair by a new admission."""
        ref = self.read_ref(key)
        if ref is not None:
            self._quarantine(key, ref, reason)

    def gc(self, *, keep: Collection[str] | None = None, dry_run: bool = False) -> GCReport:
        """Collect by reachability: refs are the roots; objects no ref names are removed.

        With `keep`, refs whose key is not in it are dropped first (the caller's live set, e.g.
        the keys of a plan). Stray temps are swept. `dry_run` reports without removing.
        """
        report = GCReport(dry_run=dry_run)
        with self._locked(exclusive=True):
            live: set[str] = set()
            live_keys: set[str] = set()
            for key in self.ref_keys():
                try:
                    self.read_ref(key)
                except MalformedRef as e:
                    report.refs_quarantined.append(key)
                    if not dry_run:
                        self._retire_malformed(key, e.detail)
            for ref in list(self.iter_refs()):
                if keep is not None and ref.key not in keep:
                    report.refs_dropped.append(ref.key)
                    if not dry_run:
                        os.unlink(self.ref_path(ref.key))
                elif self._object_intact_stat(ref) and (why := self.crossed(ref)) is not None:
                    report.refs_quarantined.append(ref.key)  # another key's object: never a root
                    if not dry_run:
                        self._quarantine_locked(ref.key, ref, f"key-mismatch: {why}")
                else:
                    live.add(ref.object)
                    live_keys.add(ref.key)
            evidence = self.root / "evidence"
            for folder in sorted(evidence.iterdir()) if evidence.is_dir() else []:
                # raw lane timings explain an artifact; kept while a ref or a quarantine names it
                if folder.name in live_keys or self.quarantine_path(folder.name).exists():
                    continue
                report.evidence_removed.append(folder.name)
                if not dry_run:
                    shutil.rmtree(folder, ignore_errors=True)
            for obj in sorted((self.root / "objects" / "sha256").glob("*/*")):
                sha = obj.parent.name + obj.name
                if sha in live:
                    report.objects_kept += 1
                    continue
                report.objects_removed.append(sha)
                report.bytes_freed += obj.stat().st_size
                if not dry_run:
                    obj.unlink()
            for tmp in (self.root / "tmp").iterdir():
                report.temps_removed += 1
                if not dry_run:
                    with contextlib.suppress(FileNotFoundError):
                        tmp.unlink()
            if not dry_run:
                for d in (self.root / "objects" / "sha256").iterdir():
                    with contextlib.suppress(OSError):
                        d.rmdir()  # only empty fan-out dirs go
        return report

    # ---- lane evidence (beside the artifact, never inside it) ------------------------------------
    def evidence_path(self, key: str, host: str) -> Path:
        if not _HOST_RE.match(host):
            raise StoreError(key, f"not a valid evidence host name: {host!r}")
        return self.root / "evidence" / validated_key(key) / f"{host}.json"

    def add_evidence(self, key: str, host: str, run: dict[str, Any]) -> Path:
        """Append one measured run to `evidence/<key>/<host>.json` (accumulating, atomic).

        Lane evidence is raw measurement (timings, samples, the device): it explains a sealed
        verdict but is not part of the sealed bytes, so two mints still agree byte for byte.
        Writers of one file serialize on its lock; a reader sees the old file or the new one.
        """
        path = self.evidence_path(key, host)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            doc: dict[str, Any] = {"schema": EVIDENCE_SCHEMA, "key": key, "host": host, "runs": []}
            with contextlib.suppress(FileNotFoundError, ValueError):
                old = json.loads(path.read_text())
                if old.get("schema") == EVIDENCE_SCHEMA:
                    doc = old
            doc["runs"].append(run)
            fs.write_json(path, doc, indent=1)
        finally:
            os.close(fd)
        return path

    def read_evidence(self, key: str) -> dict[str, dict[str, Any]]:
        """host → that host's evidence document for `key` (empty when none was recorded)."""
        folder = self.root / "evidence" / validated_key(key)
        out: dict[str, dict[str, Any]] = {}
        for p in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            with contextlib.suppress(ValueError, OSError):
                out[p.stem] = json.loads(p.read_text())
        return out
