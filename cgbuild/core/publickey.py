"""The text form of an ed25519 public key, parsed without importing `cryptography`.

The Cgfile's `trusted` entries carry it, so reading a Cgfile must not depend on the store's
signing code (which imports `cryptography` only when a shared store is used).
"""

from __future__ import annotations

import base64
import binascii
import hashlib


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def public_key_bytes(text: str) -> bytes:
    """The 32 raw bytes of a base64 ed25519 public key; ValueError when it is not one."""
    try:
        raw = base64.b64decode(text, validate=True)
    except binascii.Error as e:
        raise ValueError(f"not base64: {e}") from None
    if len(raw) != 32:
        raise ValueError(f"an ed25519 public key is 32 bytes, this decodes to {len(raw)}")
    return raw


def key_id(public: bytes) -> str:
    """A short, stable name for a public key (shown in refusals and listings)."""
    return hashlib.sha256(public).hexdigest()[:16]
