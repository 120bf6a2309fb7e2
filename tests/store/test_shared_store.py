"""The shared, signed store (`SharedStore`: a local cache over an S3 remote) against each real S3
server of the `s3` fixture (moto, SeaweedFS) on loopback, with small artifacts: publish and pull
with signatures verified, untrusted and corrupt artifacts refused and never cached, mint-once
across machines, lane evidence and trace facts beside the sealed object.

Every test works under its own prefix of one bucket (`prefix_of`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from support.artifacts import sealed_for
from support.s3 import BUCKET, S3, behind_proxy
from support.shared import artifact, forge, new_key, overwrite_flipped, prefix_of, publish_one, shared_at

from cgbuild.core.canon import canonical_json
from cgbuild.store.errors import Corrupt, StoreError
from cgbuild.store.remote_gc import collect
from cgbuild.store.s3 import Remote, RemoteError
from cgbuild.store.shared import SEEN_TTL_S, PublishRefused, SharedStore, Untrusted
from cgbuild.store.trust import SIGNING_KEY_ENV, load_signer


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
    forge(shared, key, art, signature)
    with pytest.raises(Untrusted) as info:
        shared.resolve(key)
    assert info.value.code == ("bad-signature" if case == "swapped-object" else case)
    assert shared.local.read_ref(key) is None and not shared.local.object_path(sha).exists()


def test_corrupt_remote_object_is_retried_then_quarantined_and_repaired(
    s3: S3, tmp_path: Path, keys: dict[str, tuple[Path, str]], signing: None, request: pytest.FixtureRequest
) -> None:
    prefix, a, key, art = publish_one(tmp_path, keys, request)
    sha = overwrite_flipped(s3, a, key, art, 100)
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
    losers: list[str] = []
    for k in names:
        pair = sorted((results[0, k].status, results[1, k].status))
        assert pair == ["admitted", "conflict"], (k, pair)
        winner, loser = (0, 1) if results[0, k].status == "admitted" else (1, 0)
        assert results[loser, k].existing == results[winner, k].object  # the loser is told which
        ref = machines[loser].remote.get_json(machines[loser].remote.ref_name(k))
        assert ref is not None and ref.doc["object"] == results[winner, k].object  # one ref, the winner's
        assert machines[loser].local.ref_state(k) == "quarantined"  # and its cache does not diverge
        assert machines[loser].resolve(k).path.read_bytes() == arts[winner, k].read_bytes()  # verified
        losers.append(results[loser, k].object)
    # the loser's object went up before its ref lost: no ref names it, the remote gc sweeps it
    assert sorted(collect(machines[0], grace_s=0, dry_run=True).removed) == sorted(losers)


def test_a_ref_that_exists_for_the_writer_but_never_for_a_reader_gives_up(
    s3: S3, tmp_path: Path, keys: dict[str, tuple[Path, str]], signing: None, request: pytest.FixtureRequest
) -> None:
    """Each refused create reads the standing ref; one that keeps vanishing is an error after three
    tries, not a loop, and the key stays unpublished in the cache (the next mint republishes it)."""
    with behind_proxy(s3, refuse_create="/refs/") as proxy:
        shared = shared_at(tmp_path / "s", prefix_of(request), keys)
        key = new_key()
        with pytest.raises(RemoteError, match="ref kept vanishing"):
            shared.admit(key, artifact(tmp_path), metadata={})
        assert len(proxy.requests("PUT", f"/refs/{key}")) == 3
        assert shared.local.ref_state(key) == "fresh" and shared.unpublished({key}) == [key]


@pytest.mark.parametrize("key_file", [None, "not-a-key.pem"], ids=["no-signing-key", "bad-signing-key"])
def test_publishing_without_a_usable_signing_key_is_refused(
    s3: S3,
    tmp_path: Path,
    keys: dict[str, tuple[Path, str]],
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    key_file: str | None,
) -> None:
    """No signing key set is refused naming the variable; a file that holds no key, naming the file."""
    if key_file is None:
        monkeypatch.delenv(SIGNING_KEY_ENV, raising=False)
        code, named = "no-signing-key", SIGNING_KEY_ENV
    else:
        bogus = tmp_path / key_file
        bogus.write_text("-----BEGIN NOTHING-----\n")
        monkeypatch.setenv(SIGNING_KEY_ENV, str(bogus))
        code, named = "bad-signing-key", str(bogus)
    shared = shared_at(tmp_path / "s", prefix_of(request), keys)
    with pytest.raises(PublishRefused) as info:
        shared.admit(new_key(), artifact(tmp_path), metadata={})
    assert info.value.code == code and named in info.value.detail
    assert not list(shared.local.iter_refs()) and not shared.remote.list_keys()


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
    s3: S3, tmp_path: Path, keys: dict[str, tuple[Path, str]], signing: None, request: pytest.FixtureRequest
) -> None:
    with behind_proxy(s3, deny="/evidence/"):
        shared = shared_at(tmp_path / "s", prefix_of(request), keys)
        key = new_key()
        assert shared.admit(key, artifact(tmp_path), metadata={}).status == "admitted"
        why = shared.add_evidence(key, {"verdict": {"linear": "baseline"}})
        assert why is not None and "AccessDenied" in why
        assert shared.local.read_evidence(key)[shared.host]["runs"] == [{"verdict": {"linear": "baseline"}}]
        assert key in shared.remote.list_keys()


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


def test_fetch_and_republish_refuse_a_ref_naming_another_keys_artifact(
    s3: S3, tmp_path: Path, keys: dict[str, tuple[Path, str]], request: pytest.FixtureRequest, signing: None
) -> None:
    """Signed and intact, but another key's sealed artifact: the pull quarantines the remote ref
    (the object stays: it is the other key's) and a republish never publishes it."""
    prefix = prefix_of(request)
    a = shared_at(tmp_path / "a", prefix, keys)
    k1, k2 = new_key(), new_key()
    assert a.admit(k2, sealed_for(tmp_path, k2), metadata={}).status == "admitted"
    assert a.admit(k1, sealed_for(tmp_path, k2), metadata={}).status == "admitted"  # a crossed publish
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
