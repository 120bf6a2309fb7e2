"""The command line's contract: bad input is exit 2 and one line, a bug is exit 3, never a bare traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from cgbuild.cli.main import main

CGFILE = """\
[sku.cpu]
sm = "cpu"
memory_gib = 1

[layout.fp32]
quant = "plain.fp32"

[family.a]
entry = "absent_module:build"
skus = ["cpu"]
layouts = ["fp32"]

[family.a.module.m]
shapes = ["8x8"]
"""


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    (tmp_path / "Cgfile").write_text(CGFILE)
    return tmp_path


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "-j", "0"], "positive integer"),
        (["plan", "-j", "-3"], "positive integer"),
        (["plan", "-j", "x"], "positive integer"),
        (["mint", "//a", "-j", "99999"], "up to 4096"),
        (["mint", "//a", "--executor", "ray://h:99999"], "unknown executor"),
        (["mint", "//a", "--executor", "ray://h\x00:80"], "unknown executor"),
        (["plan", "//a\n"], "bad label"),
        (["query", " //a"], "bad label"),
        (["plan", "--toolchain", "lock\x00.json"], "cannot read the lock"),
        (["plan", "--cgfile", "."], "cannot read Cgfile"),
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
