"""`cgbuild trust keygen`, `cgbuild fetch` and `cgbuild mint` in a real process: the key pair written
once, a bad publisher name and a workspace without a remote refused by name, and a shared store
whose create-only writes are not atomic refused in one line before anything compiles.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.cgfiles import load_ws
from support.cli import cli
from support.s3 import BUCKET, S3, Proxy, child_env
from support.shared import prefix_of
from support.toy import toy_with_remote

from cgbuild.store.trust import SIGNING_KEY_ENV, load_signer, public_key_bytes


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


def test_keygen_refuses_a_bad_publisher_name(tmp_path: Path) -> None:
    keygen = ["trust", "keygen", str(tmp_path / "k.pem"), "--name", "Bad Name"]
    proc = subprocess.run([sys.executable, "-m", "cgbuild.cli", *keygen], capture_output=True, text=True)
    assert proc.returncode == 2 and "bad publisher name" in proc.stderr
    assert not (tmp_path / "k.pem").exists()


def test_fetch_without_a_remote_is_refused(tmp_path: Path) -> None:
    load_ws(tmp_path, 'state = ".cgbuild"')
    proc = cli(tmp_path, "fetch", "--json")
    assert proc.returncode == 2 and "field 'workspace.remote'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_mint_refuses_a_store_whose_concurrent_creates_both_win(
    s3: S3,
    keys: dict[str, tuple[Path, str]],
    toy_reference: Path,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    """A misconfigured store is the workspace's error, not each key's: exit 2, one line naming the
    endpoint and the missing feature, no traceback, nothing compiled, nothing remembered."""
    url = f"s3://{BUCKET}/{prefix_of(request)}"
    ws = toy_with_remote(tmp_path / "toy", toy_reference, url, [keys["ci"][1]])
    with Proxy(s3, racy_create=True) as proxy:
        env = child_env(s3, AWS_ENDPOINT_URL=proxy.url, **{SIGNING_KEY_ENV: str(keys["ci"][0])})
        proc = cli(ws, "mint", "//toy/mlp/8x64-b1@fp32:cpu", "--json", env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("cgbuild: error:")]
    assert "field 'workspace.remote': racy-conditional-write" in line and proxy.url in line
    assert "If-None-Match" in line and proc.stdout == ""
    state = ws / ".cgbuild"
    assert not list((state / "mint").glob("*.log")) and not (state / "cache" / "remotes").exists()
