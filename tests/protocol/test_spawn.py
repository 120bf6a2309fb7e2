"""The one child spawner: JSON lines streamed, every end typed one way, and no child outlives
the process that started it (own process group, parent-death signal, stop on SIGINT/SIGTERM)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cgbuild.protocol import spawn

HERE = Path(__file__).resolve().parents[1]  # spawn_child.py
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}


def run(*args: str, request: Any = None) -> tuple[spawn.Ended, list[dict[str, Any]]]:
    got: list[dict[str, Any]] = []
    ended = spawn.spawn("spawn_child", args, talk=spawn.Talk(request, got.append), env=ENV)
    return ended, got


def alive(pid: int) -> bool:
    """Running (a zombie awaiting its reaper counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def gone_within(pids: list[int], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_json_lines_are_streamed_and_noise_is_skipped() -> None:
    ended, got = run("answer")
    assert ended.status == 0 and not ended.timed_out
    assert got == [{"id": "a", "ok": True}, {"id": "b", "ok": True}]


@pytest.mark.parametrize(
    ("args", "code", "signal_name"),
    [
        (("signal", "SIGKILL"), "worker-killed", "SIGKILL"),
        (("signal", "SIGSEGV"), "worker-signal", "SIGSEGV"),
        (("oom",), "oom", None),
        (("exit", "3"), "worker-crashed", None),
    ],
)
def test_every_end_maps_to_one_typed_failure(
    args: tuple[str, ...], code: str, signal_name: str | None
) -> None:
    ended, _ = run(*args)
    failure = ended.failure("the child")
    assert failure["code"] == code and failure["retryable"] is True and failure["ok"] is False
    assert failure.get("signal") == signal_name
    if args[0] == "exit":
        assert "status 3" in failure["detail"] and "line one | line two" in failure["detail"]


def test_a_child_past_its_deadline_is_killed_as_a_timeout(tmp_path: Path) -> None:
    started = time.monotonic()
    ended = spawn.spawn("spawn_child", ["sleep"], env=ENV, timeout_s=0.5, log=tmp_path / "log")
    assert time.monotonic() - started < 30
    assert ended.timed_out and ended.failure("stage", 0.5)["code"] == "timeout"


def test_a_child_leads_its_own_group_and_what_it_leaves_there_is_killed(tmp_path: Path) -> None:
    spawn.spawn("spawn_child", ["leave"], env=ENV, log=tmp_path / "log")
    sleeper = json.loads((tmp_path / "log").read_text())["pid"]
    assert gone_within([sleeper]), "a process the child left in its group survived it"


def test_a_child_dies_with_its_parent_even_a_sigkilled_one() -> None:
    for death in ("SIGKILL", "SIGTERM"):
        relay = subprocess.Popen(
            [sys.executable, "-m", "spawn_child", "relay", death], env=ENV, stdout=subprocess.PIPE, text=True
        )
        assert relay.stdout is not None
        doc = json.loads(relay.stdout.readline())
        kids = [doc["pid"], *([doc["compiler"]] if "compiler" in doc else [])]
        if death == "SIGKILL":
            assert doc["pgid"] == doc["pid"], "the child does not lead its own process group"
        assert all(alive(p) for p in kids)
        relay.kill()
        relay.wait()
        assert gone_within(kids), f"{death}: a child outlived its SIGKILLed parent"


def test_stopping_kills_live_children_and_starts_no_new_one() -> None:
    ends: list[spawn.Ended] = []
    with spawn.stop_children_on_signals():
        worker = threading.Thread(target=lambda: ends.append(run("sleep")[0]))
        worker.start()
        deadline = time.monotonic() + 20
        while not spawn._live and time.monotonic() < deadline:
            time.sleep(0.02)
        spawn.stop_children()
        worker.join(20)
        assert ends and ends[0].stopped and ends[0].failure("w")["code"] == "worker-killed"
        assert "stopping" in ends[0].failure("w")["detail"]
        with pytest.raises(spawn.Stopping):
            run("answer")
    assert run("answer")[0].status == 0  # leaving the block lifts the stop


def test_sigterm_in_the_parent_kills_the_children_then_raises_terminated() -> None:
    got: list[BaseException] = []
    with spawn.stop_children_on_signals():
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
        try:
            run("sleep")
        except spawn.Terminated as e:
            got.append(e)
    assert got and not spawn._live


def test_a_channel_keeps_stdin_open_for_later_lines_and_its_close_ends_the_input() -> None:
    """A held mint hears its key's request after the plan: the request line first, then each
    `send` as one line, in order, and `close` is the child's end of input."""
    channel = spawn.Channel()
    got: list[dict[str, Any]] = []

    def take(message: dict[str, Any]) -> None:
        got.append(message)
        if message.get("echo") == {"n": 0}:
            assert channel.send({"n": 1}) and channel.send({"n": 2})
            channel.close()

    ended = spawn.spawn("spawn_child", ["echo"], talk=spawn.Talk({"n": 0}, take, channel), env=ENV)
    assert ended.status == 0
    assert got == [{"echo": {"n": 0}}, {"echo": {"n": 1}}, {"echo": {"n": 2}}, {"eof": True}]
    assert channel.send({"n": 3}) is False  # closed: nothing reaches a child that has ended


def test_without_a_channel_the_input_ends_after_the_request() -> None:
    ended, got = run("echo", request={"n": 0})
    assert ended.status == 0 and got == [{"echo": {"n": 0}}, {"eof": True}]
