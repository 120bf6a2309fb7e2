"""State files that may be torn or foreign: set aside, warned about once, rebuilt.

Everything under the state folder (the last plan, the trace cache, the source and distribution
caches, the toolchain probe cache) is rebuilt from the workspace when missing. A file there that
cannot be read back (cut short by a crash, written by another version or another tool, edited by
hand) is therefore never fatal and never silently trusted: it is renamed beside itself with a
UTC timestamp (`last-plan.json.torn-20260102T030405Z`, kept for a post-mortem), one warning line
says so on stderr, and the caller starts from empty.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cgbuild.core.errors import UserError, printable


def set_aside(path: Path, why: str, *, companions: tuple[str, ...] = ()) -> Path:
    """Rename `path` (and `path + suffix` for each of `companions`, e.g. SQLite's `-wal`) out of
    the way, warn once, and return the new name. A state folder that refuses the rename is bad
    input (exit 2): rebuilding over a file we cannot move would lose it or fail later."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S%fZ")
    aside = path.with_name(f"{path.name}.torn-{stamp}")
    try:
        os.replace(path, aside)
        for suffix in companions:
            side = path.with_name(path.name + suffix)
            if side.exists():
                os.replace(side, aside.with_name(aside.name + suffix))
    except OSError as exc:
        raise UserError(
            f"unusable state file ({why}) that cannot be set aside: {exc.strerror}", file=str(path)
        ) from None
    print(printable(f"cgbuild: warning: {path}: {why}; set aside as {aside.name}, rebuilt"), file=sys.stderr)
    return aside


def read_json(path: Path, valid: Callable[[Any], bool], what: str, *, fix: str | None = None) -> Any | None:
    """The JSON document at `path` if `valid(doc)`; None if there is none. A document that is
    unreadable, not JSON or not `valid` is set aside (one warning) and None is returned: the
    caller rebuilds it. A file nothing rebuilds (a mint record) passes `fix`, what a person does
    about it: such a file is refused instead (a UserError naming it, what is wrong and `fix`)
    and left where it is."""

    def unusable(why: str) -> None:
        if fix is not None:
            raise UserError(f"{why}: {fix}", file=str(path))
        set_aside(path, why)

    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:  # e.g. a folder where the file should be
        if path.is_dir() and not path.is_symlink():
            unusable(f"{what} is a folder")
            return None
        raise UserError(f"cannot read the {what}: {exc.strerror}", file=str(path)) from None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        unusable(f"{what} is not JSON (torn?)")
        return None
    try:
        ok = valid(doc)
    except (AttributeError, TypeError, KeyError, IndexError, ValueError):
        ok = False
    if not ok:
        unusable(f"{what} has an unexpected shape (another version, or edited?)")
        return None
    return doc


def is_str_map(value: Any) -> bool:
    """A JSON object of strings to strings (e.g. distribution → version)."""
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
