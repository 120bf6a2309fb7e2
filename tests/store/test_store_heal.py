"""The store heals: malformed refs and refs naming another key's object are quarantined by the
writers and reported by the readers; readers create nothing; a full disk fails one key only."""

from __future__ import annotations

import errno
import json
import os
import types
from pathlib import Path

import pytest
from support.artifacts import sealed_for

from cgbuild.store import local, refs
from cgbuild.store.errors import DiskFull, MalformedRef
from cgbuild.store.local import Store

K1, K2, K3 = "a1" * 32, "b2" * 32, "c3" * 32


MALFORMED = {
    "not-json": lambda p, s: p.write_text("{nope"),
    "a-list": lambda p, s: p.write_text("[]"),
    "empty": lambda p, s: p.write_text(""),
    "a-folder": lambda p, s: (p.unlink(), p.mkdir()),
    "size-text": lambda p, s: p.write_text(p.read_text().replace(f'"size":{s}', f'"size":"{s}"')),
    "other-key": lambda p, s: p.write_text(p.read_text().replace(K1, K2)),
    # 64 characters that are no sha256, a negative size: once `missing` to ref_state alone
    "no-sha-negative-size": lambda p, s: p.write_text(
        json.dumps({**json.loads(p.read_text()), "object": "Z" * 64, "size": -1})
    ),
    "size-true": lambda p, s: p.write_text(json.dumps({**json.loads(p.read_text()), "size": True})),
}


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_a_malformed_ref_is_reported_by_readers_and_quarantined_by_writers(tmp_path: Path, kind: str) -> None:
    store = Store(tmp_path / "store")
    store.admit(K1, sealed_for(tmp_path, K1))
    store.admit(K3, sealed_for(tmp_path, K3))
    ref = store.ref_path(K1)
    MALFORMED[kind](ref, store.read_ref(K1).size)  # type: ignore[union-attr]
    reader = Store(tmp_path / "store")
    assert reader.ref_state(K1) == "malformed"  # plan: not fresh, reason malformed-ref
    assert refs.raw_problem(ref.read_bytes() if ref.is_file() else b"", K1, refs.REF_SCHEMA)  # one check
    with pytest.raises(MalformedRef):
        reader.resolve(K1)  # adopt's path: a refusal, and nothing changed
    assert ref.exists() and reader.quarantine_record(K1) is None
    verdicts = {v.key: v for v in store.verify_all()}  # one bad key never stops the others
    assert verdicts[K1].status == "malformed-ref" and "quarantined" in verdicts[K1].detail
    assert verdicts[K3].status == "ok"
    assert not ref.exists() and store.ref_state(K1) == "quarantined"
    assert store.quarantine_record(K1)["reason"].startswith("malformed-ref")  # type: ignore[index]
    assert store.admit(K1, sealed_for(tmp_path, K1)).status == "admitted"  # repaired
    assert store.ref_state(K1) == "fresh" and store.quarantine_record(K1) is None


