"""The shared, signed S3 store against a real S3 HTTP server (moto's server mode) on loopback.

Every test works under its own prefix of one bucket. Fast tests exercise `SharedStore` with small
artifacts; the `slow` ones mint one real toy artifact through the CLI and reuse it for the clean
clone, `fetch` and real adopt refusals.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from s3server import BUCKET, S3, Proxy, child_env, keypair, serve

from cgbuild.config import cgfile
from cgbuild.core.canon import canonical_json
from cgbuild.core.errors import UserError
from cgbuild.store.local import Corrupt, Store, StoreError
from cgbuild.store.s3 import FAULT_ENV, MULTIPART_ENV, Remote, RemoteError
from cgbuild.store.shared import SEEN_TTL_S, PublishRefused, SharedStore, Untrusted
from cgbuild.store.trust import SIGNING_KEY_ENV, TrustError, load_signer, public_key_bytes

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3]:
    """A real S3 endpoint on loopback for the whole session."""
    yield from serve(tmp_path_factory)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """Two publishers: `ci` (trusted by the workspaces here) and `stranger` (trusted by none)."""
    folder = tmp_path_factory.mktemp("keys")
    return {name: keypair(folder, name) for name in ("ci", "stranger")}


def trusted(*entries: str) -> dict[str, bytes]:
    return {e.split(":")[0]: public_key_bytes(e.split(":", 1)[1]) for e in entries}


def shared_at(
    root: Path, prefix: str, keys: dict[str, tuple[Path, str]], host: str = "host-a"
) -> SharedStore:
    return SharedStore(Store(root), Remote(f"s3://{BUCKET}/{prefix}"), trusted(keys["ci"][1]), host)


def artifact(folder: Path, size: int = 4096) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{secrets.token_hex(4)}.bin"
    path.write_bytes(secrets.token_bytes(size))
    return path


def new_key() -> str:
    return secrets.token_hex(32)


@pytest.fixture
def signing(keys: dict[str, tuple[Path, str]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SIGNING_KEY_ENV, str(keys["ci"][0]))


def prefix_of(request: pytest.FixtureRequest) -> str:
    return request.node.name.replace("[", "-").replace("]", "")[:60] + "-" + secrets.token_hex(3)


def publish_one(
    tmp_path: Path, keys: dict[str, tuple[Path, str]], request: pytest.FixtureRequest, host: str = "host-a"
) -> tuple[str, SharedStore, str, Path]:
    """(prefix, the publisher's shared store, key, artifact): one small artifact, admitted."""
    prefix = prefix_of(request)
    a = shared_at(tmp_path / "a", prefix, keys, host=host)
    key, art = new_key(), artifact(tmp_path)
    assert a.admit(key, art, metadata={"labels": ["//t"]}).status == "admitted"
    return prefix, a, key, art


# ---- Cgfile ------------------------------------------------------------------------------------
CGFILE = """\
[workspace]
{workspace}

[sku.cpu]
sm = "cpu"
memory_gib = 4

[layout.fp32]
quant = "plain.fp32"

[family.t]
entry = "m:build"
skus = ["cpu"]
layouts = ["fp32"]

[family.t.module.mlp]
shapes = ["8x64"]
"""


def load_ws(tmp_path: Path, workspace: str) -> cgfile.Cgfile:
    path = tmp_path / "Cgfile"
    path.write_text(CGFILE.format(workspace=workspace))
    return cgfile.load(path)


def test_cgfile_declares_remote_and_trusted_keys(tmp_path: Path, keys: dict[str, tuple[Path, str]]) -> None:
    entry = keys["ci"][1]
    cg = load_ws(tmp_path, f'remote = "s3://my-bucket/cg/main/"\ntrusted = ["{entry}"]')
    assert cg.remote == "s3://my-bucket/cg/main" and set(cg.trusted) == {"ci"}
    plain = load_ws(tmp_path, 'state = ".cgbuild"')
    assert plain.remote is None and plain.trusted == {}


@pytest.mark.parametrize(
    ("workspace", "line", "field", "needle"),
    [
        ('remote = "s3://B/x"\ntrusted = ["{e}"]', 2, "workspace.remote", "bad remote"),
        ('remote = "https://x/y"\ntrusted = ["{e}"]', 2, "workspace.remote", "bad remote"),
        ('remote = "s3://bucket/x"', 2, "workspace.remote", "needs trusted publisher keys"),
        ('trusted = ["{e}"]', 2, "workspace.trusted", "without a remote"),
        ('remote = "s3://bucket/x"\ntrusted = ["nocolon"]', 3, "workspace.trusted", "expected 'name:"),
        ('remote = "s3://bucket/x"\ntrusted = ["ci:AAAA"]', 3, "workspace.trusted", "32 bytes"),
        ('remote = "s3://bucket/x"\ntrusted = ["ci:%%%"]', 3, "workspace.trusted", "not base64"),
        ('remote = "s3://bucket/x"\ntrusted = ["Bad Name:{k}"]', 3, "workspace.trusted", "bad name"),
        ('remote = "s3://bucket/x"\ntrusted = ["{e}", "{e}"]', 3, "workspace.trusted", "duplicate"),
        ('remote = "s3://bucket/x"\ntrusted = "{e}"', 3, "workspace.trusted", "expected an array"),
    ],
)
def test_cgfile_shared_store_errors_name_file_line_field(
    tmp_path: Path, keys: dict[str, tuple[Path, str]], workspace: str, line: int, field: str, needle: str
) -> None:
    entry = keys["ci"][1]
    with pytest.raises(UserError) as info:
        load_ws(tmp_path, workspace.format(e=entry, k=entry.split(":", 1)[1]))
    e = info.value
    assert (e.line, e.field) == (line, field) and needle in e.message, str(e)
    assert e.file and e.file.endswith("Cgfile")


# ---- keys and signatures -----------------------------------------------------------------------
def test_keygen_cli_writes_a_pair_and_never_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "pub.pem"
    run = [sys.executable, "-m", "cgbuild.cli", "trust", "keygen", str(path), "--name", "ci-1", "--json"]
    out = subprocess.run(run, capture_output=True, text=True, check=True)
    line = json.loads(out.stdout)["trusted"]
    assert line.startswith("ci-1:") and (path.stat().st_mode & 0o777) == 0o600
    assert Path(f"{path}.pub").read_text().strip() == line
    signer = load_signer({SIGNING_KEY_ENV: str(path)})
    assert signer is not None and public_key_bytes(line.split(":", 1)[1]) == signer.public
    again = subprocess.run(run, capture_output=True, text=True)
    assert again.returncode == 2 and "never overwritten" in again.stderr and "Traceback" not in again.stderr


def test_signing_key_loads_from_raw_bytes_and_refuses_other_files(tmp_path: Path) -> None:
    pem = load_signer({SIGNING_KEY_ENV: str(keypair(tmp_path, "a")[0])})
    assert pem is not None
    raw = tmp_path / "raw.key"
    raw.write_bytes(pem.private.private_bytes_raw())
    assert load_signer({SIGNING_KEY_ENV: str(raw)}).public == pem.public  # type: ignore[union-attr]
    junk = tmp_path / "junk.pem"
    junk.write_text("not a key")
    with pytest.raises(ValueError, match="not an ed25519 private key"):
        load_signer({SIGNING_KEY_ENV: str(junk)})
    assert load_signer({}) is None


# ---- plan: listing -----------------------------------------------------------------------------
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


def test_a_remembered_listing_serves_the_next_plan_less_quarantined_keys(
    s3: S3, tmp_path: Path, keys: dict[str, tuple[Path, str]], request: pytest.FixtureRequest
) -> None:
    """Refs are create-only and cgbuild removes one only by quarantine: a later process reads the
    remembered listing and lists `quarantine/` instead of `refs/`, within the TTL."""
    prefix = prefix_of(request)
    writer = Remote(f"s3://{BUCKET}/{prefix}")
    names = [new_key() for _ in range(4)]
    for k in names:
        assert writer.create(writer.ref_name(k), json.dumps({"key": k, "object": "0" * 64}).encode())
    cache = tmp_path / "store"
    assert shared_at(cache, prefix, keys).ref_state(names[0]) == "fresh"  # lists refs/, remembers

    def process() -> tuple[SharedStore, list[str]]:
        shared, calls = shared_at(cache, prefix, keys), []
        shared.remote.client.meta.events.register(
            "provide-client-params.s3.ListObjectsV2", lambda params, **_: calls.append(params["Prefix"])
        )
        return shared, calls

    warm, calls = process()
    assert {warm.ref_state(k) for k in names} == {"fresh"} and warm.ref_state(new_key()) == "missing"
    assert [c.rsplit("/", 2)[-2] for c in calls] == ["quarantine", "refs"]  # refs/ only for the unknown key
    warm, calls = process()
    assert {warm.ref_state(k) for k in names} == {"fresh"} and [c.rsplit("/", 2)[-2] for c in calls] == [
        "quarantine"
    ]
    # another machine quarantines one key: the remembered listing no longer vouches for it
    other = shared_at(tmp_path / "other", prefix, keys, host="host-b")
    seen = other.remote.get_json(other.remote.ref_name(names[1]))
    assert seen is not None
    other.quarantine_remote(names[1], seen, "bad bytes")
    after, _ = process()
    assert after.ref_state(names[1]) == "missing" and after.ref_state(names[2]) == "fresh"
    # past the TTL the listing is taken again; a torn file is no listing at all
    remembered = next((cache / "remote").glob("*.json"))
    doc = json.loads(remembered.read_text())
    remembered.write_text(json.dumps({**doc, "listed_at": time.time() - SEEN_TTL_S - 1}))
    stale, calls = process()
    assert stale.ref_state(names[2]) == "fresh" and [c.rsplit("/", 2)[-2] for c in calls] == ["refs"]
    for torn_text in ("{torn", json.dumps({**doc, "listed_at": "yesterday"})):
        remembered.write_text(torn_text)
        torn, calls = process()
        assert torn.ref_state(names[3]) == "fresh" and [c.rsplit("/", 2)[-2] for c in calls] == ["refs"]


# ---- publish, pull, trust ----------------------------------------------------------------------
def test_publish_then_pull_verifies_and_keeps_the_signature_locally(
    s3: S3, tmp_path: Path, keys: dict[str, tuple[Path, str]], signing: None, request: pytest.FixtureRequest
) -> None:
    prefix, a, key, art = publish_one(tmp_path, keys, request)
    assert a.admit(key, art, metadata={"labels": ["//t"]}).status == "already"
    b = shared_at(tmp_path / "b", prefix, keys, host="host-b")
    assert b.local.ref_state(key) == "missing" and b.ref_state(key) == "fresh"
    got = b.resolve(key)
    assert got.path.read_bytes() == art.read_bytes()
    ref = b.local.read_ref(key)
    assert ref is not None and ref.metadata["signature"]["key_id"] and ref.metadata["labels"] == ["//t"]
    # the cache's ref is re-verified on every resolve: a swapped local ref is caught
    other = new_key()
    assert b.local.admit(other, artifact(tmp_path)).ok
    path = b.local.ref_path(key)
    doc = json.loads(path.read_text())
    doc["object"] = b.local.read_ref(other).object  # type: ignore[union-attr]
    os.chmod(path, 0o644)
    path.write_text(canonical_json(doc))
    with pytest.raises(Untrusted) as info:
        b.resolve(key)
    assert info.value.code == "bad-signature"


def _forge(shared: SharedStore, key: str, art: Path, signature: Any, *, size: int | None = None) -> None:
    """Put `art` and a ref for it with this signature record, straight through the S3 API."""
    from cgbuild.core.canon import sha256_file

    sha = sha256_file(str(art))
    shared.remote.upload(art, sha)
    doc = {"schema": "cgbuild.remote-ref/1", "key": key, "object": sha, "size": size or art.stat().st_size}
    if signature is not None:
        doc["signature"] = signature
    assert shared.remote.create(shared.remote.ref_name(key), canonical_json(doc).encode())


@pytest.mark.parametrize("case", ["unsigned", "unknown-signer", "bad-signature", "swapped-object"])
def test_untrusted_remote_artifacts_are_refused_and_never_cached(
    s3: S3, tmp_path: Path, keys: dict[str, tuple[Path, str]], case: str, request: pytest.FixtureRequest
) -> None:
    from cgbuild.core.canon import sha256_file
    from cgbuild.store import trust

    shared = shared_at(tmp_path / "s", prefix_of(request), keys)
    key, art = new_key(), artifact(tmp_path)
    sha, size = sha256_file(str(art)), art.stat().st_size
    ci = load_signer({SIGNING_KEY_ENV: str(keys["ci"][0])})
    stranger = load_signer({SIGNING_KEY_ENV: str(keys["stranger"][0])})
    assert ci and stranger
    signature = {
        "unsigned": None,
        "unknown-signer": stranger.sign(trust.artifact_statement(key, sha, size)),
        "bad-signature": ci.sign(trust.artifact_statement(new_key(), sha, size)),  # another key's
        "swapped-object": ci.sign(trust.artifact_statement(key, "0" * 64, size)),  # other bytes'
    }[case]
    _forge(shared, key, art, signature)
    with pytest.raises(Untrusted) as info:
        shared.resolve(key)
    assert info.value.code == ("bad-signature" if case == "swapped-object" else case)
    assert shared.local.read_ref(key) is None and not shared.local.object_path(sha).exists()


def test_corrupt_remote_object_is_retried_then_quarantined_and_repaired(
    s3: S3, tmp_path: Path, keys: dict[str, tuple[Path, str]], signing: None, request: pytest.FixtureRequest
) -> None:
    prefix, a, key, art = publish_one(tmp_path, keys, request)
    sha = a.local.read_ref(key).object  # type: ignore[union-attr]
    bad = bytearray(art.read_bytes())
    bad[100] ^= 0xFF
    s3.client().put_object(Bucket=BUCKET, Key=a.remote.object_name(sha), Body=bytes(bad))
    b = shared_at(tmp_path / "b", prefix, keys, host="host-b")
    gets: list[str] = []
    b.remote.client.meta.events.register(
        "provide-client-params.s3.GetObject", lambda params, **_: gets.append(params["Key"])
    )
    with pytest.raises(Corrupt, match="quarantined"):
        b.resolve(key)
    assert gets.count(b.remote.object_name(sha)) == 2  # retried once before judging
    assert b.local.read_ref(key) is None and not b.local.object_path(sha).exists()
    assert b.remote.get_json(b.remote.ref_name(key)) is None  # the ref is gone: plan says mint
    assert key not in shared_at(tmp_path / "c", prefix, keys).remote_keys()
    (record,) = b.quarantine_records(key)
    assert record["ref"]["object"] == sha and "downloaded twice" in record["reason"]
    # a new verified mint (same bytes) repairs it: the object is uploaded again, not trusted stale
    assert shared_at(tmp_path / "d", prefix, keys).admit(key, art, metadata={}).status == "admitted"
    assert shared_at(tmp_path / "e", prefix, keys).resolve(key).path.read_bytes() == art.read_bytes()


def test_quarantine_leaves_a_ref_that_was_already_repaired(
    s3: S3, tmp_path: Path, keys: dict[str, tuple[Path, str]], signing: None, request: pytest.FixtureRequest
) -> None:
    prefix, a, key, _ = publish_one(tmp_path, keys, request)
    seen = a.remote.get_json(a.remote.ref_name(key))
    assert seen is not None
    a.remote.delete(a.remote.ref_name(key))  # another fetcher quarantined it, a new mint repaired it
    assert shared_at(tmp_path / "b", prefix, keys).admit(key, artifact(tmp_path), metadata={}).ok
    a.quarantine_remote(key, seen, "judged on the old ref")
    assert a.remote.get_json(a.remote.ref_name(key)) is not None


# ---- mint-once across machines -----------------------------------------------------------------
def test_concurrent_publishers_of_one_key_admit_exactly_one(
    s3: S3, tmp_path: Path, keys: dict[str, tuple[Path, str]], signing: None, request: pytest.FixtureRequest
) -> None:
    prefix = prefix_of(request)
    machines = [shared_at(tmp_path / f"m{i}", prefix, keys, host=f"m{i}") for i in range(2)]
    for m in machines:
        m.check_publishable()
    names = [new_key() for _ in range(6)]
    arts = {(i, k): artifact(tmp_path / f"a{i}") for i in range(2) for k in names}
    barrier = threading.Barrier(2)
    results: dict[tuple[int, str], Any] = {}

    def publish(i: int) -> None:
        for k in names:
            barrier.wait()
            results[i, k] = machines[i].admit(k, arts[i, k], metadata={})

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in names:
        pair = sorted((results[0, k].status, results[1, k].status))
        assert pair == ["admitted", "conflict"], (k, pair)
        winner, loser = (0, 1) if results[0, k].status == "admitted" else (1, 0)
        assert results[loser, k].existing == results[winner, k].object  # the loser is told which
        assert machines[loser].local.ref_state(k) == "quarantined"  # and its cache does not diverge
        assert machines[loser].resolve(k).path.read_bytes() == arts[winner, k].read_bytes()


def test_a_store_without_create_only_writes_is_refused(
    s3: S3,
    tmp_path: Path,
    keys: dict[str, tuple[Path, str]],
    signing: None,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    proxy = Proxy(s3.upstream, strip_if_none_match=True).start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        shared = shared_at(tmp_path / "s", prefix_of(request), keys)
        with pytest.raises(PublishRefused) as info:
            shared.admit(new_key(), artifact(tmp_path), metadata={})
        assert info.value.code == "no-conditional-write" and "If-None-Match" in info.value.detail
        assert not list(shared.remote.list_names("refs")) and not list(shared.local.iter_refs())
        assert not list(shared.remote.list_names("probe"))  # the probe cleans up after itself
    finally:
        proxy.stop()


def test_a_ref_that_exists_for_the_writer_but_never_for_a_reader_gives_up(
    s3: S3,
    tmp_path: Path,
    keys: dict[str, tuple[Path, str]],
    signing: None,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    """Each refused create reads the standing ref; one that keeps vanishing is an error after three
    tries, not a loop, and the key stays unpublished in the cache (the next mint republishes it)."""
    proxy = Proxy(s3.upstream, refuse_create="/refs/").start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        shared = shared_at(tmp_path / "s", prefix_of(request), keys)
        key = new_key()
        with pytest.raises(RemoteError, match="ref kept vanishing"):
            shared.admit(key, artifact(tmp_path), metadata={})
        assert len(proxy.requests("PUT", f"/refs/{key}")) == 3
        assert shared.local.ref_state(key) == "fresh" and shared.unpublished({key}) == [key]
    finally:
        proxy.stop()


def test_publishing_without_a_signing_key_is_refused(
    s3: S3,
    tmp_path: Path,
    keys: dict[str, tuple[Path, str]],
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    monkeypatch.delenv(SIGNING_KEY_ENV, raising=False)
    shared = shared_at(tmp_path / "s", prefix_of(request), keys)
    with pytest.raises(PublishRefused) as info:
        shared.admit(new_key(), artifact(tmp_path), metadata={})
    assert info.value.code == "no-signing-key" and SIGNING_KEY_ENV in info.value.detail
    assert not list(shared.local.iter_refs())


def test_publishing_with_a_key_file_that_is_no_key_is_refused(
    s3: S3,
    tmp_path: Path,
    keys: dict[str, tuple[Path, str]],
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    bogus = tmp_path / "not-a-key.pem"
    bogus.write_text("-----BEGIN NOTHING-----\n")
    monkeypatch.setenv(SIGNING_KEY_ENV, str(bogus))
    shared = shared_at(tmp_path / "s", prefix_of(request), keys)
    with pytest.raises(PublishRefused) as info:
        shared.admit(new_key(), artifact(tmp_path), metadata={})
    assert info.value.code == "bad-signing-key" and str(bogus) in info.value.detail
    assert not list(shared.local.iter_refs()) and not shared.remote.list_keys()


def test_keygen_refuses_a_bad_publisher_name(tmp_path: Path) -> None:
    keygen = ["trust", "keygen", str(tmp_path / "k.pem"), "--name", "Bad Name"]
    proc = subprocess.run([sys.executable, "-m", "cgbuild.cli", *keygen], capture_output=True, text=True)
    assert proc.returncode == 2 and "bad publisher name" in proc.stderr
    assert not (tmp_path / "k.pem").exists()


# ---- large objects -----------------------------------------------------------------------------
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


# ---- lane evidence and trace facts -------------------------------------------------------------
def test_lane_evidence_from_two_cards_accumulates_beside_the_sealed_object(
    s3: S3, tmp_path: Path, keys: dict[str, tuple[Path, str]], signing: None, request: pytest.FixtureRequest
) -> None:
    prefix, a, key, art = publish_one(tmp_path, keys, request, host="card-a")
    sha = a.local.read_ref(key).object  # type: ignore[union-attr]
    client = s3.client()
    before = client.head_object(Bucket=BUCKET, Key=a.remote.object_name(sha))["ETag"]
    ref_before = a.remote.get_json(a.remote.ref_name(key))
    b = shared_at(tmp_path / "b", prefix, keys, host="card-b")
    a.add_evidence(key, {"median_ns": 1})
    b.add_evidence(key, {"median_ns": 2})
    a.add_evidence(key, {"median_ns": 3})
    runs = [(host, run["median_ns"]) for host, doc in b.read_evidence(key).items() for run in doc["runs"]]
    assert sorted(runs) == [
        ("card-a", 1),
        ("card-a", 3),
        ("card-b", 2),
    ]
    assert client.head_object(Bucket=BUCKET, Key=a.remote.object_name(sha))["ETag"] == before
    assert a.remote.get_json(a.remote.ref_name(key)) == ref_before
    assert b.resolve(key).path.read_bytes() == art.read_bytes()


def test_evidence_the_store_refuses_stays_local_and_the_artifact_stands(
    s3: S3,
    tmp_path: Path,
    keys: dict[str, tuple[Path, str]],
    signing: None,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    proxy = Proxy(s3.upstream, deny="/evidence/").start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        shared = shared_at(tmp_path / "s", prefix_of(request), keys)
        key = new_key()
        assert shared.admit(key, artifact(tmp_path), metadata={}).status == "admitted"
        why = shared.add_evidence(key, {"verdict": {"linear": "baseline"}})
        assert why is not None and "AccessDenied" in why
        assert shared.local.read_evidence(key)[shared.host]["runs"] == [{"verdict": {"linear": "baseline"}}]
        assert key in shared.remote.list_keys()
    finally:
        proxy.stop()


def test_a_connection_lost_mid_download_is_not_corruption(
    s3: S3,
    tmp_path: Path,
    keys: dict[str, tuple[Path, str]],
    signing: None,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    """Half a body then a dropped connection is the network, not the object: the pull fails as
    `remote-unavailable`, and the key is neither cached nor quarantined in the shared store."""
    prefix, a, key, _ = publish_one(tmp_path, keys, request)
    proxy = Proxy(s3.upstream, cut="/objects/").start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        b = shared_at(tmp_path / "b", prefix, keys)
        with pytest.raises(RemoteError) as info:
            b.pull(key)
    finally:
        proxy.stop()
    assert info.value.code == "remote-unavailable"
    assert b.local.read_ref(key) is None
    assert key in a.remote.list_keys() and not a.quarantine_records(key)


def test_trace_facts_are_shared_only_when_a_trusted_publisher_signed_them(
    s3: S3,
    tmp_path: Path,
    keys: dict[str, tuple[Path, str]],
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    prefix = prefix_of(request)
    a = shared_at(tmp_path / "a", prefix, keys)
    facts = {"graph_digest": "g1", "contract": {"inputs": []}, "nodes": 3}
    monkeypatch.delenv(SIGNING_KEY_ENV, raising=False)
    assert a.push_facts({"i0": facts}) == 0  # nothing to sign with: nothing published
    monkeypatch.setenv(SIGNING_KEY_ENV, str(keys["ci"][0]))
    assert a.push_facts({"i1": facts}) == 1
    monkeypatch.setenv(SIGNING_KEY_ENV, str(keys["stranger"][0]))
    assert a.push_facts({"i2": facts}) == 1
    forged = {"schema": "cgbuild.remote-facts/1", "inputs": "i3", "facts": facts}
    assert a.remote.create(a.remote.facts_name("i3"), json.dumps(forged).encode())
    tampered = a.remote.get_json(a.remote.facts_name("i1")).doc  # type: ignore[union-attr]
    tampered["facts"] = {**facts, "graph_digest": "evil"}
    assert a.remote.create(a.remote.facts_name("i4"), json.dumps({**tampered, "inputs": "i4"}).encode())
    # facts no canonical form admits (NaN): ignored like any bad fact, never a crashed plan
    nan = {**tampered, "inputs": "i5", "facts": {**facts, "nodes": float("nan")}}
    assert a.remote.create(a.remote.facts_name("i5"), json.dumps(nan).encode())
    b = shared_at(tmp_path / "b", prefix, keys)
    assert b.pull_facts(["i0", "i1", "i2", "i3", "i4", "i5", "i6"]) == {"i1": facts}


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


def test_a_malformed_remote_ref_is_refused_not_pulled(
    s3: S3, tmp_path: Path, keys: dict[str, tuple[Path, str]], signing: None, request: pytest.FixtureRequest
) -> None:
    prefix, a, key, _ = publish_one(tmp_path, keys, request)
    other = new_key()
    doc = {**a.remote.get_json(a.remote.ref_name(key)).doc, "key": other}  # type: ignore[union-attr]
    doc["object"] = "not-a-sha"
    assert a.remote.create(a.remote.ref_name(other), json.dumps(doc).encode())
    b = shared_at(tmp_path / "b", prefix, keys)
    with pytest.raises(StoreError, match="malformed remote ref"):
        b.pull(other)
    assert b.local.read_ref(other) is None


def test_republishing_a_key_admitted_before_the_remote_keeps_it_servable_here(
    s3: S3, tmp_path: Path, keys: dict[str, tuple[Path, str]], signing: None, request: pytest.FixtureRequest
) -> None:
    """A key admitted unsigned (before the workspace declared its remote) is signed when it is
    published, and the local ref carries that signature, so this cache still serves it."""
    shared = shared_at(tmp_path / "a", prefix_of(request), keys)
    key, art = new_key(), artifact(tmp_path)
    assert shared.local.admit(key, art, metadata={"labels": ["//t"]}).status == "admitted"
    assert shared.unpublished({key}) == [key]
    assert shared.republish(key) == ("admitted", shared.local.read_ref(key).object)  # type: ignore[union-attr]
    ref = shared.remote.get_json(shared.remote.ref_name(key))
    local = shared.local.read_ref(key)
    assert ref is not None and local is not None
    assert local.metadata == {"labels": ["//t"], "signature": ref.doc["signature"]}
    assert shared.resolve(key).ref == local
    assert shared.unpublished({key}) == []


def test_an_object_overwritten_in_place_is_uploaded_again_not_trusted(
    s3: S3, tmp_path: Path, keys: dict[str, tuple[Path, str]], signing: None, request: pytest.FixtureRequest
) -> None:
    prefix, a, key, art = publish_one(tmp_path, keys, request)
    sha = a.local.read_ref(key).object  # type: ignore[union-attr]
    bad = bytearray(art.read_bytes())
    bad[7] ^= 0xFF  # same size, other bytes, no sha256 tag: it must not pass for the object
    s3.client().put_object(Bucket=BUCKET, Key=a.remote.object_name(sha), Body=bytes(bad))
    assert not a.remote.has_object(sha, art.stat().st_size)
    other = new_key()
    assert shared_at(tmp_path / "b", prefix, keys).admit(other, art, metadata={}).status == "admitted"
    assert shared_at(tmp_path / "c", prefix, keys).resolve(other).path.read_bytes() == art.read_bytes()


def test_a_workspace_with_a_remote_travels_to_another_process(
    s3: S3, tmp_path: Path, keys: dict[str, tuple[Path, str]], request: pytest.FixtureRequest
) -> None:
    import pickle

    from cgbuild.plan.planner import Workspace

    url = f"s3://{BUCKET}/{prefix_of(request)}"
    cg = load_ws(tmp_path, f'remote = "{url}"\ntrusted = ["{keys["ci"][1]}"]')
    ws = Workspace(cg)
    shared = ws.shared()
    assert shared is not None and shared.remote_keys() == set()  # the client exists now
    copy = pickle.loads(pickle.dumps(ws))  # as a fleet executor ships it to a worker
    assert copy.shared().remote_keys() == set() and copy.remote.url == url
    assert Workspace(load_ws(tmp_path, 'state = ".cgbuild"')).shared() is None


def test_fetch_without_a_remote_is_refused(tmp_path: Path) -> None:
    load_ws(tmp_path, 'state = ".cgbuild"')
    proc = subprocess.run(
        [sys.executable, "-m", "cgbuild.cli", "-C", str(tmp_path), "fetch", "--json"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "field 'workspace.remote'" in proc.stderr
    assert "Traceback" not in proc.stderr


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


def test_trust_error_codes_are_the_documented_ones() -> None:
    text = (REPO / "docs" / "store.md").read_text()
    for code in ("unsigned", "unknown-signer", "bad-signature", "no-signing-key", "no-conditional-write"):
        assert f"`{code}`" in text
    assert TrustError("unsigned", "x").code == "unsigned"


# ---- real mints, plans, fetches and adopts (one CPU compile for the module) ---------------------
MLP8 = "//toy/mlp/8x64-b1@fp32:cpu"


def cli(ws: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cgbuild.cli", "-C", str(ws), *args],
        capture_output=True,
        text=True,
        env=env,
    )


def last_json(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert "Traceback" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def toy_with_remote(dest: Path, reference: Path, url: str, entries: list[str]) -> Path:
    from conftest import copy_toy

    ws = copy_toy(dest, reference)
    cg = ws / "Cgfile"
    declared = f"[workspace]\nremote = {json.dumps(url)}\ntrusted = {json.dumps(entries)}\n"
    cg.write_text(cg.read_text().replace("[workspace]\n", declared, 1))
    return ws


@pytest.fixture(scope="module")
def published(
    s3: S3, keys: dict[str, tuple[Path, str]], toy_reference: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, str, str]:
    """(publisher workspace, remote URL, key): the toy's MLP8 minted once and published."""
    url = f"s3://{BUCKET}/toy-{secrets.token_hex(3)}"
    ws = toy_with_remote(tmp_path_factory.mktemp("publisher") / "toy", toy_reference, url, [keys["ci"][1]])
    proc = cli(ws, "mint", MLP8, "--json", env=child_env(s3, **{SIGNING_KEY_ENV: str(keys["ci"][0])}))
    summary = last_json(proc)
    assert proc.returncode == 0, summary
    (minted,) = summary["minted"]
    assert minted["admission"] == "admitted"
    return ws, url, minted["key"]


@pytest.mark.slow
def test_mint_publishes_and_a_clean_clone_plans_fresh_without_tracing(
    published: tuple[Path, str, str],
    s3: S3,
    keys: dict[str, tuple[Path, str]],
    toy_reference: Path,
    tmp_path: Path,
) -> None:
    _, url, key = published
    remote = Remote(url)
    ref = remote.get_json(remote.ref_name(key))
    assert ref is not None and ref.doc["signature"]["key_id"] and ref.doc["metadata"]["labels"] == [MLP8]
    assert remote.has_object(ref.doc["object"], ref.doc["size"])
    assert list(remote.list_names(f"evidence/{key}")) and list(remote.list_names("facts"))
    clone = toy_with_remote(tmp_path / "clone", toy_reference, url, [keys["ci"][1]])
    proxy = Proxy(s3.upstream).start()
    try:
        env = child_env(s3, AWS_ENDPOINT_URL=proxy.url, **{SIGNING_KEY_ENV: None})
        plan = cli(clone, "plan", MLP8, "--json", env=env)
        (target,) = last_json(plan)["targets"]
        assert target["status"] == "fresh" and target["key"] == key
        assert "tracing [" not in plan.stderr  # the facts came from the remote: no trace ran
        lists = proxy.requests("GET", "list-type=2")
        assert len([p for p in lists if "refs%2F" in p]) == 1 and not proxy.requests("GET", "/refs/")
        proxy.log.clear()
        fetched = last_json(cli(clone, "fetch", MLP8, "--json", env=env))
        assert [(p["key"], p["signer"]) for p in fetched["pulled"]] == [(key, "ci")]
        assert not fetched["refused"]
        cache = Store(clone / ".cgbuild" / "store")
        assert cache.read_ref(key).metadata["signature"] == ref.doc["signature"]  # type: ignore[union-attr]
        assert last_json(cli(clone, "fetch", MLP8, "--json", env=env))["local"] == 1
        again = last_json(cli(clone, "mint", MLP8, "--json", env=env))
        assert again["fresh"] == 1 and again["minted"] == []
        # a publishing mint without a signing key is refused before anything compiles
        other = "//toy/mlp/16x64-b1@fp32:cpu"
        proc = cli(clone, "mint", other, "--json", env=env)
        (failed,) = last_json(proc)["failed"]
        assert proc.returncode == 1 and failed["code"] == "no-signing-key" and failed["phase"] == "publish"
        assert not (clone / ".cgbuild" / "mint" / f"{failed['key']}.log").exists()
    finally:
        proxy.stop()


@pytest.mark.slow
def test_a_no_op_plan_the_remembered_listing_vouches_for_is_served_from_the_memo(
    published: tuple[Path, str, str],
    s3: S3,
    keys: dict[str, tuple[Path, str]],
    toy_reference: Path,
    tmp_path: Path,
) -> None:
    """With a shared store, a key fresh only by the remote is served from the memo at the cost of
    one listing of `quarantine/` (never of `refs/`), and stops being served the moment the key is
    quarantined or the remembered listing it rests on is older than its TTL."""
    _, published_url, key = published
    source, prefix = Remote(published_url), f"memo-{secrets.token_hex(3)}"
    remote = Remote(f"s3://{BUCKET}/{prefix}")  # a copy of the published store: this test quarantines
    for sub in ("refs", "objects", "facts"):
        for n in source.list_names(sub):
            copied = {"Bucket": BUCKET, "Key": source.name(sub, n)}
            remote.client.copy_object(Bucket=BUCKET, CopySource=copied, Key=remote.name(sub, n))
    clone = toy_with_remote(tmp_path / "clone", toy_reference, remote.url, [keys["ci"][1]])
    proxy = Proxy(s3.upstream).start()
    try:
        env = child_env(s3, AWS_ENDPOINT_URL=proxy.url, **{SIGNING_KEY_ENV: None})

        def plan() -> tuple[str, list[str]]:
            proxy.log.clear()
            proc = cli(clone, "plan", MLP8, "--json", env=env)
            assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
            listed = [p.split("prefix=", 1)[1].split("%2F")[1] for m, p in proxy.log if "list-type=2" in p]
            return proc.stdout, listed

        first, listed = plan()  # lists refs/ and remembers it: the listing moved, so no memo yet
        assert json.loads(first)["targets"][0]["status"] == "fresh" and "refs" in listed
        second, listed = plan()  # from the remembered listing, in full: now memoised
        assert listed == ["quarantine"] and json.loads(second)["targets"][0]["status"] == "fresh"
        memos = clone / ".cgbuild" / "cache" / "plans"
        (index,) = memos.glob("*.json")
        doc = json.loads(index.read_text())
        assert [row[:2] for row in doc["store"]] == [[key, "listed"]] and doc["listed_at"]
        stamp = index.stat().st_mtime_ns, index.stat().st_ino
        third, listed = plan()
        assert third == second and listed == ["quarantine"]
        assert (index.stat().st_mtime_ns, index.stat().st_ino) == stamp, "the no-op plan was not a memo hit"

        # the remembered listing is past its TTL (its file unchanged): the memo does not serve it
        index.write_text(json.dumps({**doc, "listed_at": time.time() - SEEN_TTL_S - 1}))
        aged = index.stat().st_mtime_ns, index.stat().st_ino
        assert plan()[0] == second and (index.stat().st_mtime_ns, index.stat().st_ino) != aged

        # another machine quarantines the key: the memo stops vouching for it at once
        other = shared_at(tmp_path / "other", prefix, keys, host="host-b")
        seen = other.remote.get_json(other.remote.ref_name(key))
        assert seen is not None
        other.quarantine_remote(key, seen, "bad bytes")
        after, listed = plan()
        assert json.loads(after)["targets"][0]["status"] == "mint" and "refs" in listed
    finally:
        proxy.stop()


@pytest.mark.slow
def test_mint_publishes_what_only_this_cache_holds(
    published: tuple[Path, str, str], s3: S3, keys: dict[str, tuple[Path, str]], tmp_path: Path
) -> None:
    """A key admitted here but not in the remote (its publish failed after the local admission, or
    it was minted before the remote was declared) reads fresh in plan: mint publishes it from the
    cache, signed as admitted, instead of leaving it on this machine for good."""
    ws, _, key = published
    moved = shutil.copytree(ws, tmp_path / "toy")
    url = f"s3://{BUCKET}/republish-{secrets.token_hex(3)}"
    cg = moved / "Cgfile"
    declared = f"remote = {json.dumps(url)}"
    cg.write_text(re.sub(r"^remote = .*$", declared, cg.read_text(), count=1, flags=re.M))
    remote = Remote(url)
    assert key not in remote.list_keys()
    env = child_env(s3, **{SIGNING_KEY_ENV: str(keys["ci"][0])})
    proc = cli(moved, "mint", MLP8, "--json", env=env)
    summary = last_json(proc)
    assert proc.returncode == 0, summary
    assert summary["minted"] == [] and summary["published"] == [{"key": key, "publish": "admitted"}]
    ref = remote.get_json(remote.ref_name(key))
    local = Store(moved / ".cgbuild" / "store").read_ref(key)
    assert ref is not None and local is not None
    assert (ref.doc["object"], ref.doc["signature"]) == (local.object, local.metadata["signature"])
    assert remote.has_object(local.object, local.size)
    proxy = Proxy(s3.upstream).start()  # what this cache published it remembers: no listing of refs
    try:
        again = cli(moved, "mint", MLP8, "--json", env={**env, "AWS_ENDPOINT_URL": proxy.url})
        assert last_json(again)["published"] == []
        assert not [p for p in proxy.requests("GET", "list-type=2") if "refs" in p]
    finally:
        proxy.stop()


@pytest.mark.slow
def test_inspect_shows_every_cards_evidence_from_the_shared_store(
    published: tuple[Path, str, str], s3: S3, keys: dict[str, tuple[Path, str]], tmp_path: Path
) -> None:
    ws, url, key = published
    card_b = SharedStore(Store(tmp_path / "b"), Remote(url), trusted(keys["ci"][1]), "card-b")
    assert card_b.add_evidence(key, {"how": "mint", "measured": {}}) is None
    proc = cli(ws, "inspect", key, "--json", env=child_env(s3))
    assert proc.returncode == 0, proc.stderr
    evidence = json.loads(proc.stdout)["lane_evidence"]
    assert evidence["card-b"]["runs"] == [{"how": "mint", "measured": {}}]
    assert len(evidence) == 2  # the publisher's own mint run, from the remote, and card-b's


@pytest.mark.slow
def test_fetch_reports_a_key_the_store_refuses_and_goes_on(
    published: tuple[Path, str, str],
    s3: S3,
    keys: dict[str, tuple[Path, str]],
    toy_reference: Path,
    tmp_path: Path,
) -> None:
    _, url, key = published
    clone = toy_with_remote(tmp_path / "clone", toy_reference, url, [keys["ci"][1]])
    proxy = Proxy(s3.upstream, deny="/objects/").start()  # refs readable, objects forbidden
    try:
        proc = cli(clone, "fetch", MLP8, "--json", env=child_env(s3, AWS_ENDPOINT_URL=proxy.url))
    finally:
        proxy.stop()
    summary = last_json(proc)
    assert proc.returncode == 1 and summary["pulled"] == []
    (refused,) = summary["refused"]
    assert refused["key"] == key and refused["code"] == "remote-error" and "AccessDenied" in refused["detail"]
    assert Store(clone / ".cgbuild" / "store").read_ref(key) is None


def _toy_module(ws_path: Path) -> Any:
    from cgbuild.config.targets import expand
    from cgbuild.plan.planner import Workspace
    from cgbuild.protocol.trace import job_for

    ws = Workspace(cgfile.load(ws_path / "Cgfile"))
    job = job_for(ws.cg, next(t for t in expand(ws.cg) if t.label == MLP8)).to_json()
    sys.path.insert(0, str(ws_path))
    try:
        import toy_models
    finally:
        sys.path.remove(str(ws_path))
    return toy_models.build({**job["spec"], "config": job["config"]})[0].eval()


@pytest.mark.slow
def test_adopt_pulls_verified_artifacts_and_refuses_untrusted_ones(
    published: tuple[Path, str, str], s3: S3, keys: dict[str, tuple[Path, str]], tmp_path: Path
) -> None:
    import torch
    from cgbuild_rules.adopt import AdoptRefused, adopt

    from cgbuild.store import trust

    ws_path, url, key = published
    module = _toy_module(ws_path)
    x = torch.randn(1, 8, 64)
    shared = SharedStore(Store(tmp_path / "cache"), Remote(url), trusted(keys["ci"][1]), "server")
    served = adopt(key, module, store=shared)
    assert served.refusals == {} and served.armed
    with torch.no_grad():
        torch.testing.assert_close(served(x), module(x), rtol=1e-5, atol=1e-6)
    good = shared.local.resolve(key).path
    stranger_only = SharedStore(Store(tmp_path / "s"), Remote(url), trusted(keys["stranger"][1]), "server")
    assert next(iter(adopt(key, module, store=stranger_only).refusals.values())).code == "unknown-signer"

    flipped = bytearray(good.read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF
    swapped = tmp_path / "swapped.bin"
    swapped.write_bytes(bytes(flipped))
    ci = load_signer({SIGNING_KEY_ENV: str(keys["ci"][0])})
    assert ci is not None
    from cgbuild.core.canon import sha256_file

    signed_good = ci.sign(trust.artifact_statement(key, sha256_file(str(good)), good.stat().st_size))
    for name, source, signature, code in (
        ("unsigned", good, None, "unsigned"),
        ("swapped", swapped, signed_good, "bad-signature"),
    ):
        forged = SharedStore(
            Store(tmp_path / name), Remote(f"{url}-{name}"), trusted(keys["ci"][1]), "server"
        )
        _forge(forged, key, source, signature)
        served = adopt(key, module, store=forged)
        (refusal,) = served.refusals.values()
        assert refusal.code == code, refusal
        assert forged.local.read_ref(key) is None
        with torch.no_grad():
            torch.testing.assert_close(served(x), module(x))
        assert served.counters == {f"eager:{code}": 1}
        with pytest.raises(AdoptRefused, match=code):
            adopt(key, module, store=forged, strict=True)


@pytest.mark.slow
def test_adopt_serves_eager_when_the_remote_is_unreachable(
    published: tuple[Path, str, str], keys: dict[str, tuple[Path, str]], tmp_path: Path
) -> None:
    from cgbuild_rules.adopt import adopt

    ws_path, url, key = published
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
        mp.setenv("AWS_MAX_ATTEMPTS", "1")
        shared = SharedStore(Store(tmp_path / "cache"), Remote(url), trusted(keys["ci"][1]), "server")
        (refusal,) = adopt(key, _toy_module(ws_path), store=shared).refusals.values()
    assert refusal.code == "remote-unavailable"


@pytest.mark.slow
def test_a_mint_that_loses_the_race_is_told_which_artifact_stands(
    published: tuple[Path, str, str],
    keys: dict[str, tuple[Path, str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another machine published first, between this machine's plan and its publish."""
    from cgbuild.config.labels import parse_selector
    from cgbuild.core.canon import sha256_file
    from cgbuild.exec import mint
    from cgbuild.plan.planner import Workspace, make_plan
    from cgbuild.store import trust

    monkeypatch.setenv(SIGNING_KEY_ENV, str(keys["ci"][0]))
    ws_path, url, _ = published
    ws = Workspace(cgfile.load(ws_path / "Cgfile"))
    ws.cg.remote, ws.cg.store_dir = f"{url}-race", tmp_path / "store"
    (mk,) = mint.approved(make_plan(ws, parse_selector(MLP8)), ws)
    first = artifact(tmp_path)
    ci = load_signer()
    assert ci is not None and ws.remote is not None
    sha, size = sha256_file(str(first)), first.stat().st_size
    rival = SharedStore(Store(tmp_path / "rival"), ws.remote, ws.cg.trusted, "rival")
    assert (
        rival.publish(mk.key, first, sha, size, ci.sign(trust.artifact_statement(mk.key, sha, size)), {})[0]
        == "admitted"
    )
    store = Store(ws.cg.store_dir)
    result = mint.mint_one(ws, mk, store).result
    assert result["code"] == "conflict" and result["standing"] == sha and not result["ok"], result
    assert store.ref_state(mk.key) == "quarantined"  # this machine's copy does not linger
    assert SharedStore(Store(tmp_path / "c"), ws.remote, ws.cg.trusted, "c").resolve(mk.key).ref.object == sha


def test_fetch_and_republish_refuse_a_ref_naming_another_keys_artifact(
    s3: S3, tmp_path: Path, keys: dict[str, tuple[Path, str]], request: pytest.FixtureRequest, signing: None
) -> None:
    """Signed and intact, but another key's sealed artifact: the pull quarantines the remote ref
    (the object stays: it is the other key's) and a republish never publishes it."""
    from test_store_heal import artifact as sealed

    prefix = prefix_of(request)
    a = shared_at(tmp_path / "a", prefix, keys)
    k1, k2 = new_key(), new_key()
    assert a.admit(k2, sealed(tmp_path, k2), metadata={}).status == "admitted"
    assert a.admit(k1, sealed(tmp_path, k2), metadata={}).status == "admitted"  # a crossed publish
    b = shared_at(tmp_path / "b", prefix, keys, host="host-b")
    with pytest.raises(StoreError) as refused:
        b.pull(k1)
    assert refused.value.code == "key-mismatch" and b.local.ref_state(k1) == "missing"
    assert b.remote.get_json(b.remote.ref_name(k1)) is None
    assert "key-mismatch" in b.quarantine_records(k1)[0]["reason"]
    assert b.pull(k2).ref.key == k2  # the object is still there for its own key
    with pytest.raises(StoreError) as unpublished:
        a.republish(k1)
    assert unpublished.value.code == "key-mismatch" and a.local.ref_state(k1) == "quarantined"
