"""Both sides of the conversation between the worker and its stage children
(`cgbuild.protocol.stage`: a start line, then a go line per part in, one result line per part out).

The worker starts a stage before its input exists (`Stage`), so that its imports overlap what
comes first; each `part` hands the stage its go and blocks until the stage's answer, its end or
the part's deadline. The stage (`Conversation`) blocks on its next go and answers it. A stage's
death, a failure it reports or a part past its time is that part's typed failure, never a hang.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, TypeVar

from cgbuild_rules.mint.failure import MintFailure

from cgbuild.core.codes import Code
from cgbuild.protocol import spawn
from cgbuild.protocol.mint import BadResult, MintFailed, Phase, outcome_from_json
from cgbuild.protocol.stage import PART_PHASE, Answer, BadMessage, Go, StageStart

# test hook: "<part>:<SIGNAL>" makes the stage kill itself there; "<part>:hang" makes it wait on a
# child that never ends (a compiler that hangs); "<part>:garble" makes it answer with a line that
# is no result
FAULT_ENV = "CGBUILD_MINT_FAULT"
_A = TypeVar("_A", bound=Answer)


def echo(log: Path, stage: str) -> None:
    """Copy a stage's output to this worker's stderr, which the engine keeps as the key's log:
    the work folder holding the stage logs is removed when the mint succeeds."""
    text = log.read_text(errors="replace") if log.exists() else ""
    sys.stderr.write(f"== {stage} stage ({len(text.splitlines())} lines) ==\n{text}")
    sys.stderr.flush()


class Stage:
    """One stage child, as the worker sees it. Its answers arrive on the spawner's thread and
    wait in a queue (None: the child ended); `part` blocks on it. A stage starts programs of its
    own (the compiler), so it dies by SIGTERM and passes it on to its group
    (`spawn.die_with_group`)."""

    def __init__(
        self, name: str, start: StageStart, env: Mapping[str, str], timeout_s: float, log: Path
    ) -> None:
        self.name, self.timeout_s, self.log = name, timeout_s, log
        self.channel = spawn.Channel()
        self.answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.running = threading.Event()
        self.pid: int | None = None
        self.ended: spawn.Ended | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(start.to_json(), dict(env)), daemon=True)
        self.thread.start()

    def _run(self, start: dict[str, Any], env: dict[str, str]) -> None:
        try:
            self.ended = spawn.spawn(
                "cgbuild_rules.mint",
                ["--stage", self.name],
                talk=spawn.Talk(start, self.answers.put, self.channel, self._started),
                log=self.log,
                env=env,
                death_signal=signal.SIGTERM,
            )
        except BaseException as e:  # spawn refused to start (cgbuild is stopping): the part says so
            self.error = e
        finally:
            self.running.set()
            self.answers.put(None)

    def _started(self, pid: int) -> None:
        self.pid = pid
        self.running.set()

    def part(self, kind: type[_A], go: Go | None = None) -> _A:
        """Hand the stage `go` (None: the part needs no input) and return its typed answer."""
        name = kind.PART
        if go is not None:
            self.channel.send(go.to_json())
        try:
            answer = self.answers.get(timeout=self.timeout_s)
        except queue.Empty:
            self.stop()
            detail = f"{name} stage: no result within {self.timeout_s:.0f} s"
            raise MintFailure(Code.TIMEOUT, detail) from None
        if answer is None:
            self.answers.put(None)  # it stays ended for any later part
            raise self._died(name)
        if answer.get("ok") is False:
            raise _reported(answer, name)
        try:
            return kind.from_json(answer)
        except BadMessage as e:
            detail = f"the {self.name} stage answered no {name} result: {e}"
            raise MintFailure(Code.MINT_ERROR, detail) from None

    def _died(self, name: str) -> MintFailure:
        self.thread.join()
        echo(self.log, self.name)
        if self.error is not None:
            return MintFailure(Code.WORKER_KILLED, f"{name} stage did not start: {self.error}")
        assert self.ended is not None
        failed = MintFailed.ended(self.ended, f"{name} stage", PART_PHASE[name], self.timeout_s)
        return MintFailure(failed.code, failed.detail, **failed.facts)

    def finish(self) -> None:
        """The stage answered its last part: it ends now (else it is ended)."""
        self.thread.join(self.timeout_s)
        if self.thread.is_alive():
            self.stop()
        echo(self.log, self.name)

    def stop(self) -> None:
        """End the child and its group now (the mint failed, or a part outlived its time); one
        still starting is waited for, so the kill cannot miss it."""
        self.running.wait(30)
        if self.pid is not None and self.thread.is_alive():
            spawn.kill_group(self.pid)
        self.thread.join(30)


def _reported(answer: Mapping[str, Any], name: str) -> MintFailure:
    """The failure a stage reported, raised with the phase it names."""
    try:
        failed = outcome_from_json(answer)
    except BadResult as e:
        return MintFailure(Code.MINT_ERROR, f"the {name} stage's failure is not a mint failure: {e}")
    assert isinstance(failed, MintFailed)
    return MintFailure(failed.code, failed.detail, phase=failed.phase, **failed.facts)


# ---- stages (torch) ----------------------------------------------------------------------------
class Conversation:
    """A stage's side: its start, each go awaited (blocking on stdin), each answer written as
    one line on the protocol stream (the real stdout; torch's prints go to stderr), and the
    phase a failure here happened in."""

    def __init__(self, stage: str, stdin: IO[str], proto: IO[str]) -> None:
        self.stdin, self.proto = stdin, proto
        self.start = StageStart.from_json(json.loads(stdin.readline()))
        self.pending = self.start.go
        first = {"compile": "trace", "check": "verify", "serve": "serve"}[stage]
        self.phase = Phase.TRACE if stage == "compile" and self.start.held else PART_PHASE[first]

    @property
    def work(self) -> Path:
        return Path(self.start.env.work)

    def go(self, part: str) -> Go:
        """The worker's go for `part`: a hold's key request is known only now. The end of the
        input (the worker stopped the stage) ends the stage without an answer."""
        self.phase = PART_PHASE[part]
        go = self.pending
        self.pending = None
        if go is None:
            line = self.stdin.readline()
            if not line:
                raise SystemExit(0)
            try:
                go = Go.from_json(json.loads(line))
            except ValueError as e:  # not JSON, or not a go (BadMessage)
                raise MintFailure(Code.MINT_ERROR, f"the worker's {part} go is none: {e}") from None
        if go.part != part:
            raise MintFailure(Code.MINT_ERROR, f"the worker handed the {go.part} part's go, not {part}'s")
        fault(part)
        return go

    def answer(self, result: Answer) -> None:
        garbled = faulted(result.PART) == "garble"
        line = {"part": result.PART, "ok": "garbled"} if garbled else result.to_json()
        self.proto.write(json.dumps(line) + "\n")
        self.proto.flush()

    def fail(self, failure: MintFailure) -> None:
        self.proto.write(json.dumps(failure.result(None, self.phase).to_json()) + "\n")
        self.proto.flush()


def faulted(part: str) -> str | None:
    """What the test hook asks of `part` (None: nothing)."""
    spec = os.environ.get(FAULT_ENV, "")
    return spec.partition(":")[2] or "SIGKILL" if spec.partition(":")[0] == part else None


def fault(part: str) -> None:
    """The test hook's death or hang at `part` (its garbled answer is `Conversation.answer`'s)."""
    how = faulted(part)
    if how == "hang":
        subprocess.run(["sleep", "3600"], check=False)
    if how is not None and how != "garble":
        os.kill(os.getpid(), getattr(signal, how))