def test_admission_and_gc_retire_malformed_refs(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    for key in (K1, K2):
        store.ref_path(key).parent.mkdir(parents=True, exist_ok=True)
        store.ref_path(key).write_text("[]")
    assert store.admit(K1, sealed_for(tmp_path, K1)).status == "admitted"  # mint and fetch admit
    report = store.gc()
    assert report.refs_quarantined == [K2] and store.ref_state(K2) == "quarantined"
    assert store.ref_state(K1) == "fresh"


def test_a_ref_naming_another_keys_object_is_quarantined_by_verify(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    store.admit(K1, sealed_for(tmp_path, K1))
    other = store.admit(K2, sealed_for(tmp_path, K2))
    ref = store.ref_path(K1)
    doc = ref.read_text()
    first = store.read_ref(K1)
    assert first is not None
    ref.write_text(
        doc.replace(first.object, other.object).replace(f'"size":{first.size}', f'"size":{other.size}')
    )
    assert store.ref_state(K1) == "fresh" and store.verify(K1).status == "ok"  # bytes alone cannot tell
    verdict = store.check_sealed_key(K1)
    assert verdict is not None and verdict.status == "key-mismatch" and K2[:16] in verdict.detail
    assert store.ref_state(K1) == "quarantined" and store.ref_state(K2) == "fresh"
    assert store.check_sealed_key(K2) is None


def cross(store: Store, key: str, other: str) -> None:
    """Point `key`'s ref at `other`'s object (sha and size): a well-formed ref, the wrong bytes."""
    mine, theirs = store.read_ref(key), store.read_ref(other)
    assert mine is not None and theirs is not None
    doc = store.ref_path(key).read_text()
    store.ref_path(key).write_text(
        doc.replace(mine.object, theirs.object).replace(f'"size":{mine.size}', f'"size":{theirs.size}')
    )


def test_a_ref_naming_another_keys_object_is_quarantined_by_gc_and_admission(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    store.admit(K1, sealed_for(tmp_path, K1))
    store.admit(K2, sealed_for(tmp_path, K2))
    own = store.read_ref(K1)
    cross(store, K1, K2)
    assert store.ref_state(K1) == "fresh"  # plan opens no artifact: it cannot tell
    assert store.gc(dry_run=True).refs_quarantined == [K1] and store.ref_state(K1) == "fresh"
    report = store.gc()
    assert report.refs_quarantined == [K1] and store.ref_state(K1) == "quarantined"
    assert "key-mismatch" in store.quarantine_record(K1)["reason"]  # type: ignore[index]
    assert own is not None and own.object in report.objects_removed  # K1's own bytes: unreachable
    assert store.ref_state(K2) == "fresh" and store.verify(K2).status == "ok"  # K2's object stays
    store.admit(K1, sealed_for(tmp_path, K1))
    cross(store, K1, K2)
    # a mint of K1 finds the crossed ref in its way: retired, not a mint-once conflict
    assert store.admit(K1, sealed_for(tmp_path, K1)).status == "admitted"
    assert store.check_sealed_key(K1) is None and store.ref_state(K2) == "fresh"


def test_readers_create_and_lock_nothing(tmp_path: Path) -> None:
    root = tmp_path / "store"
    writer = Store(root)
    writer.admit(K1, sealed_for(tmp_path, K1))
    for name in ("lock", "tmp", "quarantine"):
        p = root / name
        p.unlink() if p.is_file() else __import__("shutil").rmtree(p)
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    reader = Store(root)
    assert reader.ref_state(K1) == "fresh" and reader.ref_state(K2) == "missing"
    assert reader.resolve(K1).ref.key == K1 and reader.verify(K1).status == "ok"
    assert reader.check_sealed_key(K1) is None and [r.key for r in reader.iter_refs()] == [K1]
    assert Store(tmp_path / "absent").ref_state(K1) == "missing"
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before
    assert not (tmp_path / "absent").exists()


@pytest.mark.parametrize("failing_fsync", [1, 2])  # the object's temp; the ref's temp
def test_a_full_disk_at_admission_fails_that_key_and_admits_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing_fsync: int
) -> None:
    store = Store(tmp_path / "store")
    art = sealed_for(tmp_path, K1)
    calls = {"n": 0}

    def fsync(fd: int) -> None:
        calls["n"] += 1
        if calls["n"] == failing_fsync:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.fsync(fd)

    full = types.SimpleNamespace(**{n: getattr(os, n) for n in dir(os) if not n.startswith("__")})
    full.fsync = fsync
    monkeypatch.setattr(local, "os", full)  # the store's own writes only
    with pytest.raises(DiskFull) as e:
        store.admit(K1, art)
    assert e.value.code == "disk-full"
    monkeypatch.undo()
    assert store.read_ref(K1) is None and store.ref_state(K1) == "missing"  # nothing half-admitted
    assert list((store.root / "tmp").iterdir()) == []
    assert store.admit(K2, sealed_for(tmp_path, K2)).status == "admitted"  # the next key is unharmed
    store.gc()  # an object installed before the ref failed is unreachable: swept
    assert store.verify_all() and all(v.status == "ok" for v in store.verify_all())
    assert store.admit(K1, art).status == "admitted"
