"""What the shared store does when the S3 server fails under it: a SeaweedFS of its own killed
(SIGKILL) between the parts of a multipart upload and restarted on its data, and, through the
loopback proxy in front of each server of the `s3` fixture, stretches of 503 SlowDown answers and
connections reset mid-transfer. A short stretch is ridden out by botocore's bounded retries; a long
one is `remote-unavailable` after them. Either way no ref names a missing or partial object, the
artifact stays in the local cache, and the next publish publishes it.

Every test works under its own prefix of one bucket (`prefix_of`).
"""

from __future__ import annotations

import io
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import seaweedfs
from support.s3 import BUCKET, S3, Proxy, behind_proxy, use_endpoint
from support.shared import artifact, new_key, prefix_of, shared_at

from cgbuild.core.canon import sha256_file
from cgbuild.core.errors import UserError
from cgbuild.store.remote_gc import collect
from cgbuild.store.s3 import MIN_PART, Remote, RemoteError
from cgbuild.store.shared import SharedStore

ATTEMPTS = 3
"""botocore's standard retry mode: each request is tried at most three times."""
FAULTS = ("slow_down", "reset")


def _every_ref_names_its_whole_object(remote: Remote) -> set[str]:
    """The keys with a ref, each checked: its object downloads whole, as the bytes it names."""
    listed = remote.list_keys()
    for key in listed:
        ref = remote.get_json(remote.ref_name(key))
        assert ref is not None, key
        got = remote.download(ref.doc["object"], io.BytesIO())
        assert got == (ref.doc["object"], ref.doc["size"]), key
    return listed


def _publisher(tmp_path: Path, keys: dict[str, tuple[Path, str]], prefix: str) -> SharedStore:
    """A machine that has probed the store, publishing parts of `MIN_PART` bytes."""
    shared = shared_at(tmp_path / "a", prefix, keys)
    shared.check_publishable()
    shared.remote.multipart_threshold = MIN_PART
    return shared


@pytest.fixture
def proxied(
    s3: S3, tmp_path: Path, keys: dict[str, tuple[Path, str]], signing: None, request: pytest.FixtureRequest
) -> Iterator[tuple[Proxy, SharedStore]]:
    """(a proxy in front of the store, no fault set yet; a publisher that has probed through it)."""
    legacy = {"AWS_RETRY_MODE": "legacy"}  # cgbuild's client keeps standard mode's bound
    with behind_proxy(s3, legacy) as proxy:
        yield proxy, _publisher(tmp_path, keys, prefix_of(request))


def _reader(tmp_path: Path, keys: dict[str, tuple[Path, str]], shared: SharedStore) -> SharedStore:
    """Another machine on the publisher's store."""
    prefix = shared.remote.prefix.rstrip("/")
    return shared_at(tmp_path / "b", prefix, keys, host="host-b")


@pytest.mark.parametrize("fault", FAULTS)
def test_a_short_stretch_of_faults_is_ridden_out_by_retries(
    proxied: tuple[Proxy, SharedStore], tmp_path: Path, keys: dict[str, tuple[Path, str]], fault: str
) -> None:
    """Two answers of 503 SlowDown, or two parts cut off mid-body, are retried by botocore: the
    publish goes through and another machine reads the whole object."""
    proxy, shared = proxied
    key, art = new_key(), artifact(tmp_path, 11 << 20)  # three parts
    setattr(proxy, fault, 2)
    assert shared.admit(key, art, metadata={}).status == "admitted"
    assert getattr(proxy, fault) == 0  # both were met
    assert _reader(tmp_path, keys, shared).resolve(key).path.read_bytes() == art.read_bytes()
    assert _every_ref_names_its_whole_object(shared.remote) == {key}


def _attempts(proxy: Proxy, fault: str) -> int:
    """How often the request the stretch failed was tried: the object's HEAD (SlowDown answers
    every request), or the part tried most often (a reset meets only requests with a body)."""
    if fault == "slow_down":
        assert {m for m, _ in proxy.log} == {"HEAD"}  # nothing after the first request gave up
        return len(proxy.log)
    parts = Counter(p.split("partNumber=")[1].split("&")[0] for m, p in proxy.log if "partNumber=" in p)
    return max(parts.values())


