"""No child outlives the `cgbuild` that started it, and `gc` sweeps what a killed mint left.

A real toy mint is killed while its compile stage runs; every process it started carries a
marker in its environment (children inherit it, compilers included), so /proc shows whether
anything survived, whoever it was reparented to.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from support.cgfiles import ONE_MODULE
from support.procs import MARK, marked, wait_for
from support.toy import copy_toy

from cgbuild.exec.mint import sweep_build
from cgbuild.plan.workspace import StateDir

MLP8 = "//toy/mlp/8x64-b1@fp32:cpu"

pytestmark = pytest.mark.slow


def start_mint(ws: Path, token: str, err: Path, **env: str) -> subprocess.Popen[bytes]:
    with open(err, "wb") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "cgbuild.cli", "-C", str(ws), "mint", MLP8, "--json"],
            stdout=subprocess.DEVNULL,
            stderr=f,
            env={**os.environ, MARK: token, **env},
        )


def kill_during_compile(
    ws: Path, how: signal.Signals, err: Path, *, seen: list[str] | None = None, **env: str
) -> tuple[int, str]:
    """Kill the mint once its compile stage runs (with `CGBUILD_MINT_FAULT=compile:hang`, once
    the stage waits on its never-ending child); every marked process must be gone within 10 s,
    far less than a compile (the parent-death signals act at once). `seen` gets what the build
    folder held when the signal was sent."""
    token = uuid.uuid4().hex
    proc = start_mint(ws, token, err, **env)
    sign = "sleep 3600" if env else "--stage compile"
    compiling = wait_for(lambda: [c for c in marked(token).values() if sign in c], 180)
    assert compiling, f"the compile stage never started: {err.read_text()[-2000:]}"
    time.sleep(0.5)  # into the compile
    before = marked(token)
    assert any("cgbuild_rules.mint" in c and "--stage" not in c for c in before.values()), before
    if seen is not None:
        seen += leftovers(ws)
    proc.send_signal(how)
    rc = proc.wait(60)
    gone = wait_for(lambda: not marked(token), 10)
    survivors = marked(token)
    for pid in survivors:  # a failing run tidies up after itself
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    assert gone is True, f"outlived cgbuild ({how.name}): {survivors}"
    return rc, err.read_text()


def leftovers(ws: Path) -> list[str]:
    """What the workspace's build folder holds."""
    build = ws / ".cgbuild" / "build"
    return sorted(p.name for p in build.iterdir()) if build.is_dir() else []


def gc(ws: Path, *args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "cgbuild.cli", "-C", str(ws), "gc", "--json", *args],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_sigkill_of_mint_leaves_no_process_and_gc_sweeps_after_the_grace(
    tmp_path: Path, toy_reference: Path
) -> None:
    ws = copy_toy(tmp_path / "toy", toy_reference)
    kill_during_compile(ws, signal.SIGKILL, tmp_path / "err")
    build = ws / ".cgbuild" / "build"
    left = sorted(p.name for p in build.iterdir() if p.name.startswith(".mint-"))
    assert left, "the killed mint left no work folder to sweep"
    assert gc(ws)["build_removed"] == []  # within the grace period: kept
    assert all((build / n).exists() for n in left)
    assert gc(ws, "--grace", "0")["build_removed"] == left
    assert not any((build / n).exists() for n in left)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_a_hung_compiler_dies_with_the_mint(tmp_path: Path, toy_reference: Path, how: signal.Signals) -> None:
    ws = copy_toy(tmp_path / "toy", toy_reference)
    rc, err = kill_during_compile(ws, how, tmp_path / "err", CGBUILD_MINT_FAULT="compile:hang")
    assert rc == {signal.SIGKILL: -9, signal.SIGTERM: 143, signal.SIGINT: 130}[how] and "Traceback" not in err


