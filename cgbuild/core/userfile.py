"""Reading a file a person named (a Cgfile, a lock, a plan, a key): its kind and size first.

`open()` + `read()` on whatever a path names can hang (a FIFO no one writes to), never end
(`/dev/zero`) or exhaust memory (a multi-gigabyte file). So the file is opened without blocking,
must be a regular file, and must be no larger than what cgbuild would ever write of its kind;
only then is it read. Each refusal is a `UserError` naming the file.
"""

from __future__ import annotations

import os
import stat

from cgbuild.core.errors import UserError

MIB = 1 << 20


def read(path: str | os.PathLike[str], what: str, limit: int) -> bytes:
    """The bytes of the regular file at `path`, at most `limit` of them; `what` names it."""
    name = os.fspath(path)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise UserError(f"no such {what}", file=name) from None
    except OSError as exc:
        raise UserError(f"cannot read the {what}: {exc.strerror}", file=name) from None
    except ValueError as exc:  # a NUL in the path
        raise UserError(f"cannot read the {what}: {exc}", file=name) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            raise UserError(f"cannot read the {what}: {kind}", file=name)
        if info.st_size > limit:
            raise UserError(f"{what} too large: {info.st_size} bytes (at most {limit})", file=name)
        chunks: list[bytes] = []
        left = limit + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 24))):
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    except OSError as exc:
        raise UserError(f"cannot read the {what}: {exc.strerror}", file=name) from None
    finally:
        os.close(fd)
    if len(data) > limit:  # grew while read
        raise UserError(f"{what} too large: over {limit} bytes", file=name)
    return data
