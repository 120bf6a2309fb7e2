"""Triton kernels run in a child process, on the CPU: Triton reads `TRITON_INTERPRET` when a
kernel is defined, so one process cannot hold both the interpreter's kernel and the compiler's.

Triton 3.6's interpreter casts fp32 to float8_e4m3fn wrongly where rounding up carries into the
exponent: the carry is OR'd into the exponent field, so 126.24 becomes 64, not 128 (31.98 → 16),
and ties round away from zero (triton-lang/triton#8322). The GPU rounds to nearest even and
saturates (`cvt.rn.satfinite.e4m3x2.f32`). A kernel that casts in registers (an attention's P)
would show errors the GPU never makes, so a child can swap in the GPU's rounding
(`gpu_fp8_rounding`); tests/rules/test_fp8_attention.py checks that the interpreter still needs it.
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


def gpu_fp8_rounding() -> None:
    """Make this process's interpreter cast fp32 → float8_e4m3fn as the GPU does: saturate to
    ±448, then round to nearest even (torch's cast). Every other conversion stays Triton's."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    triton_cast = interpreter._convert_float

    def convert(data: Any, src: Any, dst: Any, rounding: Any) -> Any:
        if src != tl.float32 or dst != tl.float8e4nv:
            return triton_cast(data, src, dst, rounding)
        values = torch.from_numpy(np.ascontiguousarray(data).view(np.float32)).clamp(-448.0, 448.0)
        return values.to(torch.float8_e4m3fn).view(torch.uint8).numpy()

    interpreter._convert_float = convert
