"""Tiny models with the state tables real ones have, for the serving zoo (random weights).

- `bnconv`: a conv net with BatchNorm (running statistics and a `num_batches_tracked` counter
  the compiled program never reads);
- `vae.decode`: a diffusers `AutoencoderKL` served by its `decode` (the encoder's parameters
  are on the module, the graph never uses them);
- `lm`: a causal LM whose output head is tied to its input embedding (one storage, two names);
- `rotary`: attention with non-persistent rotary buffers (`inv_freq`, `cos`, `sin`) and one
  non-persistent buffer the program never reads;
- `vae.encode`: the same `AutoencoderKL` served by its `encode` (the decoder is present, unused);
- `dynbatch`: a small MLP whose batch is exported as a symbol in `zoo.dynamic_batch` (config,
  `[min, max]`): one artifact serves every batch in the range.

The heavy zoo (family `zoo-heavy`):
- `unet`: a diffusers `UNet2DConditionModel` with cross-attention and SDXL's added time
  embeddings (`addition_embed_type = "text_time"`); text length from the envelope;
- `gpt2`: a `transformers` GPT-2 causal LM with tied input/output embeddings;
- `clip`: a `transformers` CLIP text encoder (a non-persistent `position_ids` buffer).

The diffusion-transformer zoo (family `zoo-dit`), called with the keyword inputs the diffusers
pipelines pass (`return_dict=False`, a tuple out):
- `sd3`: a diffusers `SD3Transformer2DModel` (joint attention over latent patches and text;
  batch 2, as classifier-free guidance calls it);
- `wan`: a diffusers `WanTransformer3DModel` (video latents of two frames, rotary buffers,
  RMS-normed q/k, cross-attention to the text).

The video zoo (family `zoo-video`) builds the same `wan` at its declared frame counts; a module
that declares a frame range (`wan-range`) gets it exported as the `frames` Dim, one program for
every count in it. Wan's VAE makes a latent frame of the first pixel frame and of every 4 after
it, which `PIXEL_FRAMES` states, so `wan-range` declares the pipeline's count (`pixel_frames`,
WanPipeline's `num_frames`) and the plan derives its own. Family `zoo-skew`'s `skew` is right at
every frame count of its range but one, and only in eager (`zoo.skew_at`, config): it stands for
a program compiled wrong at one size, a kernel chosen by size or a shape branch the export never
saw, which only a check at that size finds.

`zoo.random_buffer` (config) adds a buffer drawn at random on construction: a literal no live
module reproduces, which adopt must refuse.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class BNConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


class VAEDecode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from diffusers import AutoencoderKL

        self.vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",),
            up_block_types=("UpDecoderBlock2D",),
            block_out_channels=(8,),
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=4,
            sample_size=16,
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(z).sample


class VAEEncode(VAEDecode):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.vae.encode(x).latent_dist.mean


class UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from diffusers import UNet2DConditionModel

        self.unet = UNet2DConditionModel(
            sample_size=8,
            in_channels=4,
            out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            block_out_channels=(8, 16),
            layers_per_block=1,
            norm_num_groups=4,
            cross_attention_dim=8,
            attention_head_dim=2,
            addition_embed_type="text_time",
            addition_time_embed_dim=4,
            projection_class_embeddings_input_dim=8 + 6 * 4,  # text_embeds + six time ids x 4
        )

    def forward(
        self,
        sample: torch.Tensor,
        timestep: torch.Tensor,
        text: torch.Tensor,
        text_embeds: torch.Tensor,
        time_ids: torch.Tensor,
    ) -> torch.Tensor:
        cond = {"text_embeds": text_embeds, "time_ids": time_ids}
        return self.unet(sample, timestep, encoder_hidden_states=text, added_cond_kwargs=cond).sample


class GPT2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=1
        )
        self.lm = GPT2LMHeadModel(config)
        assert self.lm.lm_head.weight is self.lm.transformer.wte.weight, "the head must be tied"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, use_cache=False).logits


class CLIPText(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from transformers import CLIPTextConfig, CLIPTextModel

        config = CLIPTextConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=16,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=2,
        )
        self.text = CLIPTextModel(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.text(input_ids=ids).last_hidden_state


class MLP(nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(features, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.block = nn.Sequential(
            nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)
        )
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.block(h)
        return self.lm_head(self.norm(h))


class Rotary(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 2, seq: int = 8, random_buffer: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        half = dim // heads // 2
        inv_freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        self.register_buffer("unused_cache", torch.zeros(4), persistent=False)
        if random_buffer:
            self.register_buffer("jitter", torch.randn(dim), persistent=False)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, dim=-1)
        return torch.cat([a * self.cos - b * self.sin, a * self.sin + b * self.cos], dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "jitter"):
            x = x + self.jitter
        b, s, d = x.shape
        q, k, v = (
            t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, -1)
        )
        y = nn.functional.scaled_dot_product_attention(self.rotate(q), self.rotate(k), v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


SD3 = {
    "sample_size": 8,
    "patch_size": 2,
    "in_channels": 4,
    "out_channels": 4,
    "num_layers": 1,
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "joint_attention_dim": 32,
    "caption_projection_dim": 32,
    "pooled_projection_dim": 16,
    "pos_embed_max_size": 8,
}
"""The tiny SD3 transformer's config: one joint block, 2 heads x 16 dims."""

