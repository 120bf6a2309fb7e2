"""The local store as a cache in front of a shared, signed S3 store (docs/store.md).

`SharedStore` has the local `Store`'s reading face (`ref_state`, `resolve`), so the planner and
adopt use either. What it adds, and why:

- `ref_state` counts a key fresh when the local cache or the remote has it; the remote's refs
  are listed at most once per process (one request per 1,000 keys), never asked key by key, and
  a listing is remembered in the cache for `SEEN_TTL_S`: refs are create-only and cgbuild removes
  one only by quarantine, so a warm plan lists `quarantine/` instead of every ref.
- `admit` signs the artifact's (key, sha256, size), admits it locally with that signature in the
  ref's metadata, uploads the object, then creates the remote ref create-only: the first
  publisher of a key wins on every machine, a later one is told which artifact stands.
- `resolve` / `pull` accept only artifacts signed by a trusted publisher whose bytes hash to the
  signed sha256; a pulled artifact keeps its signature in the local ref, so a later adopt from
  the cache re-verifies it. Bytes that fail twice are quarantined remotely (record, ref removed)
  and never admitted locally.
- lane evidence and trace facts go beside the artifacts, one new object per run or fact.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from cgbuild.core import fs
from cgbuild.core.canon import canonical_json, file_digest
from cgbuild.core.codes import Code
from cgbuild.store import refs, trust
from cgbuild.store.backend import Backend
from cgbuild.store.errors import Corrupt, KeyMismatch, Missing, StoreError
from cgbuild.store.local import EVIDENCE_SCHEMA, Store
from cgbuild.store.records import Admission, Ref, Resolved
from cgbuild.store.refs import RefState
from cgbuild.store.s3 import RemoteError, RemoteRef

REMOTE_REF_SCHEMA = "cgbuild.remote-ref/1"
REMOTE_QUARANTINE_SCHEMA = "cgbuild.remote-quarantine/1"
FACTS_SCHEMA = "cgbuild.remote-facts/1"
FACT_READERS = 8  # concurrent fact reads: within botocore's default pool of 10 connections
SEEN_SCHEMA = "cgbuild.remote-seen/1"
SEEN_TTL_S = 3 * 3600
"""How long keys a listing (or a publish) saw count as present without listing again. Quarantine,
cgbuild's only removal, is subtracted on every read; the TTL bounds what a removal by other hands
can hide (the bet, and the default, of Bazel's remote-cache TTL)."""
_SEEN_LOCK = threading.Lock()


class Untrusted(StoreError):
    """The artifact's signature is missing, unknown or wrong; `code` says which (trust.py)."""

    def __init__(self, key: str, error: trust.TrustError) -> None:
        super().__init__(key, error.detail)
        self.code = error.code


class PublishRefused(StoreError):
    """This machine cannot publish to the shared store: it has no usable signing key."""

    def __init__(self, key: str | None, code: Code, detail: str) -> None:
        super().__init__(key, detail)
        self.code = code


@dataclass(frozen=True)
class Pulled:
    """One key brought into the local cache: its ref and the trusted publisher who signed it."""

    ref: Ref
    signer: str


def _unique(host: str) -> str:
    return f"{host}-{int(time.time())}-{secrets.token_hex(4)}"


def seen_path(store_root: Path, url: str) -> Path:
    """Where the local store at `store_root` remembers its listing of the remote at `url`."""
    name = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return store_root / "remote" / f"{name}.json"


def _young(listed_at: float) -> bool:
    """A remembered listing still counts: taken less than `SEEN_TTL_S` ago (and not in the future)."""
    return 0 <= time.time() - listed_at < SEEN_TTL_S


class SharedStore:
    """A local `Store` (the cache) in front of a remote `Backend`, with the workspace's trusted keys;
    `probes` is where a passed capability probe is remembered (None: probed once per process)."""

    def __init__(
        self,
        local: Store,
        remote: Backend,
        trusted: dict[str, bytes],
        host: str,
        probes: Path | None = None,
    ) -> None:
        self.local = local
        self.remote = remote
        self.trusted = trusted
        self.host = host
        self.probes = probes
        self._signer: trust.Signer | None = None

    # ---- plan ----------------------------------------------------------------------------------
    def remote_keys(self) -> set[str]:
        """Keys with a remote ref, listed once per process (batched pages of 1,000); the listing
        is remembered for `seen_keys`."""
        if not self.remote.listed:
            started = time.time()
            self.remote.seen = self.remote.list_keys()
            self.remote.listed = True
            self._save_seen(started)
        return cast(set[str], self.remote.seen)  # `listed`: `seen` is that listing

    def seen_keys(self) -> set[str]:
        """Keys the remembered listing (younger than `SEEN_TTL_S`) or this cache's publishes saw,
        less every key with a remote quarantine record: one listing of `quarantine/`, not of
        `refs/`. A key quarantined and later repaired is left to the full listing."""
        if self.remote.seen is None:
            doc = self._read_seen()
            keys = set(doc.get("keys") or []) if _young(float(doc.get("listed_at", 0))) else set()
            if keys:
                keys -= self._quarantined()
            self.remote.seen = keys
        return self.remote.seen

    def _quarantined(self) -> set[str]:
        return {name.split("/", 1)[0] for name in self.remote.list_names("quarantine")}

    def remembered(self) -> tuple[float | None, set[str]]:
        """When the remembered listing this process read was taken, and the keys it vouched for
        (less quarantined ones); `(None, set())` when this process listed `refs/` itself or read
        none: a later process can re-check only a listing it finds remembered."""
        listed_at = self._read_seen().get("listed_at")
        if self.remote.listed or self.remote.seen is None or listed_at is None:
            return None, set()
        return float(listed_at), set(self.remote.seen)

    def vouches(self, keys: list[str], listed_at: float) -> bool:
        """Whether the remembered listing taken at `listed_at` still vouches for every one of
        `keys`, as `seen_keys` would judge it now: younger than the TTL and none of them
        quarantined (one listing of `quarantine/`, never of `refs/`)."""
        return _young(listed_at) and self._quarantined().isdisjoint(keys)

    def ref_state(self, key: str) -> RefState:
        """`fresh` when the local cache holds the key or the remote has it; else the local state."""
        state = self.local.ref_state(key)
        return RefState.FRESH if state is not RefState.FRESH and self._listed(key) else state

    def _listed(self, key: str) -> bool:
        """The remote has `key`: by what this machine saw it publish, or by the listing."""
        return key in self.seen_keys() or key in self.remote_keys()

    def _seen_path(self) -> Path:
        return seen_path(self.local.root, self.remote.url)

    def _read_seen(self) -> dict[str, Any]:
        try:
            doc = json.loads(self._seen_path().read_text())
        except (OSError, ValueError):
            return {}  # none yet, or torn by hand: list again
        ok = (
            isinstance(doc, dict)
            and doc.get("schema") == SEEN_SCHEMA
            and doc.get("url") == self.remote.url
            and isinstance(doc.get("listed_at"), int | float)
            and isinstance(doc.get("keys"), list)
        )
        return doc if ok else {}

    def _save_seen(self, listed_at: float | None = None) -> None:
        """Write `remote.seen` atomically; `listed_at` None keeps the remembered listing's time."""
        path = self._seen_path()
        if listed_at is None:
            listed_at = float(self._read_seen().get("listed_at", time.time()))
        doc = {"schema": SEEN_SCHEMA, "url": self.remote.url, "listed_at": listed_at}
        self.remote.seen_unsaved = False
        fs.write_json(path, {**doc, "keys": sorted(self.remote.seen or ())})

    def _saw(self, key: str, present: bool) -> None:
        """A ref this process created, found standing, or quarantined: keep `seen` current
        (under a lock: a local mint publishes from several threads). A removal is written at once;
        publishes wait for `save_seen`, so publishing n keys is not n rewrites of the file (one
        never written costs a later listing, nothing more)."""
        with _SEEN_LOCK:
            seen = self.seen_keys()
            (seen.add if present else seen.discard)(key)
            if present:
                self.remote.seen_unsaved = True
            else:
                self._save_seen()

    def save_seen(self) -> None:
        """Remember what this process published (a command calls it once, after its publishes)."""
        with _SEEN_LOCK:
            if self.remote.seen_unsaved:
                self._save_seen()

    # ---- publishing ----------------------------------------------------------------------------
    def check_publishable(self) -> trust.Signer:
        """The signer, once the store has proved create-only writes. No usable signing key is
        `PublishRefused`; a store that fails the probe is a `RemoteError` (the workspace's store
        is misconfigured: one line, exit 2), naming the endpoint and what it lacks."""
        if self._signer is not None:
            return self._signer
        try:
            signer = trust.load_signer()
        except ValueError as e:
            raise PublishRefused(None, Code.BAD_SIGNING_KEY, str(e)) from None
        if signer is None:
            raise PublishRefused(
                None,
                Code.NO_SIGNING_KEY,
                f"the workspace shares its store at {self.remote.url}, but {trust.SIGNING_KEY_ENV} "
                "names no signing key: cgbuild publishes only signed artifacts "
                "(`cgbuild trust keygen PATH` makes one)",
            )
        if not self.remote.probed:
            self.remote.probe(self.host, self.probes)
            self.remote.probed = True
        self._signer = signer
        return signer

    def admit(self, key: str, artifact: str | os.PathLike[str], *, metadata: dict[str, Any]) -> Admission:
        """Sign, admit locally, publish; `conflict` names the artifact that stands in the remote.

        A key the remote already holds with other bytes is mint-once's loser here: the local
        copy is retired (quarantined) so this cache never serves what the fleet does not.
        """
        signer = self.check_publishable()
        sha, size = file_digest(Path(artifact))
        signature = signer.sign(trust.artifact_statement(key, sha, size))
        local = self.local.admit(
            key, artifact, metadata={**metadata, "signature": signature}, expected_sha256=sha
        )
        if not local.ok:
            return local
        status, standing = self.publish(key, self.local.object_path(sha), sha, size, signature, metadata)
        if status == "conflict":
            self.local.retire(key, f"the shared store holds {standing} for this key (mint-once)")
            return Admission("conflict", key, sha, size, existing=standing)
        return Admission(status, key, sha, size)  # type: ignore[arg-type]

    def publish(
        self, key: str, path: Path, sha: str, size: int, signature: dict[str, Any], metadata: dict[str, Any]
    ) -> tuple[str, str]:
        """Upload the object (unless there), then create the ref: (`admitted`|`already`|`conflict`,
        the standing object). The ref is written only once its object is complete.

        An object already there may be an orphan a remote gc is about to sweep: it is touched
        (refreshed) before the ref names it, and looked at again after the ref is written, and
        uploaded again if it went in between (docs/store.md, "Remote gc and the publish race")."""
        if not (self.remote.has_object(sha, size) and self.remote.touch(sha, size)):
            self.remote.upload(path, sha)
        doc = {
            "schema": REMOTE_REF_SCHEMA,
            "key": key,
            "object": sha,
            "size": size,
            "metadata": metadata,
            "signature": signature,
            "publisher": self.host,
        }
        body = (canonical_json(doc) + "\n").encode()
        for _ in range(3):
            if self.remote.create(self.remote.ref_name(key), body):
                self._saw(key, True)
                self._still_there(path, sha, size)
                return "admitted", sha
            standing = self.remote.get_json(self.remote.ref_name(key))
            if standing is None:
                continue  # quarantined between our create and our read: try again
            self._saw(key, True)
            other = str(standing.doc.get("object"))
            if other == sha:
                self._still_there(path, sha, size)
            return ("already" if other == sha else "conflict"), other
        raise RemoteError(Code.REMOTE_ERROR, f"{self.remote.url}: {key}: ref kept vanishing; giving up")

    def _still_there(self, path: Path, sha: str, size: int) -> None:
        """After the ref is written: a sweep that chose the object before the ref existed may have
        removed it since; this machine still holds the bytes, so they go up again."""
        if not self.remote.has_object(sha, size):
            self.remote.upload(path, sha)

    def unpublished(self, keys: set[str]) -> list[str]:
        """Keys this cache holds that the remote does not list: admitted here while a publish
        failed (or before the workspace declared its remote). Plan reads them fresh, so without
        this they would never reach the fleet."""
        unknown = [k for k in keys if k not in self.seen_keys() and self.local.ref_state(k) == "fresh"]
        if not unknown:
            return []
        listed = self.remote_keys()
        return sorted(k for k in unknown if k not in listed)

    def republish(self, key: str) -> tuple[str, str]:
        """Publish a key from the cache (re-hashed first), with the signature its local ref keeps
        or, for a key admitted before the remote was declared, one made now."""
        signer = self.check_publishable()
        ref = self.local.resolve(key, verify=True).ref
        if (why := self.local.crossed(ref)) is not None:  # opened anyway: never publish it
            self.local.retire(key, f"key-mismatch: {why}")
            raise KeyMismatch(key, f"{why}: quarantined, not published")
        signature = ref.metadata.get("signature")
        metadata = {k: v for k, v in ref.metadata.items() if k != "signature"}
        path = self.local.object_path(ref.object)
        if signature is None:
            # The cache re-verifies what it serves: re-admit the same bytes with their signature.
            signature = signer.sign(trust.artifact_statement(key, ref.object, ref.size))
            self.local.retire(key, "re-admitted with the signature it is published under")
            signed = {**metadata, "signature": signature}
            self.local.admit(key, path, metadata=signed, expected_sha256=ref.object)
        status, standing = self.publish(key, path, ref.object, ref.size, signature, metadata)
        if status == "conflict":
            self.local.retire(key, f"the shared store holds {standing} for this key (mint-once)")
        return status, standing

    def add_evidence(self, key: str, run: dict[str, Any]) -> str | None:
        """One lane-evidence run, locally and as a new remote object (never read-modify-write).

        Evidence explains a sealed verdict; it is not the artifact. A store that refuses it
        leaves the run on this machine and the published artifact standing: the reason is
        returned (None when the remote has it), never raised.
        """
        self.local.add_evidence(key, self.host, run)
        doc = {"schema": "cgbuild.lane-evidence-run/1", "key": key, "host": self.host, "run": run}
        name = self.remote.name("evidence", key, f"{_unique(self.host)}.json")
        try:
            self.remote.create(name, json.dumps(doc, sort_keys=True).encode())
        except RemoteError as e:
            return e.detail
        return None

    def read_evidence(self, key: str) -> dict[str, dict[str, Any]]:
        """host → that host's evidence for `key`, shaped as `Store.read_evidence` gives it: every
        run any card published beside the artifact, plus this cache's own documents for hosts
        the remote lacks (runs a store refused)."""
        out: dict[str, dict[str, Any]] = {}
        for name in sorted(self.remote.list_names(f"evidence/{key}")):
            got = self.remote.get_json(self.remote.name("evidence", key, name))
            if got is None or not isinstance(got.doc.get("run"), dict):
                continue
            host = str(got.doc.get("host"))
            doc = out.setdefault(host, {"schema": EVIDENCE_SCHEMA, "key": key, "host": host, "runs": []})
            doc["runs"].append(got.doc["run"])
        for host, doc in self.local.read_evidence(key).items():
            out.setdefault(host, doc)
        return out

    # ---- trace facts ---------------------------------------------------------------------------
    def pull_facts(self, inputs: list[str]) -> dict[str, dict[str, Any]]:
        """Trace facts other machines published for these inputs, signed by a trusted publisher.

        One listing finds which exist; they are read FACT_READERS at a time (a clean clone reads
        thousands, and each is a round trip); unsigned or untrusted facts are ignored (traced here).
        """
        wanted = set(inputs)
        if not wanted:
            return {}
        present = sorted({n[: -len(".json")] for n in self.remote.list_names("facts")} & wanted)
        if not present:
            return {}
        with ThreadPoolExecutor(max_workers=min(FACT_READERS, len(present))) as pool:
            docs = pool.map(lambda i: self.remote.get_json(self.remote.facts_name(i)), present)
            found = dict(zip(present, docs, strict=True))
        out: dict[str, dict[str, Any]] = {}
        for i, got in found.items():
            facts = got.doc.get("facts") if got else None
            if not isinstance(facts, dict):
                continue
            try:
                trust.verify(got.doc.get("signature"), trust.facts_statement(i, facts), self.trusted)  # type: ignore[union-attr]
            except (trust.TrustError, ValueError):  # ValueError: facts no canonical form admits (NaN)
                continue
            out[i] = facts
        return out

    def push_facts(self, facts: dict[str, dict[str, Any]]) -> int:
        """Publish freshly traced facts when this machine can sign; returns how many were new."""
        if not facts:
            return 0
        try:
            signer = trust.load_signer()
        except ValueError:
            return 0
        if signer is None:
            return 0
        made = 0
        for i, f in sorted(facts.items()):
            doc = {
                "schema": FACTS_SCHEMA,
                "inputs": i,
                "facts": f,
                "signature": signer.sign(trust.facts_statement(i, f)),
            }
            made += self.remote.create(self.remote.facts_name(i), json.dumps(doc, sort_keys=True).encode())
        return made

    # ---- reading artifacts ---------------------------------------------------------------------
    def _verify(self, key: str, sha: str, size: int, signature: Any) -> str:
        try:
            return trust.verify(signature, trust.artifact_statement(key, sha, size), self.trusted)
        except trust.TrustError as e:
            raise Untrusted(key, e) from None

    def resolve(self, key: str, *, verify: bool = True) -> Resolved:
        """The key's artifact from the cache, pulled first when absent; signature re-verified.

        Raises `Untrusted` (code `unsigned` / `unknown-signer` / `bad-signature`), `Corrupt`,
        `Missing`, like `Store.resolve`.
        """
        if self.local.ref_state(key) != "fresh":
            self.pull(key)
        ref = self.local.read_ref(key)
        if ref is None:
            raise Missing(key, "no artifact in the local cache")
        self._verify(key, ref.object, ref.size, ref.metadata.get("signature"))
        return self.local.resolve(key, verify=verify)

    def _trusted_ref(self, key: str) -> tuple[RemoteRef, str]:
        """The key's remote ref and the trusted publisher who signed it; raises `Missing`, a
        `StoreError` for a malformed ref, or `Untrusted` (the check `pull` makes before any
        download, and `plan --verify` before it counts a listed key fresh)."""
        got = self.remote.get_json(self.remote.ref_name(key))
        if got is None:
            raise Missing(key, f"no artifact in the local cache or in {self.remote.url}")
        doc = got.doc
        if why := refs.doc_problem(doc, key, REMOTE_REF_SCHEMA):
            raise StoreError(key, f"malformed remote ref {self.remote.ref_name(key)}: {why}")
        return got, self._verify(key, doc["object"], doc["size"], doc.get("signature"))

    def verified_state(self, key: str) -> tuple[RefState | Code, str | None]:
        """`ref_state`, except that a key fresh only by the remote's listing has its ref read and
        its signature checked first: (`fresh` | `missing` | `malformed` | a trust code, the
        refusal's detail). A key the local cache holds is not asked again: its signature is
        re-verified on every resolve."""
        local = self.local.ref_state(key)  # read once: `ref_state` would read it again
        if local is RefState.FRESH or not self._listed(key):
            return local, None
        try:
            self._trusted_ref(key)
        except Untrusted as e:
            return Code(e.code), e.detail
        except Missing:
            return RefState.MISSING, None  # quarantined since it was listed
        except StoreError as e:
            return RefState.MALFORMED, e.detail
        return RefState.FRESH, None

    def pull(self, key: str) -> Pulled:
        """Download, verify (signature, then sha256 and size) and admit one key into the cache.

        A download that does not hash to the signed sha256 is tried once more; a second failure
        quarantines the key remotely and raises `Corrupt`; bad bytes never reach the cache.
        """
        got, signer = self._trusted_ref(key)
        doc = got.doc
        sha, size = doc["object"], doc["size"]
        tmp_dir = self.local.temp_dir()
        for _ in range(2):
            fd, name = tempfile.mkstemp(dir=tmp_dir, suffix=".pull")
            try:
                with os.fdopen(fd, "wb") as out:
                    found = self.remote.download(sha, out)
                if found == (sha, size):
                    if (other := _sealed_key(name)) not in (None, key):
                        # signed, intact, and another key's artifact: the object is left for
                        # the key it belongs to, only this ref goes
                        reason = (
                            f"key-mismatch: remote object {sha[:12]}'s sealed metadata "
                            f"names key {other[:16]!r}"
                        )
                        self.quarantine_remote(key, got, reason, drop_object=False)
                        raise KeyMismatch(key, f"{reason}: quarantined in {self.remote.url}")
                    metadata = {**(doc.get("metadata") or {}), "signature": doc["signature"]}
                    admission = self.local.admit(
                        key, name, metadata=metadata, expected_sha256=sha, owned=True
                    )
                    if not admission.ok:
                        raise StoreError(key, f"the local cache holds {admission.existing} for this key")
                    return Pulled(self.local.read_ref(key), signer)  # type: ignore[arg-type]
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name)
        reason = f"remote object {sha} downloaded twice as {found[0]} ({found[1]} bytes, signed {size})"
        self.quarantine_remote(key, got, reason)
        raise Corrupt(key, f"{reason}: quarantined in {self.remote.url}; a new verified mint repairs it")

    def quarantine_remote(self, key: str, seen: RemoteRef, reason: str, *, drop_object: bool = True) -> None:
        """Record why, then drop the ref (only the one judged: If-Match its ETag) and, with
        `drop_object`, the bad object."""
        record = {
            "schema": REMOTE_QUARANTINE_SCHEMA,
            "key": key,
            "reason": reason,
            "ref": seen.doc,
            "host": self.host,
            "recorded": int(time.time()),
        }
        name = self.remote.name("quarantine", key, f"{_unique(self.host)}.json")
        self.remote.create(name, json.dumps(record, sort_keys=True).encode())
        if not self.remote.delete(self.remote.ref_name(key), etag=seen.etag):
            return  # already replaced by a repair: leave it
        if drop_object:
            self.remote.delete(self.remote.object_name(str(seen.doc["object"])))
        self._saw(key, False)

    def quarantine_records(self, key: str) -> list[dict[str, Any]]:
        return [
            got.doc
            for n in sorted(self.remote.list_names(f"quarantine/{key}"))
            if (got := self.remote.get_json(self.remote.name("quarantine", key, n)))
        ]


def _sealed_key(path: str | os.PathLike[str]) -> str | None:
    """The key a sealed artifact's metadata names; None for bytes that are no sealed artifact
    (adopt judges those)."""
    from cgbuild.store.seal import SealError, read_metadata

    try:
        key = read_metadata(path).get("key")
    except SealError:
        return None
    return key if isinstance(key, str) else None
