"""Running rules in child interpreters: one JSON request in, one JSON object per line out.

The engine never imports torch; it starts `python -m cgbuild_rules.<rule>` instead. A child that
dies (segfault, OOM kill) fails only the jobs it had not answered, with the signal named.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

Result = dict[str, Any]


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def run_child(
    rule: str,
    request: dict[str, Any],
    job_ids: list[str],
    on_result: Callable[[Result], None],
    env: dict[str, str] | None = None,
) -> None:
    """Run one rule child; every job id gets exactly one result through `on_result`."""
    proc = subprocess.Popen(
        [sys.executable, "-m", f"cgbuild_rules.{rule}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env if env is not None else os.environ.copy(),
    )
    assert proc.stdin and proc.stdout and proc.stderr
    proc.stdin.write(json.dumps(request))
    proc.stdin.close()
    answered: set[str] = set()
    for line in proc.stdout:
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            result = json.loads(line)
        except json.JSONDecodeError:
            continue
        if result.get("id") in job_ids and result["id"] not in answered:
            answered.add(result["id"])
            on_result(result)
    err = proc.stderr.read()
    code = proc.wait()
    if len(answered) < len(job_ids):
        tail = " | ".join(err.strip().splitlines()[-3:])
        detail = f"{rule} worker {_describe_exit(code)}" + (f": {tail}" if tail else "")
        for jid in job_ids:
            if jid not in answered:
                on_result(
                    {"id": jid, "ok": False, "code": "worker-crashed", "retryable": True, "detail": detail}
                )


def run_groups(
    rule: str,
    groups: Iterable[tuple[dict[str, Any], list[str]]],
    *,
    workers: int,
    on_result: Callable[[Result], None],
) -> None:
    """Run several children at once (families in parallel), at most `workers` at a time."""
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(run_child, rule, req, ids, on_result) for req, ids in groups]
        for f in futures:
            f.result()
