"""A workspace that declares a shared store builds it on demand and travels to another process (as a
fleet executor ships it to a worker) with its remote, against moto's S3 server on loopback.
"""

from __future__ import annotations

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
