"""Publisher signing keys: what loads as one, what is refused, and the refusal codes the docs name."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.publishers import keypair

from cgbuild.store.trust import SIGNING_KEY_ENV, TrustError, load_signer

REPO = Path(__file__).resolve().parents[2]


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


def test_trust_error_codes_are_the_documented_ones() -> None:
    text = (REPO / "docs" / "store.md").read_text()
    for code in ("unsigned", "unknown-signer", "bad-signature", "no-signing-key", "no-conditional-write"):
        assert f"`{code}`" in text
    assert TrustError("unsigned", "x").code == "unsigned"
