"""fp8 attention on sm_90 beside bf16 SDPA, and the fused QK norm + rotary embedding beside
diffusers' unfused path, at flux2-klein's attention shapes.

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

The QK norm + rotary rows (`--only qk_rope`): a klein step spends ~2.5 ms in pointwise kernels
and 3.4 ms in reductions around its GEMMs, and q and k pass through RMSNorm and the rotary
embedding in every block. `cgbuild::qk_norm_rope_v1` (`cgbuild_rules.qk_rope`) does both in one
pass. On klein's heads (24 × 128, eps 1e-6, random norm weights, FLUX.2's own rotary table) for
a single-stream block (4608 tokens, q and k strided views of the fused projection) and a
double-stream one (512 text + 4096 image tokens with their own norms, then concatenated), the
median ms and GB/s (q and k read once, written once) of

  qk_rope_op        the fused op, writing [B, H, S, D];
  qk_rope_eager     `qk_rope.reference`: diffusers' `norm_q`/`norm_k` (+ `norm_added_*` and
                    the cat) and `apply_rotary_emb`, eager, leaving [B, H, S, D] views;
  qk_rope_compiled  the same under `torch.compile`, Inductor's fusion as an AOTInductor
                    package of klein has it today;

and each one's relative L2 error against the eager path.

    python benchmarks/attention_gpu.py [--only attention|qk_rope] [--out PATH] [--commit SHA]
    python benchmarks/attention_gpu.py --tiny [--only attention|qk_rope]

On a GPU the result goes to benchmarks/results/attention_gpu.json, or attention_gpu_qk_rope.json
(…_attention.json) for one benchmark, so a partial run overwrites no full one.

`--tiny` rehearses the run on a machine without a GPU: (1, 2, 200, 128) under Triton's CPU
interpreter, wall-clock timed, SDPA's math backend only, nothing compiled, nothing written unless
`--out` is given. Its fp8 error is the interpreter's: that casts some values to e4m3 a binade low
(tests/support/triton_child.py), so it is larger than a GPU's. The QK rows run 2 heads on 7 + 63
tokens; the interpreter truncates to bf16 where the GPU rounds, so their error is not zero.
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import commit_option, cuda_timed, rel_l2, timed, write_result

KLEIN_TOKENS = (2816, 4608)
HEADS, HEAD_DIM = 24, 128


def attention_rows(tiny: bool) -> list[dict[str, Any]]:
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
                row["rel_vs_fp32"] = rel_l2(call(), ref)
            out.append(row)
            print(row, flush=True)
    return out


def _klein_rotary(text: int, rows: int, cols: int) -> Any:
    """FLUX.2's (cos, sin) for `text` tokens then a `rows` × `cols` image, on the CPU."""
    import torch
    from diffusers.models.transformers.transformer_flux2 import Flux2PosEmbed

    grid = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    zeros = torch.zeros(rows * cols)
    image = torch.stack([zeros, grid[0].flatten(), grid[1].flatten(), zeros], -1)
    words = torch.stack([torch.zeros(text)] * 3 + [torch.arange(text)], -1)
    return Flux2PosEmbed(2000, [32, 32, 32, 32])(torch.cat([words, image]).float())


def qk_rope_rows(tiny: bool) -> list[dict[str, Any]]:
    """One row per (block kind, implementation)."""
    import torch
    from cgbuild_rules import qk_rope
    from diffusers.models.transformers.transformer_flux2 import Flux2Attention

    device = "cpu" if tiny else "cuda"
    heads, text_len, (rows, cols) = (2, 7, (7, 9)) if tiny else (HEADS, 512, (64, 64))
    torch.manual_seed(0)
    attn = Flux2Attention(heads * HEAD_DIM, heads, HEAD_DIM, added_kv_proj_dim=heads * HEAD_DIM, eps=1e-6)
    for norm in (attn.norm_q, attn.norm_k, attn.norm_added_q, attn.norm_added_k):
        torch.nn.init.normal_(norm.weight, 1.0, 0.5)
    attn = attn.to(device, torch.bfloat16).requires_grad_(False)

    def qk(*shape: int) -> Any:  # q and k of one projection: [B, S, 2, H, D] unbound
        return torch.randn(*shape, 2, heads, HEAD_DIM, device=device, dtype=torch.bfloat16).unbind(-3)

    impls: dict[str, Callable[..., Any]] = {
        "qk_rope_op": functools.partial(qk_rope.apply, attn),
        "qk_rope_eager": functools.partial(qk_rope.reference, attn),
    }
    if not tiny:
        impls["qk_rope_compiled"] = torch.compile(impls["qk_rope_eager"], fullgraph=True)
    out = []
    n = text_len + rows * cols
    rotary = tuple(x.to(device) for x in _klein_rotary(text_len, rows, cols))
    blocks = {"single": (*qk(1, n), rotary, None), "joint": (*qk(1, rows * cols), rotary, qk(1, text_len))}
    for block, args in blocks.items():
        moved = 2 * 2 * 2 * n * heads * HEAD_DIM  # q and k, bf16, read and written
        ref = impls["qk_rope_eager"](*args)
        for name, fn in impls.items():
            call = functools.partial(fn, *args)
            seconds = timed(call, reps=3, warmup=1) if tiny else cuda_timed(call, reps=20, warmup=5)
            got = call()
            rel = max(rel_l2(g, w.float()) for g, w in zip(got, ref, strict=True))
            row = {"block": block, "tokens": n, "impl": name, "ms": round(seconds * 1e3, 4)}
            out.append(row | {"gb_per_s": round(moved / seconds / 1e9, 1), "rel_vs_eager": rel})
            print(out[-1], flush=True)
    return out


BENCHES = {"attention": attention_rows, "qk_rope": qk_rope_rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a CPU rehearsal under Triton's interpreter")
    parser.add_argument("--out", type=Path, default=None, help="the result JSON (GPU default: results/)")
    parser.add_argument("--only", choices=sorted(BENCHES), default=None, help="one of the benchmarks")
    commit_option(parser)
    opts = parser.parse_args()
    if opts.tiny:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel is defined: before any import of it
    name = f"attention_gpu_{opts.only}.json" if opts.only else "attention_gpu.json"
    out = opts.out or (None if opts.tiny else Path(__file__).parent / "results" / name)
    chosen = [opts.only] if opts.only else list(BENCHES)
    numbers = {"tiny": opts.tiny, "rows": [row for name in chosen for row in BENCHES[name](opts.tiny)]}
    if out is not None:
        write_result(out, "attention_gpu", numbers, packages=("triton",), torch=True, commit=opts.commit)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
