"""The one way cgbuild starts a child: `python -m <module>`, JSON lines out, a typed end.

The engine never imports torch; it starts `python -m cgbuild_rules.<rule>` instead, and the mint
worker starts its stages the same way. Every child goes through `spawn`, so every crash is named
one way (`Ended.failure`: timeout, `worker-killed` for SIGKILL, the usual OOM kill,
`worker-signal` for any other signal, `oom` for an allocation failure the child printed,
`worker-crashed` for an exit without a result).

No child outlives the process that started it, however that process ends:
- each child leads its own process group (so one kill reaches the compilers it started) and
  asks Linux for a parent-death signal (`PR_SET_PDEATHSIG`), re-checking its parent afterwards
  because the parent may have died between the fork and the request. The signal fires when the
  starting THREAD ends; every caller waits for its child on the thread that started it.
- a child with children of its own that it did not start here (the compile stage's compilers)
  asks for SIGTERM instead and calls `die_with_group`, which turns SIGTERM into SIGKILL of its
  whole group: a SIGKILL could not be caught to pass on.
- `stop_children_on_signals` (the CLI's entry point) kills every live child's group on SIGINT
  or SIGTERM and refuses new children until it returns.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from cgbuild.core.codes import RETRYABLE, Code

Result = dict[str, Any]
PR_SET_PDEATHSIG = 1
_OOM_MARKS = ("MemoryError", "out of memory", "std::bad_alloc")
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


class Stopping(KeyboardInterrupt):
    """cgbuild is being interrupted: no new child starts (an interruption wherever it surfaces)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so every `finally` runs; the CLI exits 143 for it."""


@dataclass(frozen=True)
class Ended:
    """How a child ended: its exit status (negative: the signal), whether its deadline or a stop
    of cgbuild killed it, and the last lines it wrote to its log."""

    status: int
    timed_out: bool = False
    stopped: bool = False
    tail: str = ""

    @property
    def signal(self) -> str | None:
        if self.status >= 0:
            return None
        try:
            return signal.Signals(-self.status).name
        except ValueError:
            return f"signal {-self.status}"

    def failure(self, what: str, timeout_s: float | None = None) -> Result:
        """The typed failure of a child that gave no result: `code`, `retryable`, `detail` (and
        `signal` when one killed it). `what` names the child in the detail."""
        tail = f": {self.tail}" if self.tail else ""
        extra: Result = {}
        if self.timed_out:
            code, detail = Code.TIMEOUT, f"{what} ran past {timeout_s or 0:.0f} s"
        elif self.signal is not None:
            extra["signal"] = self.signal
            killed = self.status == -signal.SIGKILL
            code = Code.WORKER_KILLED if killed else Code.WORKER_SIGNAL
            why = " (cgbuild was stopping)" if self.stopped else " (out of memory?)" if killed else ""
            detail = f"{what} killed by {self.signal}{why}{tail}"
        elif any(mark in self.tail for mark in _OOM_MARKS):
            code, detail = Code.OOM, f"{what} ran out of memory{tail}"
        else:
            code = Code.WORKER_CRASHED
            detail = f"{what} exited with status {self.status} without a result{tail}"
        return {"ok": False, "code": str(code), "retryable": code in RETRYABLE, "detail": detail, **extra}


_lock = threading.RLock()  # re-entrant: the signal handler may run while its thread holds it
_live: dict[int, subprocess.Popen[bytes]] = {}
_stopped: set[int] = set()
_stopping = False


def _die_with_parent(parent: int, death_signal: int) -> Callable[[], None]:
    """The child's first act after fork: the death signal, then the check that the parent did
    not die before it was set (the child would then never get it)."""

    def preexec() -> None:
        if _libc is not None:
            _libc.prctl(PR_SET_PDEATHSIG, death_signal, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def kill_group(pid: int) -> None:
    """End a child's whole process group (the child and whatever it started)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _tail(f: IO[bytes]) -> str:
    f.seek(0, os.SEEK_END)
    f.seek(max(0, f.tell() - 8192))
    lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    return " | ".join(ln.strip() for ln in lines[-3:])


class Channel:
    """A child's stdin kept open after its request, for the JSON lines a caller sends it later
    from another thread (a held mint hears its key's request once the plan has it). Closing it,
    or the child's end, is the child's end of input."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pipe: IO[bytes] | None = None
        self._closed = False

    def _attach(self, pipe: IO[bytes]) -> None:
        with self._lock:
            if self._closed:
                with contextlib.suppress(BrokenPipeError):
                    pipe.close()
            else:
                self._pipe = pipe

    def send(self, message: Any) -> bool:
        """Write one JSON line; False when the child's input is closed (it ended, or was told to)."""
        with self._lock:
            if self._pipe is None or self._closed:
                return False
            try:
                self._pipe.write(json.dumps(message).encode() + b"\n")
                self._pipe.flush()
            except (BrokenPipeError, ValueError):
                return False
            return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._pipe is not None:
                with contextlib.suppress(BrokenPipeError, ValueError):
                    self._pipe.close()
            self._pipe = None


@dataclass(frozen=True)
class Talk:
    """How the parent and a child speak: `request` goes to its stdin as one JSON line (else stdin
    is empty); with `channel` stdin then stays open for `channel.send` (a `request` is needed);
    with `on_message` its stdout is the protocol stream, each line that is a JSON object handed
    over as it arrives; `started` hears its pid (its process group's id) once it runs, so a
    caller waiting from another thread can end the group itself (`kill_group`)."""

    request: Any = None
    on_message: Callable[[Result], None] | None = None
    channel: Channel | None = None
    started: Callable[[int], None] | None = None


