"""Canonical JSON and digests: the one encoding every identity in cgbuild is hashed through.

Sorted keys, compact separators, ASCII, no NaN. Identity blocks must hold integers, strings,
booleans, null, lists and objects only: a float renders differently across Pythons and locales,
so it is refused rather than hashed.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any


class NotCanonical(ValueError):
    """An identity block holds a value that has no stable canonical rendering."""


_LEAVES = (str, int, bool, type(None))


def _first_bad(value: Any) -> tuple[str, Any, bool] | None:
    """(path, value, is_key) of the first non-canonical value or key, or None. Iterative, and builds no path
    strings unless something is wrong: a warm plan digests tens of thousands of small blocks."""
    stack: list[Any] = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, _LEAVES):
            continue
        if isinstance(v, dict):
            for k, item in v.items():
                if not isinstance(k, str):
                    return _path_to(value, v) or "$", k, True
                stack.append(item)
        elif isinstance(v, list | tuple):
            stack.extend(v)
        else:
            return _path_to(value, v) or "$", v, False
    return None


def _path_to(root: Any, target: Any, where: str = "$") -> str | None:
    """Where `target` sits inside `root` (only called to word an error)."""
    if root is target:
        return where
    if isinstance(root, dict):
        children = ((f"{where}.{k}", item) for k, item in root.items())
    elif isinstance(root, list | tuple):
        children = ((f"{where}[{i}]", item) for i, item in enumerate(root))
    else:
        return None
    for sub, item in children:
        found = _path_to(item, target, sub)
        if found:
            return found
    return None


def _check(value: Any) -> None:
    bad = _first_bad(value)
    if bad is None:
        return
    where, v, is_key = bad
    if is_key:
        raise NotCanonical(f"{where}: non-string key {v!r}")
    if isinstance(v, float):
        raise NotCanonical(f"{where}: float {v!r} in an identity block (use an integer or a string)")
    raise NotCanonical(f"{where}: {type(v).__name__} has no canonical rendering")


def canonical_json(value: Any) -> str:
    """Render `value` canonically; refuses floats and foreign types."""
    _check(value)
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def digest(value: Any) -> str:
    """sha256 hex of the canonical rendering of `value`."""
    return hashlib.sha256(canonical_json(value).encode("ascii")).hexdigest()


def file_digest(path: str | os.PathLike[str], chunk: int = 1 << 20) -> tuple[str, int]:
    """(sha256, size) of a file, counted from the bytes read (the store's and the shared store's
    admission compare both)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            size += len(block)
    return h.hexdigest(), size


def sha256_file(path: str | os.PathLike[str]) -> str:
    return file_digest(path)[0]


def hexfloats(value: Any) -> Any:
    """Copy of `value` with floats as exact hex text, for hashing user config (e.g. mlp_ratio=3.0)."""
    if isinstance(value, float):
        return value.hex()
    if isinstance(value, list | tuple):
        return [hexfloats(v) for v in value]
    if isinstance(value, dict):
        return {k: hexfloats(v) for k, v in value.items()}
    return value


def digest_unguarded(value: Any) -> str:
    """sha256 of the same canonical rendering, without the identity guard.

    For over-keyed cache inputs only (trace inputs): a value that renders unstably there costs
    a spurious re-trace, never a wrong key, and the guard's walk is most of a warm plan's cost.
    """
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).hexdigest()
