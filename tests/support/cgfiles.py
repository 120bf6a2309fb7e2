"""Cgfiles written into a test's folder: loaded, or the one error loading them raises."""

from __future__ import annotations

from pathlib import Path

import pytest

from cgbuild.config import cgfile
from cgbuild.core.errors import UserError

CPU_FP32 = """\
[sku.cpu]
sm = "cpu"
memory_gib = 4

[layout.fp32]
quant = "plain.fp32"
"""
"""One CPU sku and one fp32 layout: what a one-module Cgfile runs on."""

ONE_MODULE = (
    "[workspace]\n{workspace}\n\n"
    + CPU_FP32
    + """
[family.t]
entry = "m:build"
skus = ["cpu"]
layouts = ["fp32"]

[family.t.module.mlp]
shapes = ["8x64"]
"""
)
"""One family of one module on one sku; `{workspace}` is the body of its `[workspace]` table."""

VIDEO_MODULE = (
    CPU_FP32
    + """
[family.v]
entry = "m:build"
skus = ["cpu"]
layouts = ["fp32"]

[family.v.module.wan]
shapes = ["8x8"]
"""
)
"""One module whose envelope comes last: a test appends the dimensions it declares."""


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
