"""Cgfiles written into a test's folder: loaded, or the one error loading them raises."""

from __future__ import annotations

from pathlib import Path

import pytest

from cgbuild.config import cgfile
from cgbuild.core.errors import UserError

ONE_MODULE = """\
[workspace]
{workspace}

[sku.cpu]
sm = "cpu"
memory_gib = 4

[layout.fp32]
quant = "plain.fp32"

[family.t]
entry = "m:build"
skus = ["cpu"]
layouts = ["fp32"]

[family.t.module.mlp]
shapes = ["8x64"]
"""
"""One family of one module on one sku; `{workspace}` is the body of its `[workspace]` table."""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "Cgfile"
    p.write_text(text)
    return p


def error_of(tmp_path: Path, text: str) -> UserError:
    with pytest.raises(UserError) as info:
        cgfile.load(write(tmp_path, text))
    return info.value


def load_ws(tmp_path: Path, workspace: str) -> cgfile.Cgfile:
    """`ONE_MODULE` with this `[workspace]` body, loaded."""
    path = tmp_path / "Cgfile"
    path.write_text(ONE_MODULE.format(workspace=workspace))
    return cgfile.load(path)
