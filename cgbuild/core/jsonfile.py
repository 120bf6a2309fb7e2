"""Reading a JSON file that someone else wrote (a plan, a lock): hostile until parsed.

Every way such a file can be unusable becomes a `UserError` naming the file and, where the
parser knows it, the line: unreadable, not UTF-8, not JSON, `NaN`/`Infinity` (JSON has neither),
or nested deeper than any document cgbuild writes (Python's parser would raise `RecursionError`
on deep nesting, and every walk over the document would too).
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


def parse(text: str, file: str) -> Any:
    """Parse JSON text; raises UserError naming `file` (and the line of a syntax error)."""
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise UserError(f"not JSON: {exc.msg}", file=file, line=exc.lineno) from None
    except ValueError as exc:
        raise UserError(f"not JSON: {exc}", file=file) from None
    except RecursionError:
        raise UserError(f"not usable: nested deeper than {MAX_DEPTH} levels", file=file) from None
    if depth(value) > MAX_DEPTH:
        raise UserError(f"not usable: nested deeper than {MAX_DEPTH} levels", file=file)
    return value


MAX_BYTES = 512 * userfile.MIB
"""Larger than the plan of 100,000 targets cgbuild would write."""


def load(path: str, what: str) -> Any:
    """Read and parse the JSON file at `path`; `what` names it in errors ("plan file", "lock")."""
    raw = userfile.read(path, what, MAX_BYTES)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(
            f"{what} is not UTF-8: byte 0x{raw[exc.start]:02x}",
            file=path,
            line=raw.count(b"\n", 0, exc.start) + 1,
        ) from None
    return parse(text, path)
