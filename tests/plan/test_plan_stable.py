"""The plan JSON is a function of its inputs: the same state planned twice gives the same bytes.

A plan is recorded (the last plan advances) and may be served from what an earlier plan kept,
so this plans examples/toy (real traces), snapshots its state folder, and plans again: in that
state, in the snapshot restored, and once more from the memo, comparing the bytes of
`plan --json`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from support.toy import copy_toy


def plan_bytes(ws: Path) -> bytes:
    proc = subprocess.run(
        [sys.executable, "-m", "cgbuild.cli", "-C", str(ws), "plan", "--json"], capture_output=True
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    return proc.stdout


def test_same_state_plans_byte_identical(tmp_path: Path, toy_reference: Path) -> None:
    ws = copy_toy(tmp_path / "toy", toy_reference)
    first = json.loads(plan_bytes(ws))  # traces every unit, records the targets as new
    assert all(t["key"] for t in first["targets"]), "every toy target is keyed on the CPU"
    state, snapshot = ws / ".cgbuild", tmp_path / "snapshot"
    shutil.copytree(state, snapshot)
    again = plan_bytes(ws)
    shutil.rmtree(state)
    shutil.copytree(snapshot, state)
    restored = plan_bytes(ws)  # in full again, and memoised
    assert again == restored
    assert plan_bytes(ws) == restored  # from the memo
    assert [t["key"] for t in json.loads(again)["targets"]] == [t["key"] for t in first["targets"]]


def memo_index(ws: Path) -> Path:
    (index,) = (ws / ".cgbuild" / "cache" / "plans").glob("*.json")
    return index


def statuses(raw: bytes) -> dict[str, str]:
    return {t["label"]: t["status"] for t in json.loads(raw)["targets"]}


def test_no_op_plan_from_the_memo_is_the_full_plan_and_rechecks_the_store(
    tmp_path: Path, toy_reference: Path
) -> None:
    """A no-op plan is served from the memo (its index is not rewritten) with the very bytes the
    full plan prints; `fresh` is re-checked on the store every time: a ref that appears, an
    object cut short in place and a ref removed each change the plan at once."""
    from cgbuild.store.local import Store

    ws = copy_toy(tmp_path / "toy", toy_reference)
    plan_bytes(ws)  # traces, records every target as new
    full = plan_bytes(ws)  # recording changes nothing now: the memo is written
    index = memo_index(ws)
    stamp = index.stat().st_mtime_ns, index.stat().st_ino
    assert plan_bytes(ws) == full
    assert (index.stat().st_mtime_ns, index.stat().st_ino) == stamp, "the no-op plan was not a memo hit"

    target = json.loads(full)["targets"][0]
    blob = tmp_path / "blob"
    blob.write_bytes(b"an object the plan only stats\n")
    store = Store(ws / ".cgbuild" / "store")
    assert store.admit(target["key"], blob).status == "admitted"
    assert statuses(plan_bytes(ws))[target["label"]] == "fresh"
    warm = plan_bytes(ws)  # the memo now holds the fresh key
    assert statuses(warm)[target["label"]] == "fresh"

    obj = store.object_path(store.read_ref(target["key"]).object)
    obj.chmod(0o644)
    with open(obj, "r+b") as f:
        f.truncate(4)  # in place: the ref file and every folder stamp stay as they were
    assert statuses(plan_bytes(ws))[target["label"]] == "mint"
    store.ref_path(target["key"]).unlink()
    again = json.loads(plan_bytes(ws))
    assert {t["label"]: t["status"] for t in again["targets"]}[target["label"]] == "mint"
    assert again["targets"][0]["reasons"][0]["code"] == "missing-from-store"


def test_an_edited_source_is_never_served_from_the_memo(tmp_path: Path, toy_reference: Path) -> None:
    ws = copy_toy(tmp_path / "toy", toy_reference)
    plan_bytes(ws)
    plan_bytes(ws)
    assert memo_index(ws).exists()
    with open(ws / "toy_models.py", "a") as f:
        f.write("# a comment: the graphs stay, the trace inputs move\n")
    codes = {r["code"] for t in json.loads(plan_bytes(ws))["targets"] for r in t["reasons"]}
    assert {"trace-input-moved", "early-cutoff"} <= codes


def test_with_a_shared_store_the_memo_keeps_only_what_it_can_re_check(tmp_path: Path) -> None:
    """A key fresh here is checked here; one fresh only by the remote must be one the remembered
    listing vouched for (then its row says so, with the listing's time); a key the remote lacks
    is never memoised with a shared store (only a listing of `refs/` could re-check it)."""
    from cgbuild.plan.memo import LISTED, StoreCheck
    from cgbuild.store.local import Store

    root = tmp_path / "store"
    blob = tmp_path / "blob"
    blob.write_bytes(b"an object\n")
    here, remote_only, absent = "a" * 64, "b" * 64, "c" * 64
    assert Store(root).admit(here, blob).status == "admitted"

    local = StoreCheck.of(root, {here: "fresh", absent: "missing"})
    assert local is not None and [r[1] is None for r in local.rows] == [False, True] and local.holds(root)
    assert StoreCheck.of(root, {here: "fresh", absent: "missing"}, (1.0, set())) is None
    assert StoreCheck.of(root, {remote_only: "fresh"}) is None
    assert StoreCheck.of(root, {remote_only: "fresh"}, (1.0, {here})) is None
    shared = StoreCheck.of(root, {here: "fresh", remote_only: "fresh"}, (1.0, {remote_only}))
    assert shared is not None and shared.listed == [remote_only] and shared.listed_at == 1.0
    assert shared.rows[1] == [remote_only, LISTED, None, None] and shared.holds(root)
    only_here = StoreCheck.of(root, {here: "fresh"}, (1.0, {remote_only}))
    assert only_here is not None and only_here.listed == [] and only_here.listed_at is None