PIXEL_FRAMES = {"wan": 4, "wan-range": 4}
"""The Wan modules' pixel -> latent frame rule: num_frames = 4 * (latent frames - 1) + 1."""

WAN = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "in_channels": 4,
    "out_channels": 4,
    "text_dim": 32,
    "freq_dim": 32,
    "ffn_dim": 32,
    "num_layers": 1,
    "eps": 1e-6,
    "rope_max_seq_len": 32,
}
"""The tiny Wan transformer's config: one block, 2 heads x 16 dims."""


def sd3(spec: dict[str, Any]) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    from diffusers import SD3Transformer2DModel

    b, h, w, text = spec["batch"], spec["height"], spec["width"], spec["text_len"]
    kwargs = {
        "hidden_states": torch.randn(b, SD3["in_channels"], h, w),
        "timestep": torch.rand(b) * 999,
        "encoder_hidden_states": torch.randn(b, text, SD3["joint_attention_dim"]),
        "pooled_projections": torch.randn(b, SD3["pooled_projection_dim"]),
        "joint_attention_kwargs": None,
        "return_dict": False,
    }
    return SD3Transformer2DModel(**SD3), (), kwargs


def wan(spec: dict[str, Any]) -> tuple[Any, ...]:
    from diffusers import WanTransformer3DModel

    b, h, w, text = spec["batch"], spec["height"], spec["width"], spec["text_len"]
    frames = spec.get("frames") or 2  # declared for a video family; zoo-dit's wan folds in two
    kwargs = {
        "hidden_states": torch.randn(b, WAN["in_channels"], frames, h, w),
        "timestep": torch.rand(b) * 999,
        "encoder_hidden_states": torch.randn(b, text, WAN["text_dim"]),
        "attention_kwargs": None,
        "return_dict": False,
    }
    declared = spec["ranges"].get("frames")
    if declared is None:
        return WanTransformer3DModel(**WAN), (), kwargs
    dims = {name: None for name in kwargs} | {"hidden_states": {2: torch.export.Dim("frames", **declared)}}
    return WanTransformer3DModel(**WAN), (), kwargs, dims


class Skewed(nn.Module):
    """A linear map over each frame, plus one in eager at `skew_at` frames (see the module's
    docstring): exported, the program never takes the branch."""

    def __init__(self, features: int, skew_at: int) -> None:
        super().__init__()
        self.fc = nn.Linear(features, features)
        self.skew_at = skew_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if not torch.compiler.is_exporting() and x.shape[1] == self.skew_at:
            y = y + 1
        return y


def build(spec: dict[str, Any]) -> tuple[Any, ...]:
    b, h, w = spec["batch"], spec["height"], spec["width"]
    name = spec["module"]
    if name == "bnconv":
        return BNConv(), (torch.randn(b, 3, h, w),), {}
    if name == "vae.decode":
        return VAEDecode(), (torch.randn(b, 4, h, w),), {}
    if name == "lm":
        return TiedLM(), (torch.randint(0, 64, (b, w)),), {}
    if name == "rotary":
        random_buffer = bool(spec["config"].get("random_buffer"))
        return Rotary(seq=w, random_buffer=random_buffer), (torch.randn(b, w, 32),), {}
    if name == "vae.encode":
        return VAEEncode(), (torch.randn(b, 3, h, w),), {}
    if name == "dynbatch":
        lo, hi = (int(v) for v in spec["config"]["dynamic_batch"])
        # A size-1 example would be specialized away by export: trace with at least 2.
        x = torch.randn(min(max(b, lo, 2), hi), h, w)
        return MLP(w), (x,), {}, {"x": {0: torch.export.Dim("batch", min=lo, max=hi)}}
    if name == "unet":
        text = torch.randn(b, spec["text_len"], 8)
        return (
            UNet(),
            (torch.randn(b, 4, h, w), torch.rand(b) * 999, text, torch.randn(b, 8), torch.randn(b, 6)),
            {},
        )
    if name == "gpt2":
        return GPT2(), (torch.randint(0, 64, (b, w)),), {}
    if name == "clip":
        return CLIPText(), (torch.randint(0, 64, (b, w)),), {}
    if name == "sd3":
        return sd3(spec)
    if name in ("wan", "wan-range"):
        return wan(spec)
    if name == "skew":
        frames = torch.export.Dim("frames", **spec["ranges"]["frames"])
        x = torch.randn(b, spec["frames"], w)
        return Skewed(w, spec["config"]["skew_at"]), (x,), {}, ({1: frames},)
    raise ValueError(f"no zoo module {name!r}")