def spawn(
    module: str,
    args: Sequence[str] = (),
    *,
    talk: Talk = Talk(),
    log: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
    death_signal: int = signal.SIGKILL,
) -> Ended:
    """Run `python -m module *args` to its end and say how it ended.

    The rest of its output (stderr, and stdout without `talk.on_message`) goes to `log`, or to a
    private temp file read back only for the tail. Past `timeout_s` its whole group is killed.
    """
    with contextlib.ExitStack() as stack:
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            out: IO[bytes] = stack.enter_context(open(log, "w+b"))
        else:
            out = stack.enter_context(tempfile.TemporaryFile())
        proc = _launch(module, args, talk, out, env, death_signal)
        if talk.started is not None:
            talk.started(proc.pid)
        timed_out = threading.Event()

        def expire() -> None:
            timed_out.set()
            kill_group(proc.pid)

        timer = threading.Timer(timeout_s, expire) if timeout_s is not None else None
        try:
            if timer is not None:
                timer.daemon = True
                timer.start()
            status = _converse(proc, talk)
        finally:
            stopped = _settle(proc, talk.channel, timer)
        return Ended(status, timed_out.is_set(), stopped, _tail(out))


def _launch(
    module: str,
    args: Sequence[str],
    talk: Talk,
    out: IO[bytes],
    env: Mapping[str, str] | None,
    death_signal: int,
) -> subprocess.Popen[bytes]:
    """The child started in its own process group and recorded as live, unless cgbuild is stopping."""
    with _lock:
        if _stopping:
            raise Stopping(f"not starting {module}: cgbuild is stopping")
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdin=subprocess.DEVNULL if talk.request is None else subprocess.PIPE,
            stdout=subprocess.PIPE if talk.on_message is not None else out,
            stderr=out,
            env=dict(env) if env is not None else None,
            process_group=0,
            preexec_fn=_die_with_parent(os.getpid(), death_signal),
        )
        _live[proc.pid] = proc
    return proc


def _converse(proc: subprocess.Popen[bytes], talk: Talk) -> int:
    """Hand the child its request, read its protocol stream to the end; its exit status."""

    def reap_group() -> None:
        # Whatever the child left running in its group goes with it (a leftover holding the
        # protocol pipe would otherwise keep it open forever), killed while the unreaped
        # child still holds its pid, so the group id cannot name anyone else.
        with contextlib.suppress(ChildProcessError):
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        kill_group(proc.pid)

    reaper = threading.Thread(target=reap_group, daemon=True)
    reaper.start()
    if proc.stdin is not None:
        with contextlib.suppress(BrokenPipeError):  # a child that died before reading
            proc.stdin.write(json.dumps(talk.request).encode() + b"\n")
            proc.stdin.flush()
        if talk.channel is not None:
            talk.channel._attach(proc.stdin)
        else:
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.close()
    if proc.stdout is not None:
        for line in proc.stdout:
            message = _message(line)
            if message is not None and talk.on_message is not None:
                talk.on_message(message)
    reaper.join()
    return proc.wait()


def _settle(proc: subprocess.Popen[bytes], channel: Channel | None, timer: threading.Timer | None) -> bool:
    """After the child ended (or the caller's thread was interrupted: the child is taken along):
    its channel closed, its timer cancelled, its record dropped; whether cgbuild stopped it."""
    if channel is not None:
        channel.close()
    if timer is not None:
        timer.cancel()
    if proc.returncode is None:
        kill_group(proc.pid)
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
    with _lock:
        _live.pop(proc.pid, None)
        stopped = proc.pid in _stopped
        _stopped.discard(proc.pid)
    return stopped


def _message(line: bytes) -> Result | None:
    line = line.strip()
    if not line.startswith(b"{"):
        return None
    try:
        message = json.loads(line)
    except ValueError:
        return None
    return message if isinstance(message, dict) else None


def stop_children() -> None:
    """Kill every live child's group and refuse new children (until `stop_children_on_signals`
    returns)."""
    global _stopping
    with _lock:
        _stopping = True
        for pid in list(_live):
            _stopped.add(pid)
            kill_group(pid)


@contextlib.contextmanager
def stop_children_on_signals() -> Iterator[None]:
    """While inside: SIGINT and SIGTERM first kill every child's group, then raise
    `KeyboardInterrupt` / `Terminated` here. Outside the main thread it only resets the stop."""
    global _stopping

    def on_signal(signum: int, _frame: Any) -> None:
        stop_children()
        raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()

    main = threading.current_thread() is threading.main_thread()
    before = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        with _lock:
            _stopping = False


def die_with_group() -> None:
    """For a child started with `death_signal=SIGTERM`: on SIGTERM (its parent died, or someone
    stopped it), SIGKILL its whole process group, itself and the programs it started included.
    Only a group leader does so: a stage run by hand in a shell's group must not kill the shell."""
    if os.getpgrp() == os.getpid():
        signal.signal(signal.SIGTERM, lambda *_: os.killpg(os.getpgrp(), signal.SIGKILL))


def run_child(
    rule: str,
    request: dict[str, Any],
    job_ids: list[str],
    on_result: Callable[[Result], None],
    env: dict[str, str] | None = None,
) -> None:
    """Run one rule child; every job id gets exactly one result through `on_result` (a job the
    child never answered gets the child's typed failure, `retryable`)."""
    answered: set[str] = set()

    def take(result: Result) -> None:
        if result.get("id") in job_ids and result["id"] not in answered:
            answered.add(result["id"])
            on_result(result)

    ended = spawn(f"cgbuild_rules.{rule}", talk=Talk(request, take), env=env)
    if len(answered) < len(job_ids):
        failure = ended.failure(f"{rule} worker")
        for jid in job_ids:
            if jid not in answered:
                on_result({"id": jid, **failure})


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
