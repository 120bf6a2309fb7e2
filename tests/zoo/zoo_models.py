"""Tiny models with the state tables real ones have, for the serving zoo (random weights).

- `bnconv`: a conv net with BatchNorm (running statistics and a `num_batches_tracked` counter
  the compiled program never reads);
- `vae.decode`: a diffusers `AutoencoderKL` served by its `decode` (the encoder's parameters
  are on the module, the graph never uses them);
- `lm`: a causal LM whose output head is tied to its input embedding (one storage, two names);
- `rotary`: attention with non-persistent rotary buffers (`inv_freq`, `cos`, `sin`) and one
  non-persistent buffer the program never reads.

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


def build(spec: dict[str, Any]) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
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
    raise ValueError(f"no zoo module {name!r}")
