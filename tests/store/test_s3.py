"""The S3 backend (`cgbuild.store.s3.Remote`) against each real S3 server of the `s3` fixture (moto,
SeaweedFS) on loopback, through the shared store that drives it: listings batched by the thousand,
create-only writes probed (in turn and at once, a pass remembered), large objects in parts,
interrupted uploads that leave nothing, and a bucket that refuses, is unreachable, has no
credentials, drops a download or holds an overwritten object, each one named error.

Every test works under its own prefix of one bucket (`prefix_of`).
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support.s3 import BUCKET, S3, behind_proxy, child_env
from support.shared import artifact, new_key, overwrite_flipped, prefix_of, publish_one, shared_at

from cgbuild.core.errors import UserError
from cgbuild.store.local import Store
from cgbuild.store.s3 import FAULT_ENV, MULTIPART_ENV, PROBE_TTL_S, Remote, RemoteError
from cgbuild.store.shared import SharedStore
from cgbuild.store.trust import SIGNING_KEY_ENV


def test_remote_keys_read_fresh_with_one_listing_per_thousand(
    s3: S3, tmp_path: Path, keys: dict[str, tuple[Path, str]], request: pytest.FixtureRequest
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    prefix = prefix_of(request)
    writer = Remote(f"s3://{BUCKET}/{prefix}")
    names = [new_key() for _ in range(2100)]
    with ThreadPoolExecutor(16) as pool:
        assert all(pool.map(lambda k: writer.create(writer.ref_name(k), b"{}"), names))
    shared = shared_at(tmp_path / "store", prefix, keys)
    calls: list[str] = []
    shared.remote.client.meta.events.register("before-call.s3", lambda model, **_: calls.append(model.name))
    assert {shared.ref_state(k) for k in names} == {"fresh"}
    assert shared.ref_state(new_key()) == "missing"
    assert calls == ["ListObjectsV2"] * 3  # 2,100 keys: three pages, no per-key request


def test_the_server_takes_writes_in_every_bucket_a_test_makes(s3: S3, request: pytest.FixtureRequest) -> None:
    """Suites make buckets of their own (the probe memo's second bucket); a server that runs out
    of volumes after two answers InternalError to every write in a third (SeaweedFS's default)."""
    for n in range(4):
        s3.bucket(f"{BUCKET}-many-{n}", timeout=10.0)
        s3.client().put_object(Bucket=f"{BUCKET}-many-{n}", Key=f"{prefix_of(request)}/x", Body=b"x")


@pytest.mark.parametrize(
    ("mode", "code", "needle"),
    [
        ("strip_if_none_match", "no-conditional-write", "in turn"),  # the header is dropped
        ("racy_create", "racy-conditional-write", "at once"),  # honoured in turn, not at once
    ],
)
def test_a_store_without_atomic_create_only_writes_is_refused(
    s3: S3,
    tmp_path: Path,
    keys: dict[str, tuple[Path, str]],
    signing: None,
    request: pytest.FixtureRequest,
    mode: str,
    code: str,
    needle: str,
) -> None:
    """The probe's sequential pair catches a store that ignores If-None-Match; only its concurrent
    pair catches one that checks it and then writes without a lock. Either is refused by name,
    with the endpoint, before anything is admitted, and leaves no scratch object and no memo."""
    with behind_proxy(s3, **{mode: True}) as proxy:
        probes = tmp_path / "probes"
        shared = shared_at(tmp_path / "s", prefix_of(request), keys, probes=probes)
        with pytest.raises(RemoteError) as info:
            shared.admit(new_key(), artifact(tmp_path), metadata={})
        assert isinstance(info.value, UserError) and info.value.code == code
        assert proxy.url in info.value.detail and "If-None-Match" in info.value.detail
        assert needle in info.value.detail
        assert not list(shared.remote.list_names("refs")) and not list(shared.local.iter_refs())
        assert not list(shared.remote.list_names("probe"))  # the probe cleans up after itself
        assert not probes.exists()  # a failure is not remembered


def test_a_passed_probe_is_remembered_per_endpoint_bucket_and_prefix(
    s3: S3, tmp_path: Path, keys: dict[str, tuple[Path, str]], signing: None, request: pytest.FixtureRequest
) -> None:
    """A later process on the same store does not probe again within the TTL; another prefix,
    another bucket, another endpoint in front of the same bucket or a stale memo are probed afresh."""
    prefix, probes = prefix_of(request), tmp_path / "probes"
    other_bucket = f"{BUCKET}-other"
    s3.bucket(other_bucket)

    def probe_puts(url: str) -> int:
        """How many create-only writes a new process's check made under probe/."""
        shared = SharedStore(Store(tmp_path / secrets.token_hex(3)), Remote(url), {}, "h", probes)
        puts: list[str] = []
        shared.remote.client.meta.events.register(
            "provide-client-params.s3.PutObject", lambda params, **_: puts.append(params["Key"])
        )
        shared.check_publishable()
        return sum("/probe/" in p for p in puts)

    url = f"s3://{BUCKET}/{prefix}"
    assert probe_puts(url) == 4  # two in turn, two at once
    (memo,) = probes.glob("*.json")
    assert probe_puts(url) == 0
    assert probe_puts(f"{url}-other") == 4 and probe_puts(f"s3://{other_bucket}/{prefix}") == 4
    assert len(list(probes.glob("*.json"))) == 3
    doc = json.loads(memo.read_text())
    memo.write_text(json.dumps({**doc, "passed_at": time.time() - PROBE_TTL_S - 1}))
    assert probe_puts(url) == 4 and probe_puts(url) == 0
    with behind_proxy(s3, strip_if_none_match=True), pytest.raises(RemoteError) as info:
        probe_puts(url)
    assert info.value.code == "no-conditional-write" and len(list(probes.glob("*.json"))) == 3


def test_large_objects_upload_in_parts(
    s3: S3, tmp_path: Path, keys: dict[str, tuple[Path, str]], signing: None, request: pytest.FixtureRequest
) -> None:
    shared = shared_at(tmp_path / "s", prefix_of(request), keys)
    shared.remote.multipart_threshold = 1 << 20
    key = new_key()
    shared.admit(key, artifact(tmp_path, 6 << 20), metadata={})
    sha = shared.local.read_ref(key).object  # type: ignore[union-attr]
    head = s3.client().head_object(Bucket=BUCKET, Key=shared.remote.object_name(sha))
    assert head["ETag"].strip('"').endswith("-2")  # a multipart ETag: two parts


_KILLED_UPLOAD = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from cgbuild.store.s3 import Remote
    from cgbuild.store.shared import SharedStore
    from cgbuild.store.local import Store
    from cgbuild.store.trust import public_key_bytes
    name, _, pub = sys.argv[3].partition(":")
    shared = SharedStore(Store(sys.argv[1]), Remote(sys.argv[2]), {name: public_key_bytes(pub)}, "h")
    shared.admit(sys.argv[4], Path(sys.argv[5]), metadata={})
    """
)


@pytest.mark.parametrize("mode", ["fail-after-part", "kill-after-part"])
def test_an_interrupted_upload_leaves_nothing_under_the_key(
    s3: S3, tmp_path: Path, keys: dict[str, tuple[Path, str]], mode: str, request: pytest.FixtureRequest
) -> None:
    prefix = prefix_of(request)
    key, art = new_key(), artifact(tmp_path, 11 << 20)
    env = child_env(s3, **{SIGNING_KEY_ENV: str(keys["ci"][0]), FAULT_ENV: mode, MULTIPART_ENV: str(1 << 20)})
    args = [tmp_path / "s", f"s3://{BUCKET}/{prefix}", keys["ci"][1], key, art]
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_UPLOAD, *map(str, args)], env=env, capture_output=True, text=True
    )
    if mode == "kill-after-part":
        assert proc.returncode == -9, proc.stderr
    else:
        assert proc.returncode == 1 and "upload-failed" in proc.stderr and "injected fault" in proc.stderr
    remote = Remote(f"s3://{BUCKET}/{prefix}")
    assert remote.get_json(remote.ref_name(key)) is None
    assert list(remote.list_names("objects")) == []  # no object, whole or torn, is visible
    uploads = s3.client().list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])
    assert len(uploads) == (1 if mode == "kill-after-part" else 0)  # a failure aborts; a kill cannot


def test_a_connection_lost_mid_download_is_not_corruption(
    s3: S3, tmp_path: Path, keys: dict[str, tuple[Path, str]], signing: None, request: pytest.FixtureRequest
) -> None:
    """Half a body then a dropped connection is the network, not the object: the pull fails as
    `remote-unavailable`, and the key is neither cached nor quarantined in the shared store."""
    prefix, a, key, _ = publish_one(tmp_path, keys, request)
    with behind_proxy(s3, cut="/objects/"):
        b = shared_at(tmp_path / "b", prefix, keys)
        with pytest.raises(RemoteError) as info:
            b.pull(key)
    assert info.value.code == "remote-unavailable"
    assert b.local.read_ref(key) is None
    assert key in a.remote.list_keys() and not a.quarantine_records(key)


def test_a_listing_the_store_refuses_is_one_named_error(s3: S3, keys: dict[str, tuple[Path, str]]) -> None:
    missing = Remote(f"s3://no-such-bucket-{secrets.token_hex(3)}/p")
    with pytest.raises(RemoteError) as info:
        missing.list_keys()
    assert info.value.code == "remote-error" and "NoSuchBucket" in info.value.detail


def test_no_credentials_is_one_named_error(s3: S3, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookups here
    with pytest.raises(RemoteError) as info:
        Remote(f"s3://{BUCKET}/p").list_keys()
    assert info.value.code == "no-credentials"


def test_an_object_overwritten_in_place_is_uploaded_again_not_trusted(
    s3: S3, tmp_path: Path, keys: dict[str, tuple[Path, str]], signing: None, request: pytest.FixtureRequest
) -> None:
    prefix, a, key, art = publish_one(tmp_path, keys, request)
    sha = overwrite_flipped(s3, a, key, art, 7)  # it must not pass for the object
    assert not a.remote.has_object(sha, art.stat().st_size)
    other = new_key()
    assert shared_at(tmp_path / "b", prefix, keys).admit(other, art, metadata={}).status == "admitted"
    assert shared_at(tmp_path / "c", prefix, keys).resolve(other).path.read_bytes() == art.read_bytes()


def test_unreachable_remote_is_one_named_error(tmp_path: Path, keys: dict[str, tuple[Path, str]]) -> None:
    env = {
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
        "AWS_MAX_ATTEMPTS": "1",
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "x",
    }
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        shared = shared_at(tmp_path / "s", "x", keys)
        with pytest.raises(RemoteError) as info:
            shared.remote_keys()
    assert info.value.code == "remote-unavailable" and info.value.field == "workspace.remote"
    assert isinstance(info.value, UserError)
