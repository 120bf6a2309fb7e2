"""The `triton` value of the `fp8-rowwise` rule's `fp8-gemm` lane: one Triton GEMM that quantizes
its activations as it loads them.

`torch._scaled_mm` (the `scaled-mm` value) takes fp8 operands, so the row-wise activation
quantization runs before it as its own kernel and writes an fp8 copy of x that the GEMM reads
back. Here the GEMM loads x in the compute dtype and divides, clamps and casts each tile to
float8_e4m3fn in registers, and applies both row scales and the bias in its epilogue: the fp8
copy of x never exists. A row's scale needs the whole row before any element of it can be
quantized, so `absmax(row) / 448` stays a separate reduction (it reads x once and writes one fp32
per row); the rounding is the rule's (docs/layouts.md), so both values compute the same numbers
up to accumulation order.

`cgbuild::fp8_rowwise_linear_v1` is a `torch.library.triton_op`: AOTInductor compiles the kernel
into the package, so a serving process runs it without importing this module. The op's name is
versioned because a custom op enters the graph digest by name only: change the kernel, bump it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, cast

import torch
from torch._subclasses.fake_tensor import is_fake

BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M = 128, 128, 128, 8
"""One tile shape for every call (Hopper-sized: 128^3 tiles, 8 warps, 3 stages). No autotuning: a
mint compiles one kernel per shape and the lane's measurement is the tuning that decides."""
NUM_WARPS, NUM_STAGES = 8, 3
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton's CPU interpreter (correctness checks on a machine without a GPU)."""


@functools.cache
def kernel() -> Any:
    """The Triton kernel (a `triton.jit` function; needs triton)."""
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def fused(  # type: ignore[no-untyped-def]  # a kernel's parameters are its launch contract
        x,
        x_scale,
        w,
        w_scale,
        bias,
        y,
        M,
        N,
        K,
        HAS_BIAS: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        GM: tl.constexpr,
    ):
        # grouped tile order: GM row-tiles share each column of w while it is in L2
        pid = tl.program_id(0)
        tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
        group = pid // (GM * tiles_n)
        first_m = group * GM
        size_m = min(tiles_m - first_m, GM)
        pid_m = first_m + (pid % (GM * tiles_n)) % size_m
        pid_n = (pid % (GM * tiles_n)) // size_m
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        in_m, in_n = rm < M, rn < N
        s_x = tl.load(x_scale + rm, mask=in_m, other=1.0)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            in_k = rk < K
            a = tl.load(x + rm[:, None] * K + rk[None, :], mask=in_m[:, None] & in_k[None, :], other=0.0)
            # 448: float8_e4m3fn's largest finite (a jit kernel may read no plain global)
            a = tl.clamp(a.to(tl.float32) / s_x[:, None], -448.0, 448.0).to(tl.float8e4nv)
            b = tl.load(w + rn[None, :] * K + rk[:, None], mask=in_n[None, :] & in_k[:, None], other=0.0)
            acc = tl.dot(a, b, acc)
        acc = acc * s_x[:, None] * tl.load(w_scale + rn, mask=in_n, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias + rn, mask=in_n, other=0.0).to(tl.float32)[None, :]
        out = acc.to(y.dtype.element_ty)
        tl.store(y + rm[:, None] * N + rn[None, :], out, mask=in_m[:, None] & in_n[None, :])

    return fused


@functools.cache
def op() -> Callable[..., torch.Tensor]:
    """Register `cgbuild::fp8_rowwise_linear_v1` on first use and return it (needs triton)."""
    import triton

    @torch.library.triton_op("cgbuild::fp8_rowwise_linear_v1", mutates_args=())
    def linear(
        rows: torch.Tensor,
        x_scale: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor,
    ) -> torch.Tensor:
        """rows [M, K] (compute dtype, contiguous), x_scale [M] fp32, weight [N, K] fp8, weight_scale
        [N] fp32, bias [N] (compute dtype; an empty tensor for none) → [M, N] in the compute dtype."""
        m, k = rows.shape
        n = weight.shape[0]
        out = torch.empty((m, n), device=rows.device, dtype=rows.dtype)
        has_bias = bias.numel() > 0
        if INTERPRET and is_fake(rows):
            return out  # the interpreter's kernel cannot be traced: a fake call gives the shape alone

        def grid(meta: dict[str, Any]) -> tuple[int]:
            return (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)

        torch.library.wrap_triton(kernel())[grid](
            rows,
            x_scale,
            weight,
            weight_scale,
            bias if has_bias else weight_scale,
            out,
            m,
            n,
            k,
            HAS_BIAS=has_bias,
            BM=BLOCK_M,
            BN=BLOCK_N,
            BK=BLOCK_K,
            GM=GROUP_M,
            num_warps=NUM_WARPS,
            num_stages=NUM_STAGES,
        )
        return out

    return cast(Callable[..., torch.Tensor], linear)
