"""A workspace that declares a shared store builds it on demand, travels to another process (as a
fleet executor ships it to a worker) with its remote, and remembers the store's passed probe in
its state folder, against each S3 server of the `s3` fixture on loopback.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.cgfiles import load_ws
from support.s3 import BUCKET, S3
from support.shared import prefix_of


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


def test_a_passed_probe_is_remembered_in_the_workspace_state(
    s3: S3, tmp_path: Path, keys: dict[str, tuple[Path, str]], signing: None, request: pytest.FixtureRequest
) -> None:
    from cgbuild.plan.workspace import Workspace

    prefix = prefix_of(request)
    cg = load_ws(tmp_path, f'remote = "s3://{BUCKET}/{prefix}"\ntrusted = ["{keys["ci"][1]}"]')
    first = Workspace(cg).shared()
    assert first is not None
    first.check_publishable()
    (memo,) = Workspace(cg).state.remotes.glob("*.json")
    doc = json.loads(memo.read_text())
    assert (doc["endpoint"], doc["bucket"], doc["prefix"]) == (s3.endpoint, BUCKET, f"{prefix}/")
    later = Workspace(cg).shared()  # the next process
    assert later is not None
    puts: list[str] = []
    later.remote.client.meta.events.register("before-call.s3.PutObject", lambda **_: puts.append("put"))
    later.check_publishable()
    assert later.remote.probed and puts == []
