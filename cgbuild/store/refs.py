"""What a ref is: the one check every reader of a ref makes (the local store, the plan memo, the
shared store), so one crafted ref gets one answer everywhere.

A ref is the JSON object `{"schema", "key", "object", "size", "metadata"}` (a remote ref adds
`signature` and `publisher`): it names the key it was written for, the sha256 of its object and
that object's byte count. Anything else under a ref's name is malformed, never `missing`: a
malformed ref is quarantined with its reason by the commands that repair, and read `mint` by the
commands that only read.
"""

from __future__ import annotations

import json
import re
from enum import StrEnum
from typing import Any

REF_SCHEMA = "cgbuild.ref/1"
"""A local store's ref (a remote ref is `cgbuild.store.shared.REMOTE_REF_SCHEMA`)."""
SHA_RE = re.compile(r"^[0-9a-f]{64}$")


class RefState(StrEnum):
    """What the store holds for a key, as `plan` asks it for every target."""

    FRESH = "fresh"
    """a ref, and its object with the recorded size"""
    MISSING = "missing"
    QUARANTINED = "quarantined"
    MALFORMED = "malformed"
    """something under the ref's name that is not a ref"""


def doc_problem(doc: Any, key: str, schema: str) -> str | None:
    """Why the parsed `doc` is not `key`'s ref of `schema`, or None."""
    if not isinstance(doc, dict):
        return f"a JSON {type(doc).__name__}, not an object"
    if doc.get("schema") != schema or doc.get("key") != key:
        return f"schema {doc.get('schema')!r} and key {str(doc.get('key'))[:16]!r}, not {schema} of this key"
    sha = doc.get("object")
    if not isinstance(sha, str) or not SHA_RE.match(sha):
        return "its object is not a sha256"
    size = doc.get("size")
    if type(size) is not int or size < 0:  # `True` is an int to isinstance, not a byte count
        return f"size {size!r} is not a byte count"
    if not isinstance(doc.get("metadata") or {}, dict):
        return "its metadata is not an object"
    return None


def raw_problem(raw: bytes, key: str, schema: str) -> str | None:
    """Why these bytes are not `key`'s ref of `schema`, or None."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return "not JSON" if raw.strip() else "empty"
    return doc_problem(doc, key, schema)
