"""The command line's contract: bad input is exit 2 and one line, a bug is exit 3, never a bare traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.cgfiles import ONE_MODULE

from cgbuild.cli.main import main


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    (tmp_path / "Cgfile").write_text(ONE_MODULE.format(workspace=""))
    return tmp_path


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "-j", "0"], "positive integer"),
        (["plan", "-j", "-3"], "positive integer"),
        (["plan", "-j", "x"], "positive integer"),
        (["mint", "//t", "-j", "99999"], "up to 4096"),
        (["mint", "//t", "--executor", "ray://h:99999"], "unknown executor"),
        (["mint", "//t", "--executor", "ray://h\x00:80"], "unknown executor"),
        (["plan", "//t\n"], "bad label"),
        (["query", " //t"], "bad label"),
        (["plan", "--toolchain", "lock\x00.json"], "cannot read the lock"),
        (["plan", "--cgfile", "."], "cannot read the Cgfile: a directory"),
        (["plan", "--cgfile", "/dev/zero"], "cannot read the Cgfile: not a regular file"),
        (["diff", "/dev/zero", "/dev/zero"], "cannot read the plan file: not a regular file"),
        (["plan", "--toolchain", "/dev/zero"], "cannot read the lock: not a regular file"),
        (["plan", "--no-trace", "-o", "."], "cannot write the plan"),
        (["diff", "--format", "yaml", "a", "b"], "invalid choice"),
        (["nope"], "invalid choice"),
    ],
)
def test_bad_flags_exit_2(
    ws: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["-C", str(ws), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_dash_c_that_is_not_a_folder(ws: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-C", str(ws / "Cgfile"), "plan"]) == 2
    assert main(["-C", "no\x00where", "plan"]) == 2
    assert "not a folder" in capsys.readouterr().err


def test_a_bug_is_exit_3_with_its_traceback(
    ws: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from cgbuild.cli import query

    def broken(args: object) -> int:
        raise KeyError("a bug")

    monkeypatch.setattr(query, "run", broken)
    assert main(["-C", str(ws), "query"]) == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and "internal error" in err


def _blocked_on(pid: int, fifo: Path, timeout: float = 30.0) -> None:
    """Wait until process `pid` sleeps opening `fifo` (its kernel wait channel says so)."""
    deadline = time.monotonic() + timeout
    wchan = Path(f"/proc/{pid}/wchan")
    while time.monotonic() < deadline:
        if wchan.exists() and "partner" in wchan.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} never blocked on {fifo}")


@pytest.mark.skipif(not Path("/proc/self/wchan").exists(), reason="needs /proc wait channels")
@pytest.mark.parametrize(
    ("signum", "code", "line"), [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")]
)
def test_a_signal_is_one_line_and_its_exit_code(
    ws: Path, tmp_path: Path, signum: int, code: int, line: str
) -> None:
    """A real cgbuild process, held where it writes its plan (a FIFO nobody reads), is signalled."""
    fifo = tmp_path / "plan.json"
    os.mkfifo(fifo)
    proc = subprocess.Popen(
        [sys.executable, "-m", "cgbuild.cli", "-C", str(ws), "plan", "--no-trace", "-o", str(fifo)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _blocked_on(proc.pid, fifo)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    assert err == f"cgbuild: {line}\n" and out == ""


def test_in_process_main_restores_the_sigterm_handler(ws: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    assert main(["-C", str(ws), "query"]) == 0
    assert signal.getsignal(signal.SIGTERM) is before


def test_version_and_a_help_that_reads_as_a_tools(capsys: pytest.CaptureFixture[str]) -> None:
    from cgbuild import __version__

    assert main(["--version"]) == 0 and capsys.readouterr().out == f"cgbuild {__version__}\n"
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "Build compiled PyTorch graphs" in out and "cgbuild mint //flux2-klein:sm_120" in out
    assert "exit codes:" in out and "dispatch" not in out
