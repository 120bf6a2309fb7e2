"""A module-level literal of an entry's source (`LANES = {...}`, `CALLS = {...}`), read without
importing the entry, so the Cgfile can be checked with file and line and a warm plan never pays
for torch.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

from cgbuild.core.entry import entry_files
from cgbuild.core.errors import UserError


def read_literal(source: str, file: str, name: str) -> tuple[Any, int] | None:
    """(the value assigned to `name` at module level, its line), or None when the source has none.
    Raises a `UserError` naming the file (and line) for a source that does not parse or a value
    that is not a literal."""
    try:
        tree = ast.parse(source, filename=file)
    except SyntaxError as e:
        raise UserError(f"cannot parse the entry: {e.msg}", file=file, line=e.lineno) from None
    except (ValueError, RecursionError, MemoryError) as e:  # a NUL byte; nesting too deep
        raise UserError(f"cannot parse the entry: {type(e).__name__}", file=file) from None
    node: ast.expr | None = None
    line = 0
    for stmt in tree.body:
        targets = stmt.targets if isinstance(stmt, ast.Assign) else []
        if isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            targets = [stmt.target]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            node, line = stmt.value, stmt.lineno  # type: ignore[attr-defined]
    if node is None:
        return None
    try:
        return ast.literal_eval(node), line
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):  # e.g. {[1]: 2}
        raise UserError(
            f"{name} must be a literal (cgbuild reads it without importing the entry)",
            file=file,
            line=line,
            field=name,
        ) from None


def read_entry_literal(root: Path, entry: str, name: str) -> tuple[Any, int, str] | None:
    """(value, line, file) of the literal `name` in an entry's source under `root`, or None when
    the entry has no source there or the source no such literal."""
    files = entry_files(root, entry)
    if not files:
        return None
    try:
        source = files[0].read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read the entry: {e}", file=str(files[0])) from None
    found = read_literal(source, str(files[0]), name)
    return None if found is None else (*found, str(files[0]))


def read_entry_table(
    root: Path, entry: str, name: str, maps: str, keys: re.Pattern[str]
) -> tuple[dict[str, Any], int, str] | None:
    """(value, line, file) of an entry's table `name` (`CALLS`, `PIXEL_FRAMES`), or None when it
    states none; anything but a non-empty dict whose keys all match `keys` (module names) is
    refused with the file and line, saying what the table `maps` ("module -> adapter")."""
    found = read_entry_literal(root, entry, name)
    if found is None:
        return None
    raw, line, path = found
    if not isinstance(raw, dict) or not raw:
        raise UserError(f"{name} must be a non-empty dict: {maps}", file=path, line=line, field=name)
    for key in raw:
        if not isinstance(key, str) or not keys.fullmatch(key):
            raise UserError(f"{name}: bad module name {key!r}", file=path, line=line, field=name)
    return raw, line, path
