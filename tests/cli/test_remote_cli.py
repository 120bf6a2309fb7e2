"""`cgbuild trust keygen` and `cgbuild fetch` in a real process, where no store needs to answer: the
key pair written once, a bad publisher name and a workspace without a remote refused by name.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.cgfiles import load_ws
from support.cli import cli

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
