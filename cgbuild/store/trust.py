"""Who may publish to a shared store: ed25519 signatures over canonical statements.

A shared store is written by many machines, so a ref's bytes alone prove nothing about who
built the artifact. A publisher signs a canonical statement binding the artifact key, the
object's sha256 and its size; a reader verifies it against the publisher keys the workspace
trusts. Binding all three catches a swapped ref (another key's artifact under this key), a
swapped object (other bytes under this sha are caught by the hash) and a truncated one.

The private key never lives in the Cgfile: it comes from `CGBUILD_SIGNING_KEY` (a path to a PEM
PKCS#8 key, or to the 32 raw bytes). `cryptography` is imported only when a key is used, so a
workspace without a remote never pays for it.
"""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cgbuild.core.canon import canonical_json, digest_unguarded
from cgbuild.core.codes import Code
from cgbuild.core.publickey import b64, key_id, public_key_bytes

SIGNING_KEY_ENV = "CGBUILD_SIGNING_KEY"
SIGNATURE_SCHEMA = "cgbuild.signature/1"
ARTIFACT_STATEMENT = "cgbuild.signed-artifact/1"
FACTS_STATEMENT = "cgbuild.signed-facts/1"

# Stable refusal codes (docs/store.md).
UNSIGNED = Code.UNSIGNED
UNKNOWN_SIGNER = Code.UNKNOWN_SIGNER
BAD_SIGNATURE = Code.BAD_SIGNATURE


class TrustError(Exception):
    """A signature check failed; `code` is one of the stable refusal codes above."""

    def __init__(self, code: Code, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


def artifact_statement(key: str, sha256: str, size: int) -> dict[str, Any]:
    return {"schema": ARTIFACT_STATEMENT, "key": key, "sha256": sha256, "size": size}


def facts_statement(inputs: str, facts: dict[str, Any]) -> dict[str, Any]:
    # facts may hold floats (contracts of float literals): digest them unguarded, like the cache key
    return {"schema": FACTS_STATEMENT, "inputs": inputs, "facts": digest_unguarded(facts)}


@dataclass(frozen=True)
class Signer:
    """A publisher's private key, loaded from the environment."""

    private: Any  # cryptography's Ed25519PrivateKey
    public: bytes
    source: str

    def sign(self, statement: dict[str, Any]) -> dict[str, Any]:
        """A signature record for `statement`, kept beside what it signs (ref or facts)."""
        sig = self.private.sign(canonical_json(statement).encode())
        return {
            "schema": SIGNATURE_SCHEMA,
            "key_id": key_id(self.public),
            "public_key": b64(self.public),
            "signature": b64(sig),
        }


def load_signer(env: dict[str, str] | None = None) -> Signer | None:
    """The signer named by `CGBUILD_SIGNING_KEY`, or None when it is unset.

    Raises ValueError naming the file when the variable points at something that is not an
    ed25519 private key: a declared key either works or stops the run.
    """
    path = (os.environ if env is None else env).get(SIGNING_KEY_ENV)
    if not path:
        return None
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{SIGNING_KEY_ENV}={path}: cannot read: {e.strerror}") from None
    try:
        if len(data) == 32:
            private = Ed25519PrivateKey.from_private_bytes(data)
        else:
            loaded = serialization.load_pem_private_key(data, password=None)
            if not isinstance(loaded, Ed25519PrivateKey):
                raise ValueError(f"a {type(loaded).__name__}, not an ed25519 key")
            private = loaded
    except ValueError as e:
        raise ValueError(f"{SIGNING_KEY_ENV}={path}: not an ed25519 private key ({e})") from None
    public = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return Signer(private, public, path)


def verify(record: Any, statement: dict[str, Any], trusted: dict[str, bytes]) -> str:
    """The trusted name that signed `statement`; raises TrustError with a stable code otherwise."""
    if not isinstance(record, dict) or record.get("schema") != SIGNATURE_SCHEMA:
        raise TrustError(UNSIGNED, "no signature: the publisher did not sign it")
    try:
        public = public_key_bytes(str(record.get("public_key")))
        sig = base64.b64decode(str(record.get("signature")), validate=True)
    except (ValueError, binascii.Error) as e:
        raise TrustError(BAD_SIGNATURE, f"malformed signature record: {e}") from None
    name = next((n for n, k in trusted.items() if k == public), None)
    if name is None:
        raise TrustError(
            UNKNOWN_SIGNER,
            f"signed by key {key_id(public)}, which the workspace does not trust "
            f"(trusted: {', '.join(sorted(trusted)) or 'none'})",
        )
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        Ed25519PublicKey.from_public_bytes(public).verify(sig, canonical_json(statement).encode())
    except InvalidSignature:
        raise TrustError(
            BAD_SIGNATURE, f"{name}'s signature does not match {canonical_json(statement)}"
        ) from None
    return name


def keygen(path: Path, name: str) -> str:
    """Write a new private key to `path` (PEM, mode 0600; never overwritten) and its public line
    to `path.pub`; returns the `trusted` entry `name:<base64 raw public key>`."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    public = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    line = f"{name}:{b64(public)}"
    Path(f"{path}.pub").write_text(line + "\n")
    return line
