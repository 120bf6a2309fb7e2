"""`cgbuild` run the way a user runs it: its own process in a workspace, its output captured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def cli(
    ws: Path, *args: str, env: dict[str, str] | None = None, timeout: float | None = None
) -> subprocess.CompletedProcess[str]:
    """`cgbuild -C WS ARGS...` in a new interpreter. `env` is the whole environment (None: this
    process's); `timeout` in seconds (None: none)."""
    return subprocess.run(
        [sys.executable, "-m", "cgbuild.cli", "-C", str(ws), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def last_json(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The summary a `--json` command prints last (progress lines may come before it), from a run
    that raised no traceback."""
    assert "Traceback" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]
