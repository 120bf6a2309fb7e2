"""FLUX.2 [klein] transformer entry, shared by the `flux2-klein` and `flux2-klein-tiny` families.

Entry: `flux2_entry:build`, modules `transformer` and `vae.decode` (flux2_vae.py). Config:
    [config.model]   # keyword arguments of diffusers' Flux2Transformer2DModel, e.g. for klein-4B:
    patch_size = 1, in_channels = 128, num_layers = 5, num_single_layers = 20,
    attention_head_dim = 128, num_attention_heads = 24, joint_attention_dim = 7680,
    timestep_guidance_channels = 256, mlp_ratio = 3.0, axes_dims_rope = [32, 32, 32, 32],
    rope_theta = 2000, guidance_embeds = false

The transformer works on packed latents: one token per 16x16 image pixels (VAE /8, then 2x2
patches), so a graph class is (batch, image tokens, text tokens) and 1024x768 and 768x1024 are
one program. The weights are random (no download): weights never enter a key.

Lanes (`LANES`, read by cgbuild without importing this file). `attention` is the SDPA
kernel every attention of the 25 blocks runs, each value an explicit ATen op (what
`F.scaled_dot_product_attention` would pick is decided when the program is traced, so it could
not be a runtime choice):
- `flash`: `_scaled_dot_product_flash_attention` (its CPU kernel on a CPU target): the reference;
- `cudnn`: `_scaled_dot_product_cudnn_attention` (CUDA, sm_80 and newer);
- `efficient`: `_scaled_dot_product_efficient_attention` (CUDA);
- `math`: softmax(q k^T / sqrt(d)) v in fp32, two matmuls and a spelled-out softmax: runs
  anywhere, slow and large.
`qk-norm` is how q and k reach attention from their projections: RMSNorm, the double-stream
blocks' text tokens joined, the rotary embedding —
- `unfused`: diffusers' modules and `apply_rotary_emb`, left to the compiler to fuse
  (`cgbuild_rules.qk_rope.reference`);
- `fused`: `cgbuild::qk_norm_rope_v1`, one Triton kernel and one pass (`cgbuild_rules.qk_rope`;
  CUDA, head dimension 128).
Each axis is one `LaneSwitch` on the root (`attention_lane`, `qk_norm_lane`); the blocks'
processors route through them. A family that declares no `qk-norm` traces the processors' own
norm and rotary calls, op for op as before the axis existed. The fp8 layout's GEMM lane
(`fp8-gemm`) is its quant rule's, not this file's.

The traced call is `Flux2KleinTransformer.forward`'s, not the one `Flux2KleinPipeline` makes
(keywords, ids of shape (B, N, 4), `return_dict=False`, a tuple back), so `CALLS` (read by cgbuild
without importing this file; docs/entry.md) says how the pipeline's call reaches the program:
`adopt_pipeline` then serves a stock pipeline from these artifacts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from cgbuild_rules import qk_rope
from cgbuild_rules.lanes import LaneSwitch
from diffusers import Flux2Transformer2DModel
from diffusers.models.transformers.transformer_flux2 import (
    Flux2Attention,
    Flux2ParallelSelfAttention,
    _get_qkv_projections,
    apply_rotary_emb,
)

PIXELS_PER_TOKEN = 16

LANES = {
    "attention": {
        "flash": {},
        "cudnn": {"device": "cuda", "min_sm": 80},
        "efficient": {"device": "cuda"},
        "math": {},
    },
    "qk-norm": {
        "unfused": {},
        "fused": {"device": "cuda", "triton": True},
    },
}

CALLS = {
    "transformer": {
        "passes": {"return_dict": False},  # answered with the tuple below
        "first_row": ["img_ids", "txt_ids"],  # the model reads row 0 of (B, N, 4) ids itself
        "returns": "tuple",
        "traced_class": "flux2_entry.Flux2KleinTransformer",  # the same model, another call
        # the processors below route attention through the lane switch; each computes what the
        # stock processor it stands for does, so a stock pipeline's module serves their program
        "substitutes": {
            "flux2_entry.JointAttnProcessor": (
                "diffusers.models.transformers.transformer_flux2.Flux2AttnProcessor"
            ),
            "flux2_entry.ParallelAttnProcessor": (
                "diffusers.models.transformers.transformer_flux2.Flux2ParallelSelfAttnProcessor"
            ),
        },
    },
}

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False)[0]
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False)[0]


def _cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, False, 0.0, False, False)[0]


def _efficient(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, False)[0]


def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The softmax is spelled out: Inductor rewrites `softmax(q k^T) v` written with `softmax`
    into its own SDPA kernel (measured: compiled, this lane was bit-identical to `flash`)."""
    scores = (q.float() @ k.float().transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    weights = (scores - scores.amax(dim=-1, keepdim=True)).exp()
    return ((weights / weights.sum(dim=-1, keepdim=True)) @ v.float()).to(q.dtype)


ATTENTION: dict[str, Attend] = {"flash": _flash, "cudnn": _cudnn, "efficient": _efficient, "math": _math}


def _heads_last(fn: Attend) -> Attend:
    """diffusers' layout (batch, tokens, heads, dim) in and out; the kernels take heads first.
    Every value returns the same contiguous tensor, as the branches of one `torch.cond` must."""

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2).contiguous()

    return run


