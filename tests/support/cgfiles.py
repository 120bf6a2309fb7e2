"""Cgfiles written into a test's folder: loaded, or the one error loading them raises."""

from __future__ import annotations

import json
import shutil
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

KLEIN_ENTRY = 'LANES = {"attention": {"flash": {}, "math": {}}}\n\n\ndef build(spec):\n    return None\n'
"""klein's entry module (`klein_entry.py`): it declares the attention lanes itself, builds nothing."""

KLEIN_LANES = 'attention = ["flash", "math"]\nfp8-gemm = ["scaled-mm", "triton"]\n'
"""Both lane axes a klein target can carry: its entry's `attention`, fp8-rowwise's `fp8-gemm`."""

FLUX2 = Path(__file__).resolve().parents[2] / "examples" / "flux2_klein"


def flux2_workspace(dest: Path, tiny_lanes: str = "") -> Path:
    """A copy of the FLUX.2 example at `dest/klein`, its tiny family given the lanes table
    `tiny_lanes` (TOML lines) when any."""
    ws = dest / "klein"
    shutil.copytree(FLUX2, ws, ignore=shutil.ignore_patterns(".cgbuild", "__pycache__"))
    if tiny_lanes:
        anchor = "[family.flux2-klein-tiny.config.model]"
        text = (ws / "Cgfile").read_text()
        (ws / "Cgfile").write_text(
            text.replace(anchor, f"[family.flux2-klein-tiny.lanes]\n{tiny_lanes}\n{anchor}")
        )
    return ws


KLEIN_QUANTS = {"bf16": "plain.bf16", "fp8": "fp8-rowwise"}


def klein(
    lanes: str,
    *,
    workspace: str = 'state = ".state"',
    layouts: tuple[str, ...] = ("bf16", "fp8"),
    served: str | None = None,
) -> str:
    """A Cgfile of one family, klein: one transformer shape on an sm_90 sku, the `layouts` declared
    (`KLEIN_QUANTS`) and served (or those of `served`, a TOML list), its `[family.klein.lanes]`
    table last, holding `lanes`. `workspace` is the `[workspace]` body, and any table after it."""
    declared = "".join(f'[layout.{name}]\nquant = "{KLEIN_QUANTS[name]}"\n\n' for name in layouts)
    return f"""[workspace]
{workspace}

[sku.h200]
sm = "sm_90"
memory_gib = 141

{declared}[family.klein]
entry = "klein_entry:build"
sources = ["*.py"]
skus = ["h200"]
layouts = {served or json.dumps(list(layouts))}

[family.klein.module.transformer]
shapes = ["64x64"]
batch_sizes = [1]

[family.klein.lanes]
{lanes}"""


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
