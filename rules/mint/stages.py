"""Both sides of the go-file protocol between the worker and its stage children.

The worker starts a stage before its input exists (`Stage`), hands each part its input as
`go-<part>.json` and waits for `<part>.json`; the stage waits for its go (`await_go`) and writes
its result, or its failure as `<stage>.json` (`cgbuild_rules.mint.worker.stage_main`). A stage's
death, a failure it reports or a part past its time is that part's typed failure, never a hang.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cgbuild_rules.mint.failure import MintFailure

from cgbuild.core import fs
from cgbuild.core.codes import Code
from cgbuild.protocol import spawn

# test hook: "<stage>:<SIGNAL>" makes that stage kill itself; "<stage>:hang" makes it wait on a
# child that never ends (a compiler that hangs)
FAULT_ENV = "CGBUILD_MINT_FAULT"
POLL_S = 0.05
"""How often the check stage and the worker look for each other's files."""


def echo(log: Path, stage: str) -> None:
    """Copy a stage's output to this worker's stderr, which the engine keeps as the key's log:
    the work folder holding the stage logs is removed when the mint succeeds."""
    text = log.read_text(errors="replace") if log.exists() else ""
    sys.stderr.write(f"== {stage} stage ({len(text.splitlines())} lines) ==\n{text}")
    sys.stderr.flush()


def stage_result(path: Path) -> dict[str, Any]:
    """A stage's result file: the result, or the failure it reports raised as a MintFailure."""
    result = json.loads(path.read_text())
    if not result.get("ok"):
        extra = {k: v for k, v in result.items() if k not in ("ok", "code", "detail")}
        raise MintFailure(result["code"], result["detail"], **extra)
    return dict(result)


def ended_failure(ended: spawn.Ended, what: str, timeout_s: float) -> MintFailure:
    """How a stage child that left no result ended, as the typed failure of `what`."""
    failure = ended.failure(what, timeout_s)
    extra = {"signal": failure["signal"]} if "signal" in failure else {}
    return MintFailure(failure["code"], failure["detail"], **extra)


class Stage:
    """One stage child, started before its input exists so that its imports overlap what comes
    first (the compile stage's trace, the check stage's module build beside the compile). Each
    `part` hands the child its input (`go-<part>.json`) and waits for `<part>.json`; the child's
    death, a failure it reports (`<stage>.json`) or `timeout_s` without a result is the part's
    typed failure. A stage starts programs of its own (the compiler), so it dies by SIGTERM and
    passes it on to its group (`spawn.die_with_group`)."""

    def __init__(self, name: str, work: Path, env: Mapping[str, str], timeout_s: float) -> None:
        self.name, self.work, self.timeout_s = name, work, timeout_s
        (work / f"{name}.json").unlink(missing_ok=True)
        self.pid: int | None = None
        self.ended: spawn.Ended | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(dict(env),), daemon=True)
        self.thread.start()

    def _run(self, env: dict[str, str]) -> None:
        try:
            self.ended = spawn.spawn(
                "cgbuild_rules.mint",
                ["--stage", self.name, str(self.work)],
                talk=spawn.Talk(started=self._started),
                log=self.work / f"{self.name}.log",
                env=env,
                death_signal=signal.SIGTERM,
            )
        except BaseException as e:  # spawn refused to start (cgbuild is stopping): the part says so
            self.error = e

    def _started(self, pid: int) -> None:
        self.pid = pid

    def part(self, name: str, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
        fs.write_atomic(self.work / f"go-{name}.json", json.dumps(dict(given or {})))
        result_path = self.work / f"{name}.json"
        deadline = time.monotonic() + self.timeout_s
        while not result_path.exists():
            if not self.thread.is_alive() and not result_path.exists():
                self._died(name)
            if time.monotonic() > deadline:
                self.stop()
                raise MintFailure(Code.TIMEOUT, f"{name} stage: no result within {self.timeout_s:.0f} s")
            time.sleep(POLL_S)
        return stage_result(result_path)

    def _died(self, name: str) -> None:
        self.thread.join()
        echo(self.work / f"{self.name}.log", self.name)
        if self.error is not None:
            raise MintFailure(Code.WORKER_KILLED, f"{name} stage did not start: {self.error}")
        if (self.work / f"{self.name}.json").exists():
            stage_result(self.work / f"{self.name}.json")  # raises the failure the stage reported
        assert self.ended is not None
        raise ended_failure(self.ended, f"{name} stage", self.timeout_s)

    def finish(self) -> None:
        self.thread.join(self.timeout_s)
        if self.thread.is_alive():
            self.stop()
        echo(self.work / f"{self.name}.log", self.name)

    def stop(self) -> None:
        """End the child and its group now (the mint failed, or a part outlived its time); one
        still starting is waited for, so the kill cannot miss it."""
        deadline = time.monotonic() + 30
        while self.pid is None and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        if self.pid is not None and self.thread.is_alive():
            spawn.kill_group(self.pid)
        self.thread.join(30)


# ---- stages (torch) ----------------------------------------------------------------------------
def fault(stage: str) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if spec.partition(":")[0] == stage:
        if spec.partition(":")[2] == "hang":
            subprocess.run(["sleep", "3600"], check=False)
        os.kill(os.getpid(), getattr(signal, spec.partition(":")[2] or "SIGKILL"))


def await_go(work: Path, part: str) -> dict[str, Any]:
    """Wait for the worker to hand this stage `part`'s input (`go-<part>.json`, written atomically)."""
    go = work / f"go-{part}.json"
    while not go.exists():
        time.sleep(POLL_S)
    return dict(json.loads(go.read_text()))
