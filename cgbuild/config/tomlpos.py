"""Where each key of a TOML document was written.

tomllib reports positions only for syntax errors; a semantic error ("unknown SKU 'h100'") must
still name its line. This scanner reads the same text and maps every dotted key path to the line
that defines it: table headers, array-of-table headers, `key = value` lines (dotted and quoted keys
included) and the keys of inline tables on one line. Anything it cannot place falls back to the
nearest enclosing path, so a lookup always answers with the best line known. Lines are split on
"\n" only, as TOML does: `str.splitlines` would also split on U+2028 and form feeds, which a
comment or string may hold, and every later line number would drift.
"""

from __future__ import annotations

import re
import tomllib

_BARE = r"[A-Za-z0-9_-]+"
_QUOTED = r'"(?:[^"\\]|\\.)*"|\'[^\']*\''
_KEYPART = rf"(?:{_BARE}|{_QUOTED})"
_DOTTED = rf"{_KEYPART}(?:\s*\.\s*{_KEYPART})*"
_HEADER = re.compile(rf"^\s*(\[\[?)\s*({_DOTTED})\s*\]\]?")
_ASSIGN = re.compile(rf"^\s*({_DOTTED})\s*=")
_INLINE_KEY = re.compile(rf"[{{,]\s*({_DOTTED})\s*=")


def _key(part: str) -> str:
    """One key part as TOML reads it: a basic-string key's escapes (`"a\\n"`) decoded by tomllib."""
    if part[:1] == "'":
        return part[1:-1]
    if part[:1] == '"':
        try:
            return next(iter(tomllib.loads(f"{part} = 0")))
        except tomllib.TOMLDecodeError:
            return part[1:-1]
    return part


def _split(dotted: str) -> tuple[str, ...]:
    return tuple(_key(p) for p in re.findall(_KEYPART, dotted))


class KeyLines:
    """Dotted key path → 1-based line number, from one TOML source."""

    def __init__(self, text: str) -> None:
        self._lines: dict[tuple[str, ...], int] = {}
        table: tuple[str, ...] = ()
        counters: dict[tuple[str, ...], int] = {}
        in_multiline = False
        for number, raw in enumerate(text.split("\n"), start=1):
            line = raw
            if in_multiline:
                if line.count('"""') % 2 == 1 or line.count("'''") % 2 == 1:
                    in_multiline = False
                continue
            header = _HEADER.match(line)
            if header:
                table = _split(header.group(2))
                if header.group(1) == "[[":
                    index = counters.get(table, 0)
                    counters[table] = index + 1
                    table = (*table, str(index))
                self._lines.setdefault(table, number)
                continue
            assign = _ASSIGN.match(line)
            if assign:
                path = table + _split(assign.group(1))
                self._lines.setdefault(path, number)
                rest = line[assign.end() :]
                for inner in _INLINE_KEY.finditer(rest):
                    self._lines.setdefault(path + _split(inner.group(1)), number)
                if rest.count('"""') % 2 == 1 or rest.count("'''") % 2 == 1:
                    in_multiline = True

    def line(self, *path: str) -> int | None:
        """Line of `path`, or of its nearest ancestor that was written down."""
        parts = tuple(path)
        while parts:
            if parts in self._lines:
                return self._lines[parts]
            parts = parts[:-1]
        return None
