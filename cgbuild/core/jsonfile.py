"""Reading JSON that someone else wrote (a plan, a lock, a safetensors header, a state file):
hostile until parsed.

Every way such a document can be unusable becomes a `UserError` naming the file and, where the
parser knows it, the line: unreadable, not UTF-8, not JSON, `NaN`/`Infinity` (JSON has neither),
or nested deeper than the reader allows (Python's parser would raise `RecursionError` on deep
nesting, and every walk over the document would too). One parser for all of them, so a bound
added here holds for every reader.
"""

from __future__ import annotations

import json
from typing import Any

from cgbuild.core import userfile
from cgbuild.core.errors import UserError

MAX_DEPTH = 64
"""Deeper than any plan or lock cgbuild writes, shallow enough for every recursive walk."""


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if isinstance(v, dict):
            stack.extend((item, d + 1) for item in v.values())
        elif isinstance(v, list):
            stack.extend((item, d + 1) for item in v)
    return deepest


def parse(text: str, file: str, *, max_depth: int = MAX_DEPTH, what: str = "") -> Any:
    """Parse JSON text nested at most `max_depth` deep; raises UserError naming `file` (and the
    line of a syntax error), its message led by `what` when given ("safetensors header")."""
    lead = f"{what} is " if what else ""
    too_deep = f"{lead}not usable: nested deeper than {max_depth} levels"
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise UserError(f"{lead}not JSON: {exc.msg}", file=file, line=exc.lineno) from None
    except ValueError as exc:
        raise UserError(f"{lead}not JSON: {exc}", file=file) from None
    except RecursionError:
        raise UserError(too_deep, file=file) from None
    if depth(value) > max_depth:
        raise UserError(too_deep, file=file)
    return value


def decode(raw: bytes, file: str, what: str, *, max_depth: int = MAX_DEPTH) -> Any:
    """Parse JSON bytes (UTF-8) read from `file`; `what` names the document in errors."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(
            f"{what} is not UTF-8: byte 0x{raw[exc.start]:02x}",
            file=file,
            line=raw.count(b"\n", 0, exc.start) + 1,
        ) from None
    return parse(text, file, max_depth=max_depth, what=what)


MAX_BYTES = 512 * userfile.MIB
"""Larger than the plan of 100,000 targets cgbuild would write."""


def load(path: str, what: str) -> Any:
    """Read and parse the JSON file at `path`; `what` names it in errors ("plan file", "lock")."""
    return decode(userfile.read(path, what, MAX_BYTES), path, what)