def test_sigterm_of_mint_is_one_line_exit_143_and_no_process_survives(
    tmp_path: Path, toy_reference: Path
) -> None:
    ws = copy_toy(tmp_path / "toy", toy_reference)
    rc, err = kill_during_compile(ws, signal.SIGTERM, tmp_path / "err")
    assert rc == 143 and "Traceback" not in err
    assert [line for line in err.splitlines() if "terminated" in line] == ["cgbuild: terminated"]


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT])
def test_an_interrupted_mint_removes_its_build_folder(
    tmp_path: Path, toy_reference: Path, how: signal.Signals
) -> None:
    """Ctrl-C or SIGTERM in the middle of a compile: the worker's work folder (its request, stage
    logs, what it compiled so far) is gone when `cgbuild` exits, without waiting for a `gc`."""
    ws = copy_toy(tmp_path / "toy", toy_reference)
    seen: list[str] = []
    rc, err = kill_during_compile(ws, how, tmp_path / "err", seen=seen)
    assert rc == {signal.SIGTERM: 143, signal.SIGINT: 130}[how] and "Traceback" not in err, err
    assert [n for n in seen if n.startswith(".mint-")], seen  # the folder was there when signalled
    assert leftovers(ws) == []


def test_gc_sweeps_a_dead_workers_folder_and_keeps_a_live_ones(tmp_path: Path) -> None:
    """`cgbuild gc` past the grace period: the work folder of a worker that died (a process that
    ran and exited) is removed, with the temporary archive in it; one whose worker still runs
    (a process sleeping now) is kept, however old."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "Cgfile").write_text(ONE_MODULE.format(workspace=""))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        build = ws / ".cgbuild" / "build"
        folders = {f".mint-{'a' * 16}-{int(dead.stdout)}": False, f".mint-{'b' * 16}-{live.pid}": True}
        old = time.time() - 7200
        for name in folders:
            (build / name).mkdir(parents=True)
            (build / name / f".{'a' * 64}.tar.gz.{int(dead.stdout)}.tmp").write_bytes(b"half an archive")
            os.utime(build / name, (old, old))
        assert gc(ws)["build_removed"] == [n for n, alive in folders.items() if not alive]
        assert leftovers(ws) == [n for n, alive in folders.items() if alive]
    finally:
        live.kill()
        live.wait()
    assert gc(ws)["build_removed"] == [f".mint-{'b' * 16}-{live.pid}"]  # its worker is gone now
    assert leftovers(ws) == []


def test_gc_never_sweeps_a_live_mints_build_files(tmp_path: Path) -> None:
    state = tmp_path / "state"
    build = state / "build"
    (state / "mint").mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    dead_pid = int(dead.stdout)
    names = {
        f".mint-{'a' * 16}-{os.getpid()}": True,  # a live worker's folder
        f".mint-{'b' * 16}-{dead_pid}": False,
        f".{'c' * 64}.tar.gz.{os.getpid()}.tmp": True,
        f".{'d' * 64}.tar.gz.{dead_pid}.tmp": False,
        f"{'e' * 64}.tar.gz": True,  # sealed, its record running under a live cgbuild
        f"{'f' * 64}.tar.gz": False,  # its record says the mint ended
        f"{'g' * 64}.tar.gz": False,  # no record at all
    }
    for name in names:
        (build / name).mkdir(parents=True) if name.startswith(".mint-") else (build / name).write_text("x")
    for key, rec in (("e", {"state": "running", "pid": os.getpid()}), ("f", {"state": "failed"})):
        (state / "mint" / f"{key * 64}.json").write_text(json.dumps(rec))
    assert sweep_build(StateDir(state), 3600) == []  # all young
    old = time.time() - 7200
    for name in names:
        os.utime(build / name, (old, old))
    stale = sorted(n for n, live in names.items() if not live)
    assert sorted(sweep_build(StateDir(state), 3600, dry_run=True)) == stale
    assert sorted(sweep_build(StateDir(state), 3600)) == stale
    assert sorted(p.name for p in build.iterdir()) == sorted(set(names) - set(stale))
