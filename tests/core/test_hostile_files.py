"""Files the engine reads or writes that are hostile or unusable: each is exit 2 with the file
named and what to do, never a traceback. Torch-free, no trace: `plan --no-trace`, `inspect` of a
key, `gc --dry-run`."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
from hostile import call
from support.artifacts import sealed_for
from support.cgfiles import ONE_MODULE

from cgbuild.core.errors import UserError
from cgbuild.identity.topology import HEADER_MAX_DEPTH, read_header, topology_from_reference
from cgbuild.store.local import Store

KEY = "ab" * 32

ONE = ONE_MODULE.format(workspace="")
INT8 = ONE.replace(
    '[layout.fp32]\nquant = "plain.fp32"',
    '[layout.int8]\nquant = "int8-rowwise"\ndtype = "float32"\nreference = "ref"',
).replace('layouts = ["fp32"]', 'layouts = ["int8"]')
"""One module whose int8 layout reads its topology from `ref/mlp.safetensors`'s header."""


def workspace(tmp_path: Path, text: str = ONE) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "Cgfile").write_text(text)
    return ws


def nested(depth: int) -> bytes:
    """A safetensors header (its length, then JSON) of objects nested `depth` deep."""
    body = b'{"a":' * depth + b"1" + b"}" * depth
    return struct.pack("<Q", len(body)) + body


def test_a_deeply_nested_header_is_refused_by_name(tmp_path: Path) -> None:
    """Deep enough to reach the parser's recursion limit, and just past what a header holds."""
    ws = workspace(tmp_path, INT8)
    header = ws / "ref" / "mlp.safetensors"
    header.parent.mkdir()
    for depth in (sys.getrecursionlimit() * 2, HEADER_MAX_DEPTH + 1):
        header.write_bytes(nested(depth))
        out = call(["-C", str(ws), "plan", "--no-trace"])
        assert out.code == 2, out.stderr
        assert f"{header}: safetensors header is not usable: nested deeper than 3 levels" in out.stderr


def test_a_header_as_deep_as_safetensors_writes_reads(tmp_path: Path) -> None:
    doc = {"__metadata__": {"format": "pt"}, "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    raw = json.dumps(doc).encode()
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(8))
    assert read_header(path) == doc
    assert topology_from_reference(path, "ignored") == [["w", "F32", [2]]]


def test_a_deeply_nested_checkpoint_index_is_refused_by_name(tmp_path: Path) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(UserError, match="nested deeper than 64 levels") as info:
        topology_from_reference(index, "any")
    assert info.value.file == str(index)


def test_a_state_folder_that_refuses_writes_is_named_with_the_fix(tmp_path: Path) -> None:
    """A folder of sysfs refuses to be made even by root (EPERM, or EROFS where it is mounted
    read-only): a real refusal wherever the tests run, through the same probe a folder this user
    may not write meets (EACCES). It is made here only if absent, so nothing is left behind."""
    if not Path("/sys/kernel").is_dir():
        pytest.skip("needs a Linux sysfs")
    ws = workspace(tmp_path, ONE_MODULE.format(workspace='state = "/sys/cgbuild-state"'))
    out = call(["-C", str(ws), "plan", "--no-trace"])
    assert out.code == 2, out.stderr
    where = "Cgfile:2: field 'workspace.state'"
    assert f"{where}: the state folder /sys/cgbuild-state cannot be written" in out.stderr
    assert "point [workspace] state at a folder that is" in out.stderr
    assert call(["-C", str(ws), "query"]).code == 0  # reads the Cgfile only: not refused


def test_a_garbage_mint_record_is_named_with_the_fix(tmp_path: Path) -> None:
    """`inspect` shows the record, `gc` asks it whether a sealed leftover's mint still runs:
    both read it through the one state reader, which refuses it and leaves it in place."""
    ws = workspace(tmp_path)
    Store(ws / ".cgbuild" / "store").admit(KEY, sealed_for(tmp_path, KEY))
    record = ws / ".cgbuild" / "mint" / f"{KEY}.json"
    record.parent.mkdir()
    (ws / ".cgbuild" / "build").mkdir()
    (ws / ".cgbuild" / "build" / f"{KEY}.tar.gz").write_bytes(b"sealed, not admitted")
    for garbage in (b"\x00garbage{", b'{"labels": "//t"}'):
        record.write_bytes(garbage)
        for argv in (["inspect", KEY], ["gc", "--dry-run", "--grace", "0"]):
            out = call(["-C", str(ws), *argv])
            assert out.code == 2, (argv, out.stderr)
            assert f"{record}: mint record " in out.stderr and "remove it" in out.stderr, out.stderr
            assert record.read_bytes() == garbage
    record.unlink()
    assert call(["-C", str(ws), "inspect", KEY]).code == 0


def test_a_store_whose_lock_is_a_folder_is_named_with_the_fix(tmp_path: Path) -> None:
    ws = workspace(tmp_path)
    lock = ws / ".cgbuild" / "store" / "lock"
    lock.mkdir(parents=True)
    out = call(["-C", str(ws), "gc", "--dry-run"])
    assert out.code == 2, out.stderr
    assert f"cannot lock the store: {lock}: Is a directory" in out.stderr
    assert "move aside what is there" in out.stderr
    lock.rmdir()
    assert call(["-C", str(ws), "gc", "--dry-run"]).code == 0
