"""FLUX.2's query/key RMSNorm and rotary embedding as one Triton kernel.

FLUX.2's attention processors hold q and k as [B, S, H, D] bf16 (a projection's output, unflattened
into heads), normalize each with its `torch.nn.RMSNorm` (`attn.norm_q`, `attn.norm_k`; the
double-stream blocks normalize the text tokens with `norm_added_q` / `norm_added_k` and put them
first) and apply diffusers' `apply_rotary_emb(x, (cos, sin), sequence_dim=1)` with its defaults:
`use_real=True`, `use_real_unbind_dim=-1` — channels (2i, 2i+1) are one complex pair —, cos and sin
fp32 [S, D] from `Flux2PosEmbed` (each frequency repeated for both channels of its pair). Eager, that
is a reduction and several pointwise kernels per tensor, each a full pass over q or k (on an H200
a klein step spends ~2.5 ms in pointwise kernels and 3.4 ms in reductions around its GEMMs).

`cgbuild::qk_norm_rope_v1` does both tensors in one kernel and one pass: each program reads BLOCK_S
tokens of one head of q or k straight from the projection's strides (no copy), and

- RMSNorm in fp32 as torch's does: y = x · rsqrt(mean(x²) + eps) · weight, rounded to bf16 (the
  norm's output dtype: the reference rounds there too, so the two agree to bf16 rounding);
- the rotation in fp32: out[2i] = y[2i]·cos[2i] − y[2i+1]·sin[2i],
  out[2i+1] = y[2i+1]·cos[2i+1] + y[2i]·sin[2i+1], rounded to bf16;
- with text tokens given (the double-stream blocks), token t < T comes from the text tensors with
  the added norms' weights, t ≥ T from the image tensors at t − T: the concatenation is fused too;
- writes [B, H, S, D] contiguous: the heads-first layout attention takes (SDPA's kernels and
  `cgbuild::fp8_attention_v1`), so no transpose copy follows.

The name is versioned because a custom op enters the graph digest by name only: change the kernel,
bump it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import torch
from cgbuild_rules.fp8_gemm import INTERPRET
from torch._subclasses.fake_tensor import is_fake

BLOCK_S = 32
"""Tokens per program: a [32, 128] fp32 tile per tensor, 4 warps. No autotuning, as the fp8
attention: the lane's measurement at mint is the tuning that decides."""
NUM_WARPS = 4
HEAD_DIM = 128
"""The one head dimension the kernel is built for (klein's); others are refused."""

Pair = tuple[torch.Tensor, torch.Tensor]
"""(q, k), (cos, sin) or a text part's (q, k)."""
QKNormRope = Callable[..., Pair]


