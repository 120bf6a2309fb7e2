"""Where an entry's module lives under the Cgfile's folder (`package.module:build`).

One producer: the trace inputs hash these files and the lane table is read from the first, so
the file a key covers is the file the lanes were read from.
"""

from __future__ import annotations

from pathlib import Path


def entry_files(root: Path, entry: str) -> list[Path]:
    """The entry module's source files that exist: `a/b.py`, then `a/b/__init__.py`."""
    parts = entry.partition(":")[0].split(".")
    candidates = (root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py"))
    return [c for c in candidates if c.is_file()]