def _unfused(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """`qk_rope.reference`, laid out afresh as the fused op's output is: the branches of one
    `torch.cond` return tensors laid out alike (`contiguous()` would keep a size-1 dimension's
    stride, which the op's output does not share)."""
    q, k = qk_rope.reference(*args)
    return q.clone(memory_format=torch.contiguous_format), k.clone(memory_format=torch.contiguous_format)


def _fused(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """`qk_rope.apply` through the op `route` registered: a `torch.cond` branch may only call it."""
    return qk_rope.apply(*args, call=torch.ops.cgbuild.qk_norm_rope_v1)


QK_NORM: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {"unfused": _unfused, "fused": _fused}


class _Attention:
    """The attention call of both processors: through the lane switches (one per axis for the
    model); `qk` None: no `qk-norm` axis, the processor's own norm and rotary calls."""

    def __init__(self, switch: LaneSwitch, qk: LaneSwitch | None = None) -> None:
        self.switch = switch
        self.impls = {v: _heads_last(ATTENTION[v]) for v in switch.values}
        self.qk = qk

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        if mask is not None:
            raise ValueError("the attention lanes take no attention mask (klein's pipeline passes none)")
        return self.switch.select(self.impls, q, k, v).flatten(2, 3)

    def norm_rope(
        self, attn: Any, rotary: Any, split: Callable[..., list[torch.Tensor]], *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k through the `qk-norm` switch ((B, S, H, D) views of its heads-first output):
        `split(*tensors)` gives q, k and, in the double-stream blocks, the text's q and k (joined
        first, with their own norms), each (B, S, H, D); then normalized and rotated. Split inside
        the branch: `torch.cond` takes no operands that alias one another, and q and k of one
        projection do."""
        assert self.qk is not None and rotary is not None

        def impl(fn: Callable[..., Any]) -> Callable[..., Any]:
            def run(cos: torch.Tensor, sin: torch.Tensor, *operands: torch.Tensor) -> Any:
                q, k, *text = split(*operands)
                return fn(attn, q, k, (cos, sin), tuple(text) or None)

            return run

        out = self.qk.select({v: impl(QK_NORM[v]) for v in self.qk.values}, *rotary, *tensors)
        return out[0].transpose(1, 2), out[1].transpose(1, 2)


class JointAttnProcessor(_Attention):
    """The double-stream blocks' attention (`Flux2Attention`): text and image tokens, one SDPA."""

    def __call__(
        self,
        attn: Flux2Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Any:
        q, k, v, eq, ek, ev = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        if self.qk is not None:
            v = v.unflatten(-1, (-1, attn.head_dim))
            text = ()
            if attn.added_kv_proj_dim is not None:
                text, v = (eq, ek), torch.cat([ev.unflatten(-1, (-1, attn.head_dim)), v], dim=1)
            heads = (t.unflatten(-1, (-1, attn.head_dim)) for t in (q, k, *text))
            q, k = self.norm_rope(attn, image_rotary_emb, lambda *ts: list(ts), *heads)
        else:
            q, k, v = (t.unflatten(-1, (-1, attn.head_dim)) for t in (q, k, v))
            q, k = attn.norm_q(q), attn.norm_k(k)
            if attn.added_kv_proj_dim is not None:
                eq, ek, ev = (t.unflatten(-1, (-1, attn.head_dim)) for t in (eq, ek, ev))
                q = torch.cat([attn.norm_added_q(eq), q], dim=1)
                k = torch.cat([attn.norm_added_k(ek), k], dim=1)
                v = torch.cat([ev, v], dim=1)
            if image_rotary_emb is not None:
                q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
                k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        out = self.attend(q, k, v, attention_mask).to(q.dtype)
        if encoder_hidden_states is None:
            return attn.to_out[1](attn.to_out[0](out))
        text_len = encoder_hidden_states.shape[1]
        text_out, image_out = out.split_with_sizes([text_len, out.shape[1] - text_len], dim=1)
        return attn.to_out[1](attn.to_out[0](image_out)), attn.to_add_out(text_out)


class ParallelAttnProcessor(_Attention):
    """The single-stream blocks' attention (`Flux2ParallelSelfAttention`): QKV and the MLP input in
    one projection, attention and MLP outputs in one output projection."""

    def __call__(
        self,
        attn: Flux2ParallelSelfAttention,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        projected = attn.to_qkv_mlp_proj(hidden_states)
        qkv_dim = 3 * attn.inner_dim
        qkv, mlp = projected.split([qkv_dim, projected.shape[-1] - qkv_dim], dim=-1)
        if self.qk is not None:
            v = qkv.chunk(3, dim=-1)[2].unflatten(-1, (-1, attn.head_dim))
            # one operand, (B, S, 3, H, D): q and k of one projection would alias each other
            heads = qkv.unflatten(-1, (3, -1, attn.head_dim))
            q, k = self.norm_rope(attn, image_rotary_emb, lambda t: list(t.unbind(2)[:2]), heads)
        else:
            q, k, v = (t.unflatten(-1, (-1, attn.head_dim)) for t in qkv.chunk(3, dim=-1))
            q, k = attn.norm_q(q), attn.norm_k(k)
            if image_rotary_emb is not None:
                q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
                k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        out = self.attend(q, k, v, attention_mask).to(q.dtype)
        return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))


def route(model: torch.nn.Module, attention: list[str], qk_norm: list[str] | None = None) -> None:
    """Give `model` one attention switch carrying `attention` (and, with `qk_norm`, a `qk-norm`
    switch) and route every block through them."""
    switch = LaneSwitch("attention", attention)
    model.attention_lane = switch
    qk = None
    if qk_norm:
        qk = model.qk_norm_lane = LaneSwitch("qk-norm", qk_norm)
        if "fused" in qk_norm:
            qk_rope.op()  # registered before any branch calls it
    for module in model.modules():
        if isinstance(module, Flux2Attention):
            module.set_processor(JointAttnProcessor(switch, qk))
        elif isinstance(module, Flux2ParallelSelfAttention):
            module.set_processor(ParallelAttnProcessor(switch, qk))


class Flux2KleinTransformer(Flux2Transformer2DModel):
    """The diffusers transformer with the call Klein's pipeline makes: no guidance, tensor out.

    A subclass rather than a wrapper module so the state-dict FQNs stay exactly the diffusers
    names that checkpoints and the live module at adopt carry (a wrapper would prefix them).
    """

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        img_ids: torch.Tensor,
        txt_ids: torch.Tensor,
    ) -> torch.Tensor:
        return super().forward(
            hidden_states=hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            timestep=timestep,
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=None,
            return_dict=False,
        )[0]


def image_tokens(height: int, width: int) -> int:
    if height % PIXELS_PER_TOKEN or width % PIXELS_PER_TOKEN:
        raise ValueError(f"{height}x{width}: height and width must be multiples of {PIXELS_PER_TOKEN}")
    return (height // PIXELS_PER_TOKEN) * (width // PIXELS_PER_TOKEN)


def _position_ids(height: int, width: int, text_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(t, h, w, l) ids as the pipeline builds them: image grid positions, text sequence index."""
    rows, cols = height // PIXELS_PER_TOKEN, width // PIXELS_PER_TOKEN
    img = torch.zeros(rows * cols, 4, dtype=torch.int64)
    img[:, 1] = torch.arange(rows, dtype=torch.int64).repeat_interleave(cols)
    img[:, 2] = torch.arange(cols, dtype=torch.int64).repeat(rows)
    txt = torch.zeros(text_len, 4, dtype=torch.int64)
    txt[:, 3] = torch.arange(text_len, dtype=torch.int64)
    return img, txt


def build(spec: dict[str, Any]) -> tuple[Any, ...]:
    config = dict(spec.get("config") or {})
    unknown = sorted(set(config) - {"model", "vae"})
    if unknown or not isinstance(config.get("model"), dict):
        raise ValueError(
            "flux2 config is a [config.model] table of Flux2Transformer2DModel kwargs "
            "(and a [config.vae] table of AutoencoderKLFlux2 kwargs)"
        )
    if spec["module"] == "vae.decode":
        from flux2_vae import build_decoder

        if not isinstance(config.get("vae"), dict):
            raise ValueError("the vae.decode module needs a [config.vae] table (empty: FLUX.2's VAE)")
        return build_decoder(config["vae"], int(spec["height"]), int(spec["width"]), int(spec["batch"]))
    if spec["module"] != "transformer":
        raise ValueError(f"flux2 families have 'transformer' and 'vae.decode', not {spec['module']!r}")
    text_len = spec.get("text_len")
    if not isinstance(text_len, int) or text_len < 1:
        raise ValueError(f"flux2 needs a positive text_len, got {text_len!r}")
    height, width, batch = int(spec["height"]), int(spec["width"]), int(spec["batch"])
    tokens = image_tokens(height, width)

    model = Flux2KleinTransformer(**config["model"])
    lanes = spec.get("lanes") or {}
    if lanes.get("qk-norm") and not lanes.get("attention"):
        raise ValueError("the qk-norm lane routes through the attention processors: declare attention too")
    if lanes.get("attention"):
        route(model, list(lanes["attention"]), list(lanes.get("qk-norm") or []) or None)
    cfg = model.config
    img_ids, txt_ids = _position_ids(height, width, text_len)
    args = (
        # As the pipeline packs latents, (B, C, N) permuted to (B, N, C): a transposed view. A
        # contiguous trace would serve every pipeline call on a copy (`restrided`).
        torch.randn(batch, cfg.in_channels, tokens).transpose(1, 2),
        torch.randn(batch, text_len, cfg.joint_attention_dim),
        torch.rand(batch),
        img_ids,
        txt_ids,
    )
    return model, args, {}