@functools.cache
def kernel() -> Any:
    """The Triton kernel (a `triton.jit` function; needs triton)."""
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def forward(  # type: ignore[no-untyped-def]  # a kernel's parameters are its launch contract
        q,
        k,
        q_text,
        k_text,
        q_weight,
        k_weight,
        q_text_weight,
        k_text_weight,
        cos,
        sin,
        q_out,
        k_out,
        N,
        T,
        H,
        stride_b,
        stride_s,
        stride_h,
        text_stride_b,
        text_stride_s,
        text_stride_h,
        eps,
        D: tl.constexpr,
        BS: tl.constexpr,
        TEXT: tl.constexpr,
    ):
        # one program: BS tokens of one (batch, head) of q (axis 2 = 0) or k (1); out [B, H, N, D]
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        if tl.program_id(2) == 0:
            x, x_text, w, w_text, out = q, q_text, q_weight, q_text_weight, q_out
        else:
            x, x_text, w, w_text, out = k, k_text, k_weight, k_text_weight, k_out
        rs = tl.program_id(0) * BS + tl.arange(0, BS)
        rd = tl.arange(0, D)
        in_s = rs < N
        image = in_s & (rs >= T)
        x_ptrs = x + b * stride_b + h * stride_h + (rs - T)[:, None].to(tl.int64) * stride_s + rd[None, :]
        v = tl.load(x_ptrs, mask=image[:, None], other=0.0).to(tl.float32)
        weight = tl.load(w + rd).to(tl.float32)[None, :]
        if TEXT:
            text = rs < T
            t_ptrs = x_text + b * text_stride_b + h * text_stride_h + rs[:, None].to(tl.int64) * text_stride_s
            v += tl.load(t_ptrs + rd[None, :], mask=text[:, None], other=0.0).to(tl.float32)
            weight = tl.where(text[:, None], tl.load(w_text + rd).to(tl.float32)[None, :], weight)
        rstd = tl.rsqrt(tl.sum(v * v, 1) / D + eps)
        y = (v * rstd[:, None] * weight).to(tl.bfloat16).to(tl.float32)
        even, odd = tl.split(tl.reshape(y, (BS, D // 2, 2)))
        rotated = tl.reshape(tl.join(-odd, even), (BS, D))
        rope = rs[:, None] * D + rd[None, :]
        c = tl.load(cos + rope, mask=in_s[:, None], other=0.0).to(tl.float32)
        s = tl.load(sin + rope, mask=in_s[:, None], other=0.0).to(tl.float32)
        o_ptrs = out + (b * H + h) * N * D + rs[:, None] * D + rd[None, :]
        tl.store(o_ptrs, (y * c + rotated * s).to(out.dtype.element_ty), mask=in_s[:, None])

    return forward


def _strides(*xs: torch.Tensor) -> tuple[int, int, int]:
    """The (batch, token, head) strides `xs` share, their channels being contiguous."""
    strides = [tuple(x.stride()) for x in xs]  # a list: traced strides are symbols, unhashable
    if any(st != strides[0] for st in strides) or strides[0][-1] != 1:
        raise ValueError(f"q and k must share strides with contiguous channels: {strides}")
    sb, ss, sh, _ = strides[0]
    return sb, ss, sh


@functools.cache
def op() -> QKNormRope:
    """Register `cgbuild::qk_norm_rope_v1` on first use and return it (needs triton)."""
    import triton

    @torch.library.triton_op("cgbuild::qk_norm_rope_v1", mutates_args=())
    def qk_norm_rope(
        q: torch.Tensor,
        k: torch.Tensor,
        text: list[torch.Tensor],
        weights: list[torch.Tensor],
        cos: torch.Tensor,
        sin: torch.Tensor,
        eps: float,
    ) -> Pair:
        """q, k [B, S, H, D] bf16 (D = 128), cos and sin [T + S, D] → RMSNorm then rotary
        embedding of q and of k, each [B, H, T + S, D] bf16. `text` is empty or [q_text, k_text]:
        T text tokens [B, T, H, D] that come first. `weights` are the norms' [D] weights: q's,
        k's, then with text q_text's and k_text's."""
        b, n_image, h, d = q.shape
        if d != HEAD_DIM:
            raise ValueError(f"the qk norm + rope kernel is built for head dim {HEAD_DIM}, not {d}")
        if k.shape != q.shape:
            raise ValueError(f"q and k must share one shape: {q.shape}, {k.shape}")
        q_weight, k_weight, q_text_weight, k_text_weight = weights if text else weights * 2
        q_text, k_text = text or (q, k)
        n_text = q_text.shape[1] if text else 0
        if text and (q_text.shape != (b, n_text, h, d) or k_text.shape != q_text.shape):
            raise ValueError(f"text q and k must be [{b}, T, {h}, {d}]: {q_text.shape}, {k_text.shape}")
        n = n_text + n_image
        if cos.shape != (n, d) or sin.shape != (n, d):
            raise ValueError(f"cos and sin must be [{n}, {d}]: {cos.shape}, {sin.shape}")
        q_out = torch.empty((b, h, n, d), device=q.device, dtype=q.dtype)
        k_out = torch.empty_like(q_out)
        if INTERPRET and is_fake(q):
            return q_out, k_out  # the interpreter's kernel cannot be traced: a fake call gives the shapes
        grid = (triton.cdiv(n, BLOCK_S), b * h, 2)
        torch.library.wrap_triton(kernel())[grid](
            q,
            k,
            q_text,
            k_text,
            q_weight,
            k_weight,
            q_text_weight,
            k_text_weight,
            cos.contiguous(),
            sin.contiguous(),
            q_out,
            k_out,
            n,
            n_text,
            h,
            *_strides(q, k),
            *_strides(q_text, k_text),
            eps,
            D=d,
            BS=BLOCK_S,
            TEXT=bool(text),
            num_warps=NUM_WARPS,
        )
        return q_out, k_out

    return cast(QKNormRope, qk_norm_rope)


def apply(
    attn: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    rotary: Pair,
    text: Pair | None = None,
    *,
    call: QKNormRope | None = None,
) -> Pair:
    """What a FLUX.2 processor does between its projections and attention, through the op: `attn`'s
    norms (`norm_q`, `norm_k`; `norm_added_q`, `norm_added_k` for `text`'s q and k) and the
    rotary embedding `rotary` = (cos, sin). The norms must share one eps (diffusers builds them so).
    `call`: the registered op (`torch.ops.cgbuild.qk_norm_rope_v1`) where `op()` must not run, as
    in a `torch.cond` branch, which dynamo traces and which may only call an op registered before."""
    names = ("norm_q", "norm_k") + (("norm_added_q", "norm_added_k") if text else ())
    norms: list[torch.nn.RMSNorm] = [getattr(attn, name) for name in names]
    eps = {norm.eps for norm in norms}
    weights = [norm.weight for norm in norms]
    if len(eps) != 1 or None in eps:
        raise ValueError(f"the norms must share one eps: {[norm.eps for norm in norms]}")
    return (call or op())(q, k, list(text or ()), weights, *rotary, eps.pop())


def reference(attn: Any, q: torch.Tensor, k: torch.Tensor, rotary: Pair, text: Pair | None = None) -> Pair:
    """`apply`'s computation as FLUX.2's processors do it, unfused (diffusers' modules and
    `apply_rotary_emb`; needs diffusers): what the op is held to, and what it replaces. The outputs
    are [B, H, T + S, D] views."""
    # the module itself, not `diffusers.models` (a lazy module `torch.compile` refuses to import through)
    from diffusers.models.embeddings import apply_rotary_emb

    # annotated as taking a 1-tuple and returning a pair; it takes (cos, sin) and returns one tensor
    rotate = cast(Callable[..., torch.Tensor], apply_rotary_emb)
    qk = [attn.norm_q(q), attn.norm_k(k)]
    if text:
        added = attn.norm_added_q(text[0]), attn.norm_added_k(text[1])
        qk = [torch.cat([t, x], dim=1) for t, x in zip(added, qk, strict=True)]
    q_out, k_out = (rotate(x, rotary, sequence_dim=1).transpose(1, 2) for x in qk)
    return q_out, k_out
