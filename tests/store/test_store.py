"""The local store's contract: mint-once, crash safety, verification, quarantine, gc."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cgbuild.store.errors import Corrupt, Missing, Quarantined, StoreError
from cgbuild.store.local import Store


def _blob(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _invariants(store: Store) -> None:
    """What no crash may break: every ref names an intact object, every object matches its name."""
    for ref in store.iter_refs():
        obj = store.object_path(ref.object)
        assert obj.exists(), f"ref {ref.key} without its object"
        assert hashlib.sha256(obj.read_bytes()).hexdigest() == ref.object
    for obj in (store.root / "objects" / "sha256").glob("*/*"):
        assert hashlib.sha256(obj.read_bytes()).hexdigest() == obj.parent.name + obj.name, "torn object"


def test_admit_resolve_already_conflict(tmp_path: Path) -> None:
    store = Store(tmp_path / "s")
    a = _blob(tmp_path / "a", b"artifact A")
    b = _blob(tmp_path / "b", b"artifact B")
    assert store.ref_state("k1") == "missing"
    first = store.admit("k1", a, metadata={"label": "//toy/mlp/8x64-b1@fp32:cpu"})
    assert first.status == "admitted" and first.object == hashlib.sha256(b"artifact A").hexdigest()
    assert store.admit("k1", a).status == "already"
    clash = store.admit("k1", b)
    assert clash.status == "conflict" and clash.existing == first.object and not clash.ok
    resolved = store.resolve("k1")
    assert resolved.path.read_bytes() == b"artifact A"  # the first writer stands
    assert resolved.ref.metadata == {"label": "//toy/mlp/8x64-b1@fp32:cpu"}
    assert store.ref_state("k1") == "fresh"
    assert not os.access(resolved.path, os.W_OK) or os.geteuid() == 0
    assert oct(resolved.path.stat().st_mode & 0o777) == "0o444"
    doc = json.loads(store.ref_path("k1").read_text())
    assert doc == {
        "schema": "cgbuild.ref/1",
        "key": "k1",
        "object": first.object,
        "size": 10,
        "metadata": {"label": "//toy/mlp/8x64-b1@fp32:cpu"},
    }
    with pytest.raises(Missing):
        store.resolve("k2")
    with pytest.raises(StoreError):
        store.admit("../escape", a)
    with pytest.raises(StoreError):
        store.admit("k3", a, metadata={"seconds": 1.5})  # floats never enter canonical JSON


_RACER = textwrap.dedent(
    """
    import json, os, sys, time
    from cgbuild.store.local import Store
    root, tag, go, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    store = Store(root)
    blobs = []
    for i in range(n):
        p = os.path.join(root, "..", f"{tag}-{i}")
        with open(p, "wb") as f:
            f.write(f"{tag} artifact {i}".encode() * 1000)
        blobs.append(p)
    while not os.path.exists(go):
        time.sleep(0.001)
    print(json.dumps([store.admit(f"key{i:03d}", blobs[i]).status for i in range(n)]))
    """
)


def test_two_processes_one_key_exactly_one_wins(tmp_path: Path) -> None:
    root, go, n = tmp_path / "s", tmp_path / "go", 40
    root.mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, str(root), tag, str(go), str(n)], stdout=subprocess.PIPE, text=True
        )
        for tag in ("A", "B")
    ]
    time.sleep(0.5)
    go.touch()
    results = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    for i in range(n):
        assert sorted((results[0][i], results[1][i])) == ["admitted", "conflict"], i
    store = Store(root)
    _invariants(store)
    assert all(v.status == "ok" for v in store.verify_all())


_WRITER = textwrap.dedent(
    """
    import os, sys
    from cgbuild.store.local import Store
    root, scratch = sys.argv[1], sys.argv[2]
    store = Store(root)
    i = 0
    while True:
        p = os.path.join(scratch, f"blob{i % 4}")
        with open(p, "wb") as f:
            f.write(os.urandom(3 << 20))
        store.admit(f"key-{os.getpid()}-{i}", p)
        i += 1
    """
)


def test_kill_9_leaves_no_torn_object_and_no_dangling_ref(tmp_path: Path) -> None:
    root, scratch = tmp_path / "s", tmp_path / "scratch"
    scratch.mkdir()
    Store(root)
    torn_temps = 0
    for delay in (0.31, 0.37, 0.44, 0.52, 0.61, 0.73, 0.86):  # past start-up, then mid-admission
        child = subprocess.Popen([sys.executable, "-c", _WRITER, str(root), str(scratch)])
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        assert child.wait() == -signal.SIGKILL
        torn_temps += len(list((root / "tmp").iterdir()))
        _invariants(Store(root))
    assert torn_temps > 0, "no kill landed inside an admission: the test proved nothing"
    store = Store(root)
    assert list(store.iter_refs()), "no admission completed: lengthen the delays"
    assert all(v.status == "ok" for v in store.verify_all())
    assert store.gc().objects_kept == len(list(store.iter_refs()))
    assert not any((root / "tmp").iterdir())
    _invariants(store)


def test_flipped_byte_is_found_on_resolve_and_quarantined(tmp_path: Path) -> None:
    store = Store(tmp_path / "s")
    good = _blob(tmp_path / "a", os.urandom(4096))
    adm = store.admit("kq", good)
    obj = store.object_path(adm.object)
    os.chmod(obj, 0o644)
    data = bytearray(obj.read_bytes())
    data[100] ^= 0x01
    obj.write_bytes(bytes(data))
    assert store.ref_state("kq") == "fresh"  # stat only, by design: the rehash is verify's job
    store.resolve("kq", verify=False)
    with pytest.raises(Corrupt):
        store.resolve("kq", verify=True)
    assert store.ref_state("kq") == "quarantined"
    record = store.quarantine_record("kq")
    assert record is not None and "hashes to" in record["reason"] and record["ref"]["object"] == adm.object
    assert (store.root / "quarantine" / "objects" / adm.object).exists()
    with pytest.raises(Quarantined):
        store.resolve("kq")
    assert store.verify("kq").status == "quarantined"
    # Repaired only by a new verified admission.
    assert store.admit("kq", good).status == "admitted"
    assert store.ref_state("kq") == "fresh" and store.quarantine_record("kq") is None
    assert store.verify("kq").status == "ok"


def test_verify_all_finds_a_corrupt_unreferenced_object(tmp_path: Path) -> None:
    store = Store(tmp_path / "s")
    adm = store.admit("kv", _blob(tmp_path / "a", b"x" * 100))
    store.gc(keep=set())  # drop the ref; the object goes too
    adm = store.admit("kv", _blob(tmp_path / "a", b"y" * 100))
    store.admit("kv", _blob(tmp_path / "b", b"z" * 100))  # conflict: leaves an orphan object
    orphan = store.object_path(hashlib.sha256(b"z" * 100).hexdigest())
    os.chmod(orphan, 0o644)
    orphan.write_bytes(b"Z" * 100)
    verdicts = store.verify_all()
    assert [v.status for v in verdicts] == ["ok", "corrupt"]
    assert not orphan.exists() and store.resolve("kv").ref.object == adm.object


def test_dangling_ref_reads_missing_and_is_repaired_by_admission(tmp_path: Path) -> None:
    store = Store(tmp_path / "s")
    a = _blob(tmp_path / "a", b"A" * 64)
    adm = store.admit("kd", a)
    store.object_path(adm.object).unlink()
    assert store.ref_state("kd") == "missing"
    with pytest.raises(Missing):
        store.resolve("kd")
    # Even a different artifact may take a key whose artifact is lost; the lost ref is recorded.
    b = _blob(tmp_path / "b", b"B" * 64)
    assert store.admit("kd", b).status == "admitted"
    assert store.resolve("kd").path.read_bytes() == b"B" * 64


def test_gc_keeps_referenced_objects_and_drops_orphans(tmp_path: Path) -> None:
    store = Store(tmp_path / "s")
    k1 = store.admit("k1", _blob(tmp_path / "1", b"one"))
    k2 = store.admit("k2", _blob(tmp_path / "2", b"two"))
    lost = store.admit("k1", _blob(tmp_path / "3", b"three"))  # conflict → orphan object
    (store.root / "tmp" / "stray.tmp").write_bytes(b"half")
    dry = store.gc(dry_run=True)
    assert dry.objects_removed == [lost.object] and dry.temps_removed == 1 and dry.objects_kept == 2
    assert store.object_path(lost.object).exists()
    report = store.gc()
    assert report.objects_removed == [lost.object] and report.bytes_freed == 5
    assert not store.object_path(lost.object).exists()
    assert store.ref_state("k1") == store.ref_state("k2") == "fresh"
    live = store.gc(keep={"k2"})
    assert live.refs_dropped == ["k1"] and live.objects_removed == [k1.object]
    assert store.ref_state("k1") == "missing" and store.resolve("k2").ref.object == k2.object


def test_ref_state_is_cheap_enough_for_a_10000_target_plan(tmp_path: Path) -> None:
    store = Store(tmp_path / "s")
    keys = [f"{i:064x}" for i in range(100)]
    for key in keys:
        store.admit(key, _blob(tmp_path / "b", key.encode()))
    start = time.perf_counter()
    states = [store.ref_state(keys[i % 100]) for i in range(10_000)]
    fresh_s = time.perf_counter() - start
    start = time.perf_counter()
    missing = [store.ref_state(f"e{i:063x}") for i in range(10_000)]
    missing_s = time.perf_counter() - start
    print(f"\nref_state x10000: fresh {fresh_s:.3f} s, missing {missing_s:.3f} s")
    assert set(states) == {"fresh"} and set(missing) == {"missing"}
    assert fresh_s < 3.0 and missing_s < 3.0  # ~0.3 s and ~0.1 s measured; generous for a busy box


def test_an_owned_download_is_linked_in_after_its_bytes_are_hashed_where_they_lie(tmp_path: Path) -> None:
    """A pull hands over the file it downloaded into the store's temp folder: admitted without a
    copy (the object is that file), still re-read first, and never a file from anywhere else."""
    store = Store(tmp_path / "s")
    data = b"downloaded artifact"
    sha = hashlib.sha256(data).hexdigest()
    pulled = _blob(store.temp_dir() / "one.pull", data)
    assert store.admit("k1", pulled, expected_sha256=sha, owned=True).status == "admitted"
    assert store.object_path(sha).stat().st_ino == pulled.stat().st_ino  # linked, not copied
    bad = _blob(store.temp_dir() / "two.pull", b"flipped in the temp folder")
    with pytest.raises(StoreError, match="not the expected"):
        store.admit("k2", bad, expected_sha256=sha, owned=True)
    assert store.ref_state("k2") == "missing"
    outside = _blob(tmp_path / "elsewhere.pull", data)
    with pytest.raises(StoreError, match="an owned admission takes a file of"):
        store.admit("k3", outside, expected_sha256=sha, owned=True)
    assert os.access(outside, os.W_OK) and store.ref_state("k3") == "missing"
    os.chmod(store.object_path(sha), 0o644)
    store.object_path(sha).write_bytes(b"corrupt resident!!!")  # same size, other bytes
    again = _blob(store.temp_dir() / "three.pull", data)
    assert store.admit("k4", again, expected_sha256=sha, owned=True).status == "admitted"
    assert store.object_path(sha).read_bytes() == data  # repaired by the verified download
    _invariants(store)
