"""A value the Cgfile set that is refused when it is used, not when it is read (a compiler that
fails, a reference or lock that is no checkpoint or lock, a store this user cannot write, a shared
store that cannot be reached): exit 2 naming the Cgfile, the line and the field that set it, then
what is wrong with what it names. Torch-free: `plan --no-trace`, `gc --dry-run`, and mints
refused before anything traces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hostile import LOCK, call
from support.cgfiles import ONE_MODULE

ONE = ONE_MODULE.format(workspace="")


def workspace(tmp_path: Path, text: str) -> tuple[Path, str]:
    """The workspace folder holding `text` as its Cgfile, and the path the errors name it by."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "Cgfile").write_text(text)
    (ws / "m.py").write_text("def build(target):\n    raise SystemExit('never traced here')\n")
    return ws, str(ws / "Cgfile")


def at(text: str, written: str) -> int:
    """The line of `text` that starts with `written`."""
    return next(n for n, line in enumerate(text.split("\n"), 1) if line.startswith(written))


def with_toolchain(body: str) -> str:
    return ONE.replace("[sku.cpu]", f"[toolchain]\n{body}\n\n[sku.cpu]", 1)


def test_a_compiler_that_fails_is_refused_at_the_line_that_set_it(tmp_path: Path) -> None:
    """A relative `cxx` is the Cgfile folder's (the test runs elsewhere); it answers `--version`
    with an error. The mint refuses it before anything traces even where a lock keys the targets
    and nothing probes the compiler."""
    text = with_toolchain('cxx = "bin/cc"')
    ws, cgfile = workspace(tmp_path, text)
    cc = ws / "bin" / "cc"
    cc.parent.mkdir()
    cc.write_text("#!/bin/sh\nexit 3\n")
    cc.chmod(0o755)
    refusal = f"{cgfile}:{at(text, 'cxx')}: field 'toolchain.cxx': {cc}: --version failed (exit 3)"
    out = call(["-C", str(ws), "plan", "--no-trace"])
    assert out.code == 2 and refusal in out.stderr, out.stderr
    lock = tmp_path / "lock.json"
    lock.write_text(json.dumps(LOCK))
    assert call(["-C", str(ws), "plan", "--no-trace", "--toolchain", str(lock)]).code == 0  # no probe
    out = call(["-C", str(ws), "mint", "//t:cpu", "--toolchain", str(lock)])
    assert out.code == 2 and refusal in out.stderr, out.stderr
    assert not (ws / ".cgbuild" / "mint").exists()  # refused before a trace or a mint started


def test_a_compiler_not_found_is_refused_at_its_line(tmp_path: Path) -> None:
    text = with_toolchain('cxx = "no-such-compiler-here"')
    ws, cgfile = workspace(tmp_path, text)
    out = call(["-C", str(ws), "plan", "--no-trace"])
    assert out.code == 2, out.stderr
    assert f"{cgfile}:{at(text, 'cxx')}: field 'toolchain.cxx': no-such-compiler-here: not found on PATH" in (
        out.stderr
    )


def test_a_reference_of_the_root_folder_is_refused_at_its_line(tmp_path: Path) -> None:
    text = ONE.replace('quant = "plain.fp32"', 'quant = "plain.fp32"\nreference = "/"')
    ws, cgfile = workspace(tmp_path, text)
    out = call(["-C", str(ws), "plan", "--no-trace"])
    assert out.code == 2, out.stderr
    where = f"{cgfile}:{at(text, 'reference')}: field 'layout.fp32.reference'"
    assert f"{where}: /: reference checkpoint has no component 'mlp'" in out.stderr


def test_a_lock_the_cgfile_names_is_refused_at_its_line(tmp_path: Path) -> None:
    """The same missing file named by `--toolchain` is the flag's, not the Cgfile's."""
    text = with_toolchain('lock = "toolchain.lock.json"')
    ws, cgfile = workspace(tmp_path, text)
    lock = ws / "toolchain.lock.json"
    out = call(["-C", str(ws), "plan", "--no-trace"])
    assert out.code == 2, out.stderr
    assert f"{cgfile}:{at(text, 'lock')}: field 'toolchain.lock': {lock}: no such lock" in out.stderr
    out = call(["-C", str(ws), "plan", "--no-trace", "--toolchain", str(lock)])
    assert out.code == 2 and f"error: {lock}: field '$': no such lock" in out.stderr, out.stderr
    lock.write_text(json.dumps({**LOCK, "schema": "other"}))
    out = call(["-C", str(ws), "plan", "--no-trace"])
    assert out.code == 2, out.stderr
    assert f"field 'toolchain.lock': {lock}: field 'schema': expected " in out.stderr


def test_a_store_this_user_cannot_write_is_refused_at_its_line(tmp_path: Path) -> None:
    """sysfs refuses the folder even to root (see test_hostile_files): `gc` and `mint` refuse it
    by the Cgfile's `store` before they write, a mint before it traces or compiles."""
    if not Path("/sys/kernel").is_dir():
        pytest.skip("needs a Linux sysfs")
    text = ONE_MODULE.format(workspace='store = "/sys/cgbuild-store"')
    ws, cgfile = workspace(tmp_path, text)
    where = f"{cgfile}:{at(text, 'store')}: field 'workspace.store': cannot lock the store: /sys/"
    for argv in (["gc", "--dry-run"], ["mint", "//t:cpu"]):
        out = call(["-C", str(ws), *argv])
        assert out.code == 2 and where in out.stderr, (argv, out.stderr)
    assert not (ws / ".cgbuild" / "mint").exists()
    assert call(["-C", str(ws), "plan", "--no-trace"]).code == 0  # a plan only reads the store


def test_a_shared_store_that_cannot_be_reached_is_refused_at_its_line(
    tmp_path: Path, keys: dict[str, tuple[Path, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's client raises without knowing the Cgfile; the command places it there. A
    refusal of a command-line field is left as it is."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # the discard port: refused at once
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    body = f'remote = "s3://cgbuild-test/p"\ntrusted = ["{keys["ci"][1]}"]'
    text = ONE_MODULE.format(workspace=body)
    ws, cgfile = workspace(tmp_path, text)
    out = call(["-C", str(ws), "plan", "--no-trace"])
    assert out.code == 2, out.stderr
    assert f"{cgfile}:{at(text, 'remote')}: field 'workspace.remote': remote-unavailable: " in out.stderr
    out = call(["-C", str(ws), "why", "//t"])
    assert out.code == 2 and "error: field 'label': " in out.stderr, out.stderr
    if Path("/sys/kernel").is_dir():  # `fetch` refuses a store it cannot write before it plans
        unwritable = '[workspace]\nstore = "/sys/cgbuild-store"\n'
        (ws / "Cgfile").write_text(text.replace("[workspace]\n", unwritable))
        out = call(["-C", str(ws), "fetch"])
        assert out.code == 2 and f"{cgfile}:2: field 'workspace.store': cannot lock" in out.stderr, out.stderr
