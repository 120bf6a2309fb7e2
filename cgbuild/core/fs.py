"""Writing state files, and knowing cheaply whether a file changed.

One durability rule for every file cgbuild writes (records, caches, locks, refs, plans): write a
temp file in the same folder, fsync it, rename it over the target, fsync the folder. A reader
then sees the old file or the new one, never a torn one, and a crash right after the call keeps
the new one. The fsyncs cost milliseconds; a rebuilt cache after a power loss costs more in
confusion than they do in time, so there is no faster, weaker variant.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a folder's entries (a rename, a link) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike[str], data: bytes | str) -> None:
    """Replace `path` with `data` under the one durability rule (the folder is created)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(target.parent)


def write_json(path: str | os.PathLike[str], doc: Any, *, indent: int | None = None) -> None:
    """`write_atomic` of sorted-key JSON (ASCII, so the bytes never depend on a locale)."""
    write_atomic(path, json.dumps(doc, sort_keys=True, indent=indent, ensure_ascii=True) + "\n")


def stat_stamp(path: str | os.PathLike[str]) -> list[int] | None:
    """(mtime ns, size, inode) of a file, None when it is absent: a cache keyed on this misses
    when the file is rewritten, even in place, at the price of one stat."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):  # ValueError: a NUL in a path someone else's file named
        return None
    return [st.st_mtime_ns, st.st_size, st.st_ino]
