"""Canonical JSON and digests: the one encoding every identity in cgbuild is hashed through.

Sorted keys, compact separators, ASCII, no NaN. Identity blocks must hold integers, strings,
booleans, null, lists and objects only: a float renders differently across Pythons and locales,
so it is refused rather than hashed.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


class NotCanonical(ValueError):
    """An identity block holds a value that has no stable canonical rendering."""


def _check(value: Any, where: str) -> None:
    if isinstance(value, bool) or value is None or isinstance(value, int | str):
        return
    if isinstance(value, float):
        raise NotCanonical(f"{where}: float {value!r} in an identity block (use an integer or a string)")
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, item in value.items():
            if not isinstance(k, str):
                raise NotCanonical(f"{where}: non-string key {k!r}")
            _check(item, f"{where}.{k}")
        return
    raise NotCanonical(f"{where}: {type(value).__name__} has no canonical rendering")


def canonical_json(value: Any) -> str:
    """Render `value` canonically; refuses floats and foreign types."""
    _check(value, "$")
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def digest(value: Any) -> str:
    """sha256 hex of the canonical rendering of `value`."""
    return hashlib.sha256(canonical_json(value).encode("ascii")).hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def hexfloats(value: Any) -> Any:
    """Copy of `value` with floats as exact hex text, for hashing user config (e.g. mlp_ratio=3.0)."""
    if isinstance(value, float):
        return value.hex()
    if isinstance(value, list | tuple):
        return [hexfloats(v) for v in value]
    if isinstance(value, dict):
        return {k: hexfloats(v) for k, v in value.items()}
    return value
