"""Which processes a test started, whoever they were reparented to: each carries a marker in its
environment (children inherit it: compilers, Ray's daemons and workers, their mint children), so
/proc shows whether anything outlived what should have ended it."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MARK = "CGBUILD_TEST_MARK"


def marked(token: str) -> dict[int, str]:
    """pid -> command line of every live process whose environment carries `MARK={token}`."""
    found: dict[int, str] = {}
    want = f"{MARK}={token}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if want in (proc / "environ").read_bytes().split(b"\0"):
                found[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # gone meanwhile, or not ours
    return found


def wait_for(check: Callable[[], Any], seconds: float) -> Any:
    """`check()` until it is truthy or `seconds` pass; its last answer."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if got := check():
            return got
        time.sleep(0.1)
    return check()
