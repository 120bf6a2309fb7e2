"""What the store refuses, typed: each error's `code` is stable and machine-readable (docs/codes.md)."""

from __future__ import annotations

from cgbuild.core.codes import Code


class StoreError(Exception):
    """The store cannot do what was asked; `code` is stable and machine-readable."""

    code = Code.STORE_ERROR

    def __init__(self, key: str | None, detail: str) -> None:
        super().__init__(f"{key}: {detail}" if key else detail)
        self.key = key
        self.detail = detail


class Missing(StoreError):
    """No ref for the key, or its object is gone: the key must be minted."""

    code = Code.MISSING


class Quarantined(StoreError):
    """The key's artifact was pulled for corruption; only a new verified admission repairs it."""

    code = Code.QUARANTINED


class Corrupt(StoreError):
    """The bytes do not hash to their name (found on verify/resolve); the key is now quarantined."""

    code = Code.CORRUPT


class KeyMismatch(StoreError):
    """The key's ref names another key's sealed artifact; the ref is now quarantined."""

    code = Code.KEY_MISMATCH


class MalformedRef(StoreError):
    """The key's ref is not a ref (not JSON, not an object, a folder, a foreign schema or key, a
    size that is no integer). Readers treat the key as not fresh; writers quarantine it (`heal`)."""

    code = Code.MALFORMED_REF


class DiskFull(StoreError):
    """The store's disk refused a write at admission; nothing of the key was made visible."""

    code = Code.DISK_FULL
