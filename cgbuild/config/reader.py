"""Typed reading of a TOML table that names the exact file, line and field on failure: what
every Cgfile table is read through, so one hostile value gets one refusal wherever it sits."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cgbuild.config.tomlpos import KeyLines
from cgbuild.core.errors import UserError

NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
MAX_CONFIG_DEPTH = 32
"""`config` nesting beyond this is refused: it is hashed and handed to the entry as it is."""
MAX_PATH_BYTES = 4095
MAX_NAME_BYTES = 255


class Reader:
    """Typed access to one TOML table that reports the exact field on failure."""

    def __init__(self, path: Path, lines: KeyLines) -> None:
        self.path = path
        self.lines = lines

    def fail(self, message: str, *where: str) -> UserError:
        return UserError(message, file=str(self.path), line=self.lines.line(*where), field=".".join(where))

    def table(self, value: Any, where: tuple[str, ...], allowed: set[str] | None) -> dict[str, Any]:
        """`value` checked to be a table whose keys are in `allowed` (None: any key, e.g. names)."""
        if not isinstance(value, dict):
            raise self.fail(f"expected a table, got {kind(value)}", *where)
        for key in value:
            if allowed is not None and key not in allowed:
                hint = f" (known: {', '.join(sorted(allowed))})" if allowed else ""
                raise self.fail(f"unknown key '{key}'{hint}", *where, key)
        return value

    def get(
        self,
        table: dict[str, Any],
        where: tuple[str, ...],
        key: str,
        check: Callable[[Any], bool],
        expected: str,
        *,
        required: bool = False,
        default: Any = None,
    ) -> Any:
        if key not in table:
            if required:
                raise self.fail(f"missing required key '{key}'", *where, key)
            return default
        value = table[key]
        if not check(value):
            raise self.fail(f"expected {expected}, got {kind(value)} {value!r}", *where, key)
        return value

    def name(self, value: str, *where: str) -> str:
        if not NAME.fullmatch(value):
            raise self.fail(
                f"bad name '{value}': names use [a-z0-9._-] and start with a letter or digit", *where
            )
        return value

    def pathname(self, value: str, *where: str) -> str:
        """A path string the OS can take: no NUL or control character, not too long."""
        if not value:
            raise self.fail("empty path", *where)
        if CONTROL.search(value):
            raise self.fail(f"path {value!r} holds a control character", *where)
        try:
            raw = os.fsencode(value)
        except UnicodeEncodeError:
            raise self.fail(f"path {value!r} cannot be encoded for this file system", *where) from None
        if len(raw) > MAX_PATH_BYTES or any(len(part) > MAX_NAME_BYTES for part in raw.split(b"/")):
            raise self.fail(
                f"path too long ({len(raw)} bytes; at most {MAX_PATH_BYTES}, {MAX_NAME_BYTES} per name)",
                *where,
            )
        return value

    def folder(self, path: Path, *where: str) -> Path:
        """`path` is, or can be created as, a folder: it and its nearest existing ancestor are folders."""
        probe = path
        while True:
            try:
                is_dir = probe.is_dir()
                exists = is_dir or probe.exists() or probe.is_symlink()
            except OSError as exc:  # e.g. a symlink loop, or a folder we may not search
                raise self.fail(f"cannot use '{probe}' as a folder: {exc.strerror}", *where) from None
            if exists:
                if not is_dir:
                    what = (
                        "is not a folder" if probe == path else f"is under '{probe}', which is not a folder"
                    )
                    raise self.fail(f"'{path}' {what}", *where)
                return path
            if probe.parent == probe:
                return path
            probe = probe.parent

    def finite(self, value: float | int, *where: str) -> float | int:
        if isinstance(value, float) and not math.isfinite(value):
            raise self.fail(f"{value!r} is not a finite number", *where)
        return value

    def positive(self, value: float | int, high: int, *where: str) -> float | int:
        """A finite number in (0, high]: inf, nan and 1e300 are typos, never values."""
        if not 0 < self.finite(value, *where) <= high:
            raise self.fail(f"{value!r} is out of range: must be positive and at most {high}", *where)
        return value

    def glob(self, pattern: str, *where: str) -> str:
        """A relative glob inside the workspace that pathlib accepts (`**` only as a whole name)."""
        if not pattern:
            raise self.fail("empty glob: it names no file", *where)
        self.pathname(pattern, *where)
        parts = pattern.split("/")
        if pattern.startswith("/") or "\\" in pattern:
            raise self.fail(f"bad glob '{pattern}': sources are relative to the Cgfile's folder", *where)
        if ".." in parts:
            raise self.fail(f"bad glob '{pattern}': '..' would reach outside the workspace", *where)
        if any("**" in p and p != "**" for p in parts):
            raise self.fail(f"bad glob '{pattern}': '**' must be a whole path component", *where)
        if not any(p not in ("", ".") for p in parts):
            raise self.fail(f"bad glob '{pattern}': names no file", *where)
        return pattern


def config_value(r: Reader, value: Any, where: tuple[str, ...], depth: int = 0) -> Any:
    """A family's `config`, checked: only TOML's plain values (no dates or times, which have no
    canonical rendering), finite numbers, bounded nesting."""
    if depth > MAX_CONFIG_DEPTH:
        raise r.fail(f"nested deeper than {MAX_CONFIG_DEPTH} levels", *where)
    if isinstance(value, dict):
        return {k: config_value(r, v, (*where, k), depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [config_value(r, v, where, depth + 1) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        raise r.fail(f"{value!r} is not a finite number", *where)
    if isinstance(value, str | int | float | bool):
        return value
    raise r.fail(f"a {type(value).__name__} has no canonical rendering: write it as a string", *where)


def kind(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "float", str: "string", list: "array", dict: "table"}.get(
        type(value), type(value).__name__
    )


def is_str(v: Any) -> bool:
    return isinstance(v, str)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    return (isinstance(v, int | float)) and not isinstance(v, bool)


def is_str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def is_int_list(v: Any) -> bool:
    return isinstance(v, list) and all(is_int(x) for x in v)


def is_num_list(v: Any) -> bool:
    return isinstance(v, list) and all(is_num(x) for x in v)