@pytest.mark.parametrize("fault", FAULTS)
def test_a_long_stretch_of_faults_is_remote_unavailable_and_the_next_publish_publishes(
    proxied: tuple[Proxy, SharedStore], tmp_path: Path, keys: dict[str, tuple[Path, str]], fault: str
) -> None:
    """Past botocore's bound (three attempts a request, with backoff) the publish is one typed error,
    `remote-unavailable` (a UserError: one line, exit 2 where a command raises it; a retryable
    failure of the key in a mint). The artifact stays admitted in the local cache, the plan reads
    it fresh from there, no ref or object or upload is left in the store, and once the store
    answers again the next publish publishes it."""
    proxy, shared = proxied
    key, art = new_key(), artifact(tmp_path, 11 << 20)
    proxy.log.clear()
    setattr(proxy, fault, 10**6)
    with pytest.raises(RemoteError) as info:
        shared.admit(key, art, metadata={})
    assert isinstance(info.value, UserError) and info.value.field == "workspace.remote"
    assert info.value.code == "remote-unavailable", info.value.detail
    if fault == "slow_down":  # a HEAD answer has no body: botocore names its status
        assert f"(503) when calling the HeadObject operation (reached max retries: {ATTEMPTS - 1})" in (
            info.value.detail
        )
    assert _attempts(proxy, fault) == ATTEMPTS
    setattr(proxy, fault, 0)
    sha = sha256_file(str(art))
    assert shared.local.ref_state(key) == "fresh" and shared.local.resolve(key).ref.object == sha
    assert shared.ref_state(key) == "fresh" and shared.unpublished({key}) == [key]
    assert _every_ref_names_its_whole_object(shared.remote) == set()
    assert not list(shared.remote.list_names("objects"))
    assert shared.remote.list_uploads("objects")[1] == []  # a failed upload is aborted
    assert shared.republish(key) == ("admitted", sha)
    assert _reader(tmp_path, keys, shared).resolve(key).path.read_bytes() == art.read_bytes()


def _crash_after_first_part(shared: SharedStore, servers: list[seaweedfs.Server]) -> None:
    """Hooks on the publisher's client: the first part to go up completes, then the server's whole
    process group (`servers[-1]`) is SIGKILLed and started again on its folder and ports (appended
    to `servers`), and only then are the other parts sent. Nothing waits for it to be ready: the
    publish meets the restart as a client of a crashed server would."""
    crashed, lock = threading.Event(), threading.Lock()
    first: list[int] = []

    def before(**_: Any) -> None:
        with lock:
            if not first:
                first.append(threading.get_ident())
                return
        assert crashed.wait(timeout=60)

    def after(**_: Any) -> None:
        if first == [threading.get_ident()] and not crashed.is_set():
            servers[-1].kill()
            servers.append(seaweedfs.restart(servers[-1]))
            crashed.set()

    events = shared.remote.client.meta.events
    events.register("before-call.s3.UploadPart", before)
    events.register("after-call.s3.UploadPart", after)


def test_a_server_killed_between_parts_and_restarted_keeps_no_partial_object(
    tmp_path: Path,
    keys: dict[str, tuple[Path, str]],
    signing: None,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    """SeaweedFS SIGKILLed after one part of a 16 MiB object and restarted on the same data and
    ports. botocore's retries (three attempts within a fraction of a second) do not outlast the
    restart (a few seconds), so the publish fails typed, `remote-unavailable`, and the abort cannot
    reach the server either: the incomplete upload stays, invisible as an object. No ref names a
    missing or partial object, the artifact stays in the local cache, the next publish publishes
    it whole, and `gc --remote` aborts the upload left behind."""
    servers = [seaweedfs.start(tmp_path / "weed")]
    try:
        seaweedfs.wait_ready(servers[0], BUCKET)
        use_endpoint(monkeypatch, f"http://127.0.0.1:{servers[0].port}", tmp_path)
        shared = _publisher(tmp_path, keys, prefix_of(request))
        before_key = new_key()
        assert shared.admit(before_key, artifact(tmp_path), metadata={}).status == "admitted"
        _crash_after_first_part(shared, servers)
        key, art = new_key(), artifact(tmp_path, 16 << 20)  # four parts
        with pytest.raises(RemoteError) as info:
            shared.admit(key, art, metadata={})
        assert info.value.code == "remote-unavailable", info.value.detail
        assert len(servers) == 2  # killed and restarted once, between the parts
        before = shared.remote.object_name(shared.local.read_ref(before_key).object)  # type: ignore[union-attr]
        seaweedfs.wait_ready(servers[-1], BUCKET, reads=[before])
        assert _every_ref_names_its_whole_object(shared.remote) == {before_key}
        sha = sha256_file(str(art))
        assert list(shared.remote.list_names("objects/sha256")) == [before.rsplit("/", 1)[1]]
        assert [u[0] for u in shared.remote.list_uploads("objects/sha256")[1]] == [sha]
        assert shared.local.ref_state(key) == "fresh" and shared.unpublished({key}) == [key]
        assert shared.republish(key) == ("admitted", sha)
        assert _every_ref_names_its_whole_object(shared.remote) == {before_key, key}
        assert _reader(tmp_path, keys, shared).resolve(key).path.read_bytes() == art.read_bytes()
        assert collect(shared, grace_s=0).uploads_aborted == [sha]
    finally:
        servers[-1].stop()
