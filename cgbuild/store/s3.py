"""The S3 side of a shared store: layout under a bucket prefix, create-only writes, parts.

Layout under `s3://bucket/prefix/`::

    refs/<key>.json                  the key's ref: object, size, signature (create-only)
    objects/sha256/<sha256>          immutable artifact bytes, named by their hash
    evidence/<key>/<host>-<id>.json  one lane-evidence run per object (create-only, never rewritten)
    facts/<trace inputs>.json        signed trace facts, so a clean clone need not re-trace
    quarantine/<key>/<id>.json       why a key's shared artifact was pulled, with the ref it had
    probe/<host>-<id>[-race]         the capability probe's scratch objects (deleted after)

Why: S3 has no rename and no lock, but it has create-only writes (`If-None-Match: *`, refused
with 412). A ref is written that way, and only after its object is complete, so the first
publisher of a key wins across machines and a reader never sees a ref without its object. An
interrupted multipart upload is invisible until completed, and is aborted on failure. Endpoint
and credentials come from boto3's own chain (AWS_* environment, config files, instance roles;
`AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL` for S3-compatible stores). boto3 is imported only
when a remote is used.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from cgbuild.config.cgfile import REMOTE
from cgbuild.core import fs, statefile
from cgbuild.core.codes import Code
from cgbuild.core.errors import UserError

MULTIPART_ENV = "CGBUILD_S3_MULTIPART_THRESHOLD"
FAULT_ENV = "CGBUILD_REMOTE_FAULT"  # test-only: "fail-after-part" | "kill-after-part"
DEFAULT_MULTIPART = 64 << 20
MIN_PART = 5 << 20  # S3's smallest part but the last
MAX_COPY = 5 << 30  # S3's largest single CopyObject
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Listing:
    """One S3 listing call: its operation, its name in errors, and which answer fields carry the
    next request's continuation (request parameter, answer field)."""

    op: str
    what: str
    markers: tuple[tuple[str, str], ...]


OBJECTS = Listing("list_objects_v2", "list", (("ContinuationToken", "NextContinuationToken"),))
UPLOADS = Listing(
    "list_multipart_uploads",
    "list uploads",
    (("KeyMarker", "NextKeyMarker"), ("UploadIdMarker", "NextUploadIdMarker")),
)
PROBE_SCHEMA = "cgbuild.remote-probe/1"
PROBE_TTL_S = 3600
"""How long a passed probe vouches for a store (its endpoint, bucket and prefix): a machine
probes each store at most hourly, and a store that stops honouring create-only writes (an older
server put in its place, a gateway in front of it) is caught within the hour."""


class RemoteError(UserError):
    """The shared store cannot do what was asked; `code` is stable and machine-readable.

    A `UserError`: an unreachable endpoint, missing credentials or a missing bucket are the
    workspace's configuration, reported in one line with exit code 2.
    """

    def __init__(self, code: Code, detail: str) -> None:
        super().__init__(f"{code}: {detail}", field="workspace.remote")
        self.code = code
        self.detail = detail


@dataclass(frozen=True)
class RemoteRef:
    """A ref as read from the remote: its document and the ETag it was read at."""

    doc: dict[str, Any]
    etag: str


def _store_clock(page: dict[str, Any]) -> float:
    """The store's own time, from a listing's `Date` header (0 when it sends none)."""
    import email.utils

    date = page["ResponseMetadata"]["HTTPHeaders"].get("date")
    return email.utils.parsedate_to_datetime(date).timestamp() if date else 0.0


