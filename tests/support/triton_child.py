"""Triton kernels run in a child process, on the CPU: Triton reads `TRITON_INTERPRET` when a
kernel is defined, so one process cannot hold both the interpreter's kernel and the compiler's.

Triton 3.6's interpreter casts fp32 to float8_e4m3fn wrongly where rounding up carries into the
exponent: the carry is OR'd into the exponent field, so 126.24 becomes 64, not 128 (31.98 → 16),
and ties round away from zero (triton-lang/triton#8322). It casts fp32 to bf16 by truncation
(1 + 3·2⁻⁹ becomes 1, not 1 + 2⁻⁷). The GPU rounds both to nearest even, e4m3 saturating
(`cvt.rn.satfinite.e4m3x2.f32`, `cvt.rn.bf16.f32`), as torch's casts do. A kernel that casts in
registers (an attention's P, a norm's bf16 output) would show errors the GPU never makes, so a
child can swap in the GPU's rounding (`gpu_rounding`); tests/rules/test_fp8_attention.py checks
that the interpreter still needs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1]


def run(script: str, *, interpret: bool) -> Any:
    """Run `script` in a fresh Python (with `support` importable), under the interpreter or not;
    its last line of output is JSON, returned decoded."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    command = [sys.executable, "-c", script]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def gpu_rounding() -> None:
    """Make this process's interpreter cast fp32 → float8_e4m3fn and fp32 → bf16 as the GPU does:
    round to nearest even (torch's casts), e4m3 saturating to ±448. Every other conversion stays
    Triton's."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    triton_cast = interpreter._convert_float
    torch_dtypes = {tl.float8e4nv: torch.float8_e4m3fn, tl.bfloat16: torch.bfloat16}

    def convert(data: Any, src: Any, dst: Any, rounding: Any) -> Any:
        if src != tl.float32 or dst not in torch_dtypes:
            return triton_cast(data, src, dst, rounding)
        values = torch.from_numpy(np.ascontiguousarray(data).view(np.float32))
        if dst == tl.float8e4nv:
            values = values.clamp(-448.0, 448.0)
        bits = torch.uint8 if dst == tl.float8e4nv else torch.uint16
        return values.to(torch_dtypes[dst]).view(bits).numpy()

    interpreter._convert_float = convert
