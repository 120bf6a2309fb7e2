"""Errors a person can act on: each names the file, the line and the field.

The CLI turns any `UserError` into one line on stderr and exit code 2 (bad input); nothing the
user wrote should ever surface as a traceback.
"""

from __future__ import annotations

import re
from typing import TypedDict

_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def _escape(m: re.Match[str]) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str) -> str:
    """`text` with control characters and lone surrogates escaped: what a hostile file holds must
    not move the terminal's cursor or hide part of the message."""
    return _UNPRINTABLE.sub(_escape, text)


class Where(TypedDict, total=False):
    """Where bad input is: `UserError`'s keyword arguments, for a caller that raises several."""

    file: str
    line: int
    field: str


class UserError(Exception):
    """Bad input: a Cgfile, a label, a lock, a plan file. Exit code 2."""

    exit_code = 2

    def __init__(
        self, message: str, *, file: str | None = None, line: int | None = None, field: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.file = file
        self.line = line
        self.field = field

    def __str__(self) -> str:
        where = ""
        if self.file:
            where = self.file if self.line is None else f"{self.file}:{self.line}"
        parts = [p for p in (where, self.field and f"field '{self.field}'") if p]
        text = f"{': '.join(parts)}: {self.message}" if parts else self.message
        return printable(text)
