"""fp8 attention on sm_90 beside bf16 SDPA, at flux2-klein's attention shapes.

Why: on an H200 the klein transformer spends 11.4 ms of a 45 ms fp8 step in cuDNN's bf16
attention, and no library attention takes e4m3 on sm_90; `cgbuild::fp8_attention_v1`
(`cgbuild_rules.fp8_attention`) is ours. This measures whether it is worth a lane: on
(1, 24, L, 128) bf16 inputs for L = 2816 and 4608 (768² and 1024² with 512 text tokens), the
median ms of 20 CUDA-event timed calls after 5 warm-ups and TFLOP/s of

  sdpa_cudnn, sdpa_flash   torch's bf16 SDPA with one backend each;
  fp8_op                   the op called eagerly: its quantization runs as separate ATen kernels;
  fp8_op_compiled          the op under `torch.compile`, which fuses the quantization as an
                           AOTInductor package does;
  fp8_quantize             the quantization alone (q, k and v), so the kernel's share is visible;

and each output's relative L2 error against fp32 attention of the same inputs.

    python benchmarks/attention_gpu.py [--out benchmarks/results/attention_gpu.json] [--commit SHA]
    python benchmarks/attention_gpu.py --tiny

`--tiny` rehearses the run on a machine without a GPU: (1, 2, 200, 128) under Triton's CPU
interpreter, wall-clock timed, SDPA's math backend only, nothing compiled, nothing written unless
`--out` is given. Its fp8 error is the interpreter's: that casts some values to e4m3 a binade low
(tests/support/triton_child.py), so it is larger than a GPU's.
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import commit_option, cuda_timed, timed, write_result

KLEIN_TOKENS = (2816, 4608)
HEADS, HEAD_DIM = 24, 128


def _rel(x: Any, y: Any) -> float:
    return round(float((x.float() - y).norm() / y.norm()), 6)


def rows(tiny: bool) -> list[dict[str, Any]]:
    """One row per (sequence length, implementation)."""
    import torch
    from cgbuild_rules import fp8_attention
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = "cpu" if tiny else "cuda"
    heads, lengths = (2, (200,)) if tiny else (HEADS, KLEIN_TOKENS)
    attention = fp8_attention.op()
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def pinned(backend: SDPBackend) -> Callable[..., Any]:
        def call(q: Any, k: Any, v: Any) -> Any:
            with sdpa_kernel(backend):
                return sdpa(q, k, v)

        return call

    def quantize_all(q: Any, k: Any, v: Any) -> Any:
        return [fp8_attention.quantize(x) for x in (q, k, v)]

    impls: dict[str, Callable[..., Any]] = {"fp8_op": attention, "fp8_quantize": quantize_all}
    if tiny:
        impls["sdpa_math"] = pinned(SDPBackend.MATH)
    else:
        impls |= {
            "sdpa_cudnn": pinned(SDPBackend.CUDNN_ATTENTION),
            "sdpa_flash": pinned(SDPBackend.FLASH_ATTENTION),
            "fp8_op_compiled": torch.compile(attention, fullgraph=True),
        }
    gen = torch.Generator(device).manual_seed(0)
    out = []
    for n in lengths:
        q, k, v = (
            torch.randn(1, heads, n, HEAD_DIM, device=device, generator=gen, dtype=torch.bfloat16)
            for _ in range(3)
        )
        ref = torch.softmax(q.float() @ k.float().transpose(-2, -1) / HEAD_DIM**0.5, -1) @ v.float()
        flops = 4 * heads * n * n * HEAD_DIM
        for name, fn in impls.items():
            call = functools.partial(fn, q, k, v)

            seconds = timed(call, reps=3, warmup=1) if tiny else cuda_timed(call, reps=20, warmup=5)
            row: dict[str, Any] = {"tokens": n, "impl": name, "ms": round(seconds * 1e3, 4)}
            if name != "fp8_quantize":
                row["tflops"] = round(flops / seconds / 1e12, 1)
                row["rel_vs_fp32"] = _rel(call(), ref)
            out.append(row)
            print(row, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a CPU rehearsal under Triton's interpreter")
    parser.add_argument("--out", type=Path, default=None, help="the result JSON (GPU default: results/)")
    commit_option(parser)
    opts = parser.parse_args()
    if opts.tiny:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel is defined: before any import of it
    out = opts.out or (None if opts.tiny else Path(__file__).parent / "results" / "attention_gpu.json")
    numbers = {"tiny": opts.tiny, "rows": rows(opts.tiny)}
    if out is not None:
        write_result(out, "attention_gpu", numbers, packages=("triton",), torch=True, commit=opts.commit)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
