"""`plan --verify`: a key the shared store lists is fresh only when its ref's signature verifies.

Against moto's S3 server on loopback (tests/support/s3.py) with the toy workspace: one real trace,
then refs forged straight through the S3 API for the planned key.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from pathlib import Path
from typing import Any

from support.cli import cli
from support.publishers import keypair
from support.s3 import BUCKET, S3, child_env
from support.toy import copy_toy

from cgbuild.core.canon import canonical_json, sha256_file
from cgbuild.store import trust
from cgbuild.store.s3 import Remote
from cgbuild.store.trust import SIGNING_KEY_ENV, load_signer

MLP8 = "//toy/mlp/8x64-b1@fp32:cpu"


def plan_target(ws: Path, env: dict[str, str], *flags: str) -> dict[str, Any]:
    proc = cli(ws, "plan", MLP8, "--json", *flags, env=env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    (target,) = json.loads(proc.stdout)["targets"]
    return target  # type: ignore[no-any-return]


def declare_remote(ws: Path, url: str, entries: list[str]) -> None:
    cg = ws / "Cgfile"
    text = re.sub(r"^remote = .*\ntrusted = .*\n", "", cg.read_text(), flags=re.M)
    declared = f"[workspace]\nremote = {json.dumps(url)}\ntrusted = {json.dumps(entries)}\n"
    cg.write_text(text.replace("[workspace]\n", declared, 1))


def forge(url: str, key: str, folder: Path, signature: Any) -> None:
    """An object and a ref naming it for `key`, with this signature record, through the S3 API."""
    remote = Remote(url)
    art = folder / f"{secrets.token_hex(4)}.bin"
    art.write_bytes(secrets.token_bytes(512))
    sha, size = sha256_file(str(art)), art.stat().st_size
    remote.upload(art, sha)
    doc = {"schema": "cgbuild.remote-ref/1", "key": key, "object": sha, "size": size}
    if callable(signature):
        doc["signature"] = signature(key, sha, size)
    assert remote.create(remote.ref_name(key), canonical_json(doc).encode())


def test_plan_verify_reads_untrusted_listed_keys_mint_and_trusted_ones_fresh(
    s3: S3, toy_reference: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "keys"
    (ci_path, ci_entry), (stranger_path, _) = keypair(folder, "ci"), keypair(folder, "stranger")
    ci, stranger = (
        load_signer({SIGNING_KEY_ENV: str(ci_path)}),
        load_signer({SIGNING_KEY_ENV: str(stranger_path)}),
    )
    assert ci and stranger
    ws = copy_toy(tmp_path / "toy", toy_reference)
    env = child_env(s3, **{SIGNING_KEY_ENV: None})
    first = f"s3://{BUCKET}/verify-{secrets.token_hex(3)}"
    declare_remote(ws, first, [ci_entry])
    planned = plan_target(ws, env)  # traces once; the key is missing everywhere
    key = planned["key"]
    assert planned["status"] == "mint" and key

    def signed_by(signer: trust.Signer, statement_key: str | None = None) -> Any:
        return lambda k, sha, size: signer.sign(trust.artifact_statement(statement_key or k, sha, size))

    cases = {
        "unsigned": None,
        "unknown-signer": signed_by(stranger),
        "bad-signature": signed_by(ci, secrets.token_hex(32)),  # another key's statement
    }
    for code, signature in cases.items():
        url = f"s3://{BUCKET}/verify-{code}-{secrets.token_hex(3)}"
        declare_remote(ws, url, [ci_entry])
        forge(url, key, tmp_path, signature)
        assert plan_target(ws, env)["status"] == "fresh"  # the listing alone vouches for it
        verified = plan_target(ws, env, "--verify")
        assert verified["status"] == "mint" and verified["key"] == key, (code, verified)
        (reason,) = [r for r in verified["reasons"] if r.get("root")]
        assert reason["code"] == code and "not trusted" in reason["detail"], reason
        again = plan_target(ws, env, "--verify")  # never a memoised "fresh"
        assert again["status"] == "mint"
    url = f"s3://{BUCKET}/verify-good-{secrets.token_hex(3)}"
    declare_remote(ws, url, [ci_entry])
    forge(url, key, tmp_path, signed_by(ci))
    assert plan_target(ws, env, "--verify")["status"] == "fresh"


def test_plan_verify_without_a_remote_is_refused(toy_reference: Path, tmp_path: Path) -> None:
    ws = copy_toy(tmp_path / "toy", toy_reference)
    proc = cli(ws, "plan", "--no-trace", "--verify", env=dict(os.environ))
    assert proc.returncode == 2 and "field 'workspace.remote'" in proc.stderr and "--verify" in proc.stderr
    assert "Traceback" not in proc.stderr