def _status(e: Exception) -> tuple[str, int]:
    response = getattr(e, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    return code, int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def _unavailable(e: Exception) -> bool:
    """The store could not be reached or could not serve, after botocore's retries: a transport
    failure (refused, reset, timed out) or a 5xx answer (503 SlowDown, 500 InternalError). Not the
    request's fault and not the key's, so `remote-unavailable`, which a later run may not meet."""
    from botocore.exceptions import BotoCoreError

    return isinstance(e, BotoCoreError) or _status(e)[1] >= 500


class Remote:
    """One `s3://bucket/prefix`, reached through boto3's default endpoint and credential chain."""

    def __init__(self, url: str, *, multipart_threshold: int | None = None) -> None:
        m = REMOTE.match(url.rstrip("/"))
        if not m:
            raise ValueError(f"not an s3://bucket/prefix URL: {url!r}")
        self.url = url.rstrip("/")
        self.bucket = m.group(1)
        prefix = (m.group(2) or "").strip("/")
        self.prefix = f"{prefix}/" if prefix else ""
        env = os.environ.get(MULTIPART_ENV)
        self.multipart_threshold = multipart_threshold or int(env or DEFAULT_MULTIPART)
        self.probed = False
        """Set once `probe` has passed, so a process probes each store once."""
        self.seen: set[str] | None = None
        """The keys a recent listing or publish saw, as `SharedStore.seen_keys` read them."""
        self.listed = False
        """Set once this process has listed `refs/`: `seen` is then that listing, kept current
        (the plan's listing serves the mint after it)."""
        self.seen_unsaved = False
        """Publishes added to `seen` since it was last written (`SharedStore.save_seen`)."""
        self._client: Any = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # a Workspace travels to fleet workers: the client and its lock are rebuilt there
        return {**self.__dict__, "_client": None, "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    # ---- names -------------------------------------------------------------------------------
    def name(self, *parts: str) -> str:
        return self.prefix + "/".join(parts)

    def ref_name(self, key: str) -> str:
        return self.name("refs", f"{key}.json")

    def object_name(self, sha: str) -> str:
        return self.name("objects", "sha256", sha)

    def facts_name(self, inputs: str) -> str:
        return self.name("facts", f"{inputs}.json")

    # ---- client ------------------------------------------------------------------------------
    @property
    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                import boto3
                from botocore.config import Config

                # its own session: boto3's default one caches credentials for the whole process;
                # standard retries whatever AWS_RETRY_MODE or the profile asks (legacy mode tries
                # 5 times): 3 attempts unless AWS_MAX_ATTEMPTS or the profile's max_attempts says
                # otherwise, jittered exponential backoff, 503 SlowDown and dropped connections
                # included (docs/store.md, "Faults")
                session = boto3.session.Session()
                self._client = session.client("s3", config=Config(retries={"mode": "standard"}))
                if os.environ.get(FAULT_ENV):
                    _install_fault(self._client, os.environ[FAULT_ENV])
            return self._client

    def _call(self, op: str, **kw: Any) -> Any:
        """One S3 call; transport failures, 5xx answers (after botocore's retries) and missing
        credentials become `RemoteError`s naming the store; other refusals stay `ClientError`s
        for the caller to judge (404, 412)."""
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        try:
            return getattr(self.client, op)(Bucket=self.bucket, **kw)
        except ClientError as e:
            if _unavailable(e):
                raise RemoteError(Code.REMOTE_UNAVAILABLE, f"{self.url}: {e}") from None
            raise
        except NoCredentialsError:
            raise RemoteError(
                Code.NO_CREDENTIALS,
                f"{self.url}: boto3 found no credentials (AWS_* environment, config files)",
            ) from None
        except BotoCoreError as e:
            raise RemoteError(Code.REMOTE_UNAVAILABLE, f"{self.url}: {e}") from None

    # ---- reading -----------------------------------------------------------------------------
    def list_names(self, sub: str) -> Iterator[str]:
        """Every object name under `prefix/sub/`, relative to it: one request per 1,000 names."""
        base = self.name(sub) + "/"
        for page in self._pages(OBJECTS, base):
            for obj in page.get("Contents", []):
                yield obj["Key"][len(base) :]

    def _pages(self, listing: Listing, base: str) -> Iterator[dict[str, Any]]:
        """Every page of one S3 listing under `base`, each request carrying the last page's
        continuation markers; a refused listing (a missing bucket, a denied one) is named."""
        from botocore.exceptions import ClientError

        markers: dict[str, str] = {}
        while True:
            try:
                page: dict[str, Any] = self._call(listing.op, Prefix=base, **markers)
            except ClientError as e:
                raise RemoteError(Code.REMOTE_ERROR, f"{self.url}: {listing.what} {base}: {e}") from None
            yield page
            if not page.get("IsTruncated"):
                return
            markers = {asked: page[answered] for asked, answered in listing.markers}

    def list_keys(self) -> set[str]:
        """Keys that have a ref, by listing `refs/` (never one request per key)."""
        return {n[: -len(".json")] for n in self.list_names("refs") if n.endswith(".json")}

    def get_json(self, name: str) -> RemoteRef | None:
        """A small JSON object and its ETag, or None when absent (or not JSON)."""
        from botocore.exceptions import ClientError

        try:
            got = self._call("get_object", Key=name)
        except ClientError as e:
            if _status(e)[1] == 404:
                return None
            raise RemoteError(Code.REMOTE_ERROR, f"{self.url}: get {name}: {e}") from None
        try:
            doc = json.loads(got["Body"].read())
        except ValueError:
            return None
        return RemoteRef(doc, got.get("ETag", "")) if isinstance(doc, dict) else None

    def has_object(self, sha: str, size: int) -> bool:
        """The object is there, of this size, and was uploaded as these bytes (its sha tag)."""
        from botocore.exceptions import ClientError

        try:
            head = self._call("head_object", Key=self.object_name(sha))
        except ClientError as e:
            if _status(e)[1] == 404:
                return False
            raise RemoteError(Code.REMOTE_ERROR, f"{self.url}: head object {sha[:12]}: {e}") from None
        return bool(head["ContentLength"] == size and head.get("Metadata", {}).get("sha256") == sha)

    def download(self, sha: str, out: BinaryIO) -> tuple[str, int]:
        """Stream an object into `out`; returns the (sha256, size) of what arrived."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            body = self._call("get_object", Key=self.object_name(sha))["Body"]
        except ClientError as e:
            raise RemoteError(Code.REMOTE_ERROR, f"{self.url}: get object {sha[:12]}: {e}") from None
        h = hashlib.sha256()
        size = 0
        with contextlib.closing(body):
            try:
                for block in body.iter_chunks(_CHUNK):
                    h.update(block)
                    out.write(block)
                    size += len(block)
            except BotoCoreError as e:  # the connection broke mid-body
                raise RemoteError(
                    Code.REMOTE_UNAVAILABLE, f"{self.url}: get object {sha[:12]}: {e}"
                ) from None
        return h.hexdigest(), size

    def list_stamps(self, sub: str) -> tuple[float, dict[str, float]]:
        """(the store's clock when the listing began, name → last-modified) of every object under
        `prefix/sub/`: ages are judged on the store's clock alone, never this machine's."""
        base = self.name(sub) + "/"
        now: float | None = None
        out: dict[str, float] = {}
        for page in self._pages(OBJECTS, base):
            now = _store_clock(page) if now is None else now
            for obj in page.get("Contents", []):
                # whole seconds, as HEAD and the Date header give them
                out[obj["Key"][len(base) :]] = float(int(obj["LastModified"].timestamp()))
        assert now is not None  # a listing has at least one page
        return now, out

    def list_uploads(self, sub: str) -> tuple[float, list[tuple[str, str, float]]]:
        """(the store's clock when the listing began, [(name under `prefix/sub/`, upload id,
        initiated)]) of every incomplete multipart upload there: what a killed upload leaves,
        never visible as an object, its parts kept (and billed) until it is aborted."""
        base = self.name(sub) + "/"
        now: float | None = None
        out: list[tuple[str, str, float]] = []
        for page in self._pages(UPLOADS, base):
            now = _store_clock(page) if now is None else now
            for up in page.get("Uploads", []):
                out.append((up["Key"][len(base) :], up["UploadId"], float(int(up["Initiated"].timestamp()))))
        assert now is not None  # a listing has at least one page
        return now, out

    def abort_upload(self, name: str, upload_id: str) -> None:
        """Abort an incomplete multipart upload of `name` (one already gone counts as aborted)."""
        from botocore.exceptions import ClientError

        try:
            self._call("abort_multipart_upload", Key=name, UploadId=upload_id)
        except ClientError as e:
            if _status(e)[1] != 404 and _status(e)[0] != "NoSuchUpload":
                raise RemoteError(Code.REMOTE_ERROR, f"{self.url}: abort upload of {name}: {e}") from None

    def stamp(self, name: str) -> tuple[float, str, str] | None:
        """(last-modified, ETag, `touched` tag) of `name`, or None when absent: what a publish
        that reuses an object changes (`touch`), so a sweep can tell that it happened."""
        from botocore.exceptions import ClientError

        try:
            head = self._call("head_object", Key=name)
        except ClientError as e:
            if _status(e)[1] == 404:
                return None
            raise RemoteError(Code.REMOTE_ERROR, f"{self.url}: head {name}: {e}") from None
        touched = str(head.get("Metadata", {}).get("touched", ""))
        return head["LastModified"].timestamp(), str(head.get("ETag", "")), touched

    # ---- writing -----------------------------------------------------------------------------
    def touch(self, sha: str, size: int) -> bool:
        """Refresh an object a publish is about to reuse: copied onto itself with a new `touched`
        tag, which gives it a new last-modified time. False when it is gone (or too large for one
        copy): the caller uploads it instead (docs/store.md, "Remote gc and the publish race")."""
        from botocore.exceptions import ClientError

        if size > MAX_COPY:
            return False
        name = self.object_name(sha)
        try:
            self._call(
                "copy_object",
                Key=name,
                CopySource={"Bucket": self.bucket, "Key": name},
                MetadataDirective="REPLACE",
                Metadata={"sha256": sha, "touched": secrets.token_hex(8)},
            )
        except ClientError as e:
            if _status(e)[1] == 404 or _status(e)[0] in ("NoSuchKey", "404"):
                return False
            raise RemoteError(Code.REMOTE_ERROR, f"{self.url}: touch object {sha[:12]}: {e}") from None
        return True

    def create(self, name: str, body: bytes) -> bool:
        """Create-only write: True when this call created `name`, False when it already existed."""
        from botocore.exceptions import ClientError

        try:
            self._call("put_object", Key=name, Body=body, IfNoneMatch="*", ContentType="application/json")
        except ClientError as e:
            code, http = _status(e)
            if http == 412 or code in ("PreconditionFailed", "ConditionalRequestConflict"):
                return False
            raise RemoteError(Code.REMOTE_ERROR, f"{self.url}: create {name}: {e}") from None
        return True

    def upload(self, path: Path, sha: str) -> None:
        """Put an object's bytes under its hash; large ones in parts, aborted on failure.

        The object name carries no meaning until a ref names it, so a re-upload of the same
        bytes is harmless; the `sha256` tag lets `has_object` skip what is already there. A store
        that cannot be reached or cannot serve is `remote-unavailable`, any other failure
        `upload-failed` (the transfer manager's own errors, not wrapped as `upload_file` wraps
        them, tell which).
        """
        from boto3.s3.transfer import TransferConfig, create_transfer_manager

        part = max(MIN_PART, min(self.multipart_threshold, DEFAULT_MULTIPART))
        config = TransferConfig(multipart_threshold=self.multipart_threshold, multipart_chunksize=part)
        extra = {"Metadata": {"sha256": sha}}
        try:
            with create_transfer_manager(self.client, config) as manager:
                manager.upload(str(path), self.bucket, self.object_name(sha), extra).result()
        except Exception as e:  # s3transfer has aborted the multipart upload by now (if it could)
            code = Code.REMOTE_UNAVAILABLE if _unavailable(e) else Code.UPLOAD_FAILED
            raise RemoteError(code, f"{self.url}: upload {sha[:12]}: {e}") from None

    def delete(self, name: str, *, etag: str | None = None) -> bool:
        """Delete `name` (only while its ETag is `etag`, when given); False when it had changed."""
        from botocore.exceptions import ClientError

        try:
            self._call("delete_object", Key=name, **({"IfMatch": etag} if etag else {}))
        except ClientError as e:
            if _status(e)[1] == 412:
                return False
            raise RemoteError(Code.REMOTE_ERROR, f"{self.url}: delete {name}: {e}") from None
        return True

    @property
    def endpoint(self) -> str:
        """Where boto3's chain sends this remote's requests (AWS's own endpoint for the bucket's
        region, or `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL` / the profile's)."""
        return str(self.client.meta.endpoint_url)

    def probe(self, host: str, memo: Path | None = None) -> None:
        """Prove the store's create-only writes: of two creates of one name in turn the second must
        be refused, and of two creates of another name at once exactly one may win.

        A store that ignores `If-None-Match: *` (an old server, a proxy that drops the header), or
        checks it and writes without holding a lock (SeaweedFS before 4.16), would let two machines
        each believe they admitted a key, so it is refused rather than shared (docs/store.md): a
        `RemoteError` naming the endpoint and what it lacks. A pass is remembered in the folder
        `memo` (the workspace's state) for `PROBE_TTL_S`, per endpoint, bucket and prefix; a
        failure is not, so a store that was fixed is used at once.
        """
        path = self._probe_memo(memo) if memo is not None else None
        if path is not None and self._probe_remembered(path):
            return
        name = self.name("probe", f"{host}-{secrets.token_hex(8)}")
        race = f"{name}-race"
        try:
            in_turn = (self.create(name, b"{}"), self.create(name, b"{}"))
            at_once = self._create_at_once(race) if in_turn == (True, False) else []
        finally:
            for scratch in (name, race):
                with contextlib.suppress(RemoteError):
                    self.delete(scratch)
        where = f"{self.endpoint} ({self.url})"
        if in_turn != (True, False):
            raise RemoteError(
                Code.NO_CONDITIONAL_WRITE,
                f"{where} does not honour create-only writes (If-None-Match: *): two creates of "
                f"{name} in turn were answered {in_turn[0]} and {in_turn[1]}, not True and False; a "
                "shared store without them cannot keep mint-once, so cgbuild will not publish to it",
            )
        if at_once.count(True) != 1:
            raise RemoteError(
                Code.RACY_CONDITIONAL_WRITE,
                f"{where} does not make concurrent create-only writes (If-None-Match: *) atomic: two "
                f"creates of {race} at once were answered {at_once[0]} and {at_once[1]}, not exactly "
                "one True; two machines publishing one key could both win, so cgbuild will not "
                "publish to it",
            )
        if path is not None:
            with contextlib.suppress(OSError):  # a memo that cannot be written costs the next probe
                doc = {"endpoint": self.endpoint, "bucket": self.bucket, "prefix": self.prefix}
                fs.write_json(path, {"schema": PROBE_SCHEMA, **doc, "passed_at": time.time()})

    def _create_at_once(self, name: str) -> list[bool]:
        """Two create-only writes of `name` released together, each on a connection of its own."""
        start = threading.Barrier(2)

        def create(_: int) -> bool:
            start.wait(timeout=60)
            return self.create(name, b"{}")

        with ThreadPoolExecutor(max_workers=2) as pool:
            return list(pool.map(create, range(2)))

    def _probe_memo(self, memo: Path) -> Path:
        """This store's file in `memo`, named by its endpoint, bucket and prefix (which it also
        records, for a person reading it)."""
        identity = "\n".join((self.endpoint, self.bucket, self.prefix))
        return memo / f"{hashlib.sha256(identity.encode()).hexdigest()[:16]}.json"

    def _probe_remembered(self, path: Path) -> bool:
        """A pass remembered at `path`, younger than `PROBE_TTL_S` (a torn or foreign file is set
        aside, and the store probed again)."""
        doc = statefile.read_json(
            path,
            lambda d: d.get("schema") == PROBE_SCHEMA and isinstance(d.get("passed_at"), int | float),
            "remembered store probe",
        )
        return doc is not None and 0 <= time.time() - float(doc["passed_at"]) < PROBE_TTL_S


def _install_fault(client: Any, mode: str) -> None:
    """Test-only: fail (or kill this process) when the second part of an upload is sent."""
    seen = {"parts": 0}
    lock = threading.Lock()

    def on_part(**_: Any) -> None:
        with lock:
            seen["parts"] += 1
            hit = seen["parts"] == 2
        if hit and mode == "kill-after-part":
            os.kill(os.getpid(), signal.SIGKILL)
        if hit and mode == "fail-after-part":
            raise RuntimeError(f"injected fault ({FAULT_ENV}={mode})")

    client.meta.events.register("before-call.s3.UploadPart", on_part)
