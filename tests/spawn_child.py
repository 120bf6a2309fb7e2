"""A child for tests/protocol/test_spawn.py, run as `python -m spawn_child MODE [ARG]` through the spawner.

Modes: `answer` (two JSON lines among noise), `signal NAME`, `exit N`, `oom`, `sleep`, `group`
(prints its pid and group, then sleeps), `leave` (starts a sleeper in its own group, prints its
pid and exits), `relay [SIGTERM]` (spawns `group`-like grandchildren through the spawner and
prints theirs), `compilers` (a SIGTERM-dying group leader that starts a plain sleeper), `echo`
(says each JSON line of its stdin back as `{"echo": ...}` until its input ends, then `{"eof": true}`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


def say(doc: dict) -> None:
    print(json.dumps(doc), flush=True)


def main(mode: str, arg: str = "") -> int:
    if mode == "answer":
        print("noise that is no JSON", flush=True)
        say({"id": "a", "ok": True})
        print("[1, 2]", flush=True)
        say({"id": "b", "ok": True})
    elif mode == "signal":
        os.kill(os.getpid(), getattr(signal, arg))
    elif mode == "exit":
        print("line one\nline two", file=sys.stderr)
        return int(arg)
    elif mode == "oom":
        print("MemoryError: could not allocate", file=sys.stderr)
        return 1
    elif mode == "sleep":
        time.sleep(600)
    elif mode == "group":
        say({"pid": os.getpid(), "pgid": os.getpgrp()})
        time.sleep(600)
    elif mode == "leave":
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        say({"pid": sleeper.pid})
    elif mode == "compilers":
        from cgbuild.protocol.spawn import die_with_group

        die_with_group()
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        say({"pid": os.getpid(), "compiler": sleeper.pid})
        time.sleep(600)
    elif mode == "echo":
        for line in sys.stdin:
            say({"echo": json.loads(line)})
        say({"eof": True})
    elif mode == "relay":
        from cgbuild.protocol.spawn import Talk, spawn

        death = signal.SIGTERM if arg == "SIGTERM" else signal.SIGKILL
        spawn(
            "spawn_child",
            ["compilers" if arg == "SIGTERM" else "group"],
            talk=Talk(on_message=say),
            death_signal=death,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
