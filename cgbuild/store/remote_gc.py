"""`cgbuild gc --remote`: sweep shared-store objects no ref names, safe against racing publishes.

Roots are every remote ref (whoever signed it: workspaces sharing a prefix may trust other
publishers) and the keys of plans the caller pins. Only `objects/sha256/` is swept; refs,
quarantine records, evidence, facts and probe objects are left alone. The order of the steps,
and the publish side they pair with (`SharedStore.publish`), is argued in docs/store.md,
"Remote gc and the publish race":

1. mark: list `refs/`, read each ref, collect the objects they name;
2. choose: list `objects/sha256/`; an unmarked object whose last-modified is older than the
   grace on the store's own clock is a candidate, and its stamp (last-modified, ETag, touched
   tag) is read;
3. re-mark: list and read the refs again; a candidate a ref now names is kept;
4. delete: per candidate, its stamp again: changed (a publish touched it) → kept; else a delete
   conditional on the ETag;
5. re-check: list and read the refs once more; a ref naming an object step 4 deleted (a publish
   that completed inside step 4) whose object is still absent is quarantined, so no ref is left
   naming nothing and the publisher's next mint republishes it from its cache;
6. uploads: incomplete multipart uploads under `objects/sha256/` initiated longer ago than the
   grace, on the store's clock, are aborted. An upload is no object, so no ref can name one (a ref
   is written only after its object is complete) and none is a root.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cgbuild.store.s3 import RemoteRef

if TYPE_CHECKING:
    from cgbuild.store.shared import SharedStore

_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
READERS = 8  # concurrent ref reads: within botocore's default pool of 10 connections
DEFAULT_GRACE_S = 86400
"""Objects younger than this are never swept: longer than any publish between its upload (or
touch) and its ref, so the re-checks of steps 3–5 are what races hit, not the common case."""

Hook = Callable[[str, str | None], None]
"""Test seam: called with ("chosen", None) after step 2, ("deleting", sha) between the last look
at an object and its delete, and ("deleted", None) before step 5, so a racing publish can be
driven deterministically."""


@dataclass
class RemoteGC:
    dry_run: bool
    grace_s: float
    refs: int = 0
    objects_kept: int = 0
    removed: list[str] = field(default_factory=list)
    """Objects deleted (or, dry, that would be)."""
    kept_young: int = 0
    kept_rescued: list[str] = field(default_factory=list)
    """Candidates a ref named by step 3, or that a publish touched by step 4."""
    unreadable_refs: list[str] = field(default_factory=list)
    """Refs that are not a ref document naming an object: they name nothing (a pull refuses them)."""
    foreign: list[str] = field(default_factory=list)
    """Names under objects/sha256/ that are no sha256: not cgbuild's, left alone."""
    pinned_missing: list[str] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)
    """Keys whose ref a publish wrote while step 4 deleted its object (step 5)."""
    uploads_aborted: list[str] = field(default_factory=list)
    """Objects whose incomplete multipart upload older than the grace was aborted (or, dry, would
    be): a killed publish's parts (step 6)."""
    uploads_kept_young: int = 0


def _refs(shared: SharedStore) -> dict[str, RemoteRef | None]:
    """key → its ref (None when it is gone or no JSON object), read READERS at a time."""
    remote = shared.remote
    keys = sorted(remote.list_keys())
    if not keys:
        return {}
    with ThreadPoolExecutor(max_workers=min(READERS, len(keys))) as pool:
        return dict(zip(keys, pool.map(lambda k: remote.get_json(remote.ref_name(k)), keys), strict=True))


def _named(refs: dict[str, RemoteRef | None]) -> tuple[dict[str, list[str]], list[str]]:
    """(sha → keys whose ref names it, keys whose ref names no object)."""
    named: dict[str, list[str]] = {}
    unreadable: list[str] = []
    for key, got in refs.items():
        sha = str(got.doc.get("object")) if got is not None else ""
        if _SHA_RE.match(sha):
            named.setdefault(sha, []).append(key)
        else:
            unreadable.append(key)
    return named, unreadable


def collect(
    shared: SharedStore,
    *,
    grace_s: float = DEFAULT_GRACE_S,
    roots: Collection[str] = (),
    dry_run: bool = False,
    hook: Hook | None = None,
) -> RemoteGC:
    """Run steps 1–5 (module docstring) over the shared store's remote."""
    remote = shared.remote
    report = RemoteGC(dry_run=dry_run, grace_s=grace_s)
    refs = _refs(shared)
    marked, report.unreadable_refs = _named(refs)
    report.refs = len(refs)
    report.pinned_missing = sorted(k for k in set(roots) if refs.get(k) is None)
    for key in roots:  # a pinned key's object is a root even where its ref is judged unreadable
        got = refs.get(key)
        if got is not None and _SHA_RE.match(str(got.doc.get("object"))):
            marked.setdefault(str(got.doc["object"]), []).append(key)
    now, listing = remote.list_stamps("objects/sha256")
    stamps: dict[str, tuple[float, str, str]] = {}
    for sha, modified in sorted(listing.items()):
        if not _SHA_RE.match(sha):
            report.foreign.append(sha)
        elif sha in marked:
            report.objects_kept += 1
        elif now - modified < grace_s:
            report.kept_young += 1
        elif (stamp := remote.stamp(remote.object_name(sha))) is not None:
            if now - stamp[0] < grace_s:  # touched since it was listed
                report.kept_young += 1
            else:
                stamps[sha] = stamp
    if hook:
        hook("chosen", None)
    again, _ = _named(_refs(shared))
    deleted: list[str] = []
    for sha, stamp in stamps.items():
        if sha in again:
            report.kept_rescued.append(sha)
            continue
        name = remote.object_name(sha)
        current = remote.stamp(name)
        if current is None:
            continue  # gone already (another sweep)
        if current != stamp:
            report.kept_rescued.append(sha)
            continue
        if hook:
            hook("deleting", sha)
        report.removed.append(sha)
        if not dry_run and remote.delete(name, etag=stamp[1]):
            deleted.append(sha)
    if hook:
        hook("deleted", None)
    if deleted:
        gone = set(deleted)
        for key, got in _refs(shared).items():
            if got is None or str(got.doc.get("object")) not in gone:
                continue
            sha, size = str(got.doc["object"]), got.doc.get("size")
            if isinstance(size, int) and remote.has_object(sha, size):
                continue  # its publisher put the bytes back
            reason = (
                f"gc-race: object {sha[:12]} was collected as unreferenced while this ref was "
                "written; the publisher's next mint republishes it from its cache"
            )
            shared.quarantine_remote(key, got, reason, drop_object=False)
            report.quarantined.append(key)
    _abort_stale_uploads(shared, report)
    return report


def _abort_stale_uploads(shared: SharedStore, report: RemoteGC) -> None:
    """Step 6. A live upload older than the grace (a day by default: far longer than any upload)
    fails when it completes, and its publish with it (`upload-failed`, retryable); no ref names a
    key before its object is complete, so nothing published loses its bytes."""
    remote = shared.remote
    now, uploads = remote.list_uploads("objects/sha256")
    for sha, upload_id, initiated in uploads:
        if not _SHA_RE.match(sha):
            continue  # not cgbuild's: left alone, as foreign objects are
        if now - initiated < report.grace_s:
            report.uploads_kept_young += 1
            continue
        report.uploads_aborted.append(sha)
        if not report.dry_run:
            remote.abort_upload(remote.object_name(sha), upload_id)
