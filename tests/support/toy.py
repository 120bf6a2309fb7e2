"""The toy example (examples/toy) as the tests use it: fresh copies with reference checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
_FRESH = shutil.ignore_patterns(".cgbuild", "__pycache__", "reference")
"""What a copy leaves out: a checkout's state, caches and (written once per session) references."""


@pytest.fixture(scope="session")
def toy_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy example's reference checkpoints (its `int8` layout reads their headers), written
    once per session from a copy without any, as a fresh checkout's CI would have to."""
    from cgbuild_rules.reference import write_references

    ws = tmp_path_factory.mktemp("toy-reference") / "toy"
    shutil.copytree(EXAMPLES / "toy", ws, ignore=_FRESH)
    assert write_references(ws)
    return ws / "reference"


def copy_toy(dest: Path, reference: Path) -> Path:
    """A fresh copy of examples/toy at `dest` with the session's reference checkpoints."""
    shutil.copytree(EXAMPLES / "toy", dest, ignore=_FRESH)
    shutil.copytree(reference, dest / "reference")
    return dest


def toy_with_remote(dest: Path, reference: Path, url: str, entries: list[str]) -> Path:
    """`copy_toy` whose Cgfile shares its store at `url`, trusting the publisher `entries`."""
    ws = copy_toy(dest, reference)
    cg = ws / "Cgfile"
    declared = f"[workspace]\nremote = {json.dumps(url)}\ntrusted = {json.dumps(entries)}\n"
    cg.write_text(cg.read_text().replace("[workspace]\n", declared, 1))
    return ws
