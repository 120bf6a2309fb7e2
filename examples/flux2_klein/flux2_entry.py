"""FLUX.2 [klein] transformer entry, shared by the `flux2-klein` and `flux2-klein-tiny` families.

Entry: `flux2_entry:build`, module `transformer`. Config:
    [config.model]   # keyword arguments of diffusers' Flux2Transformer2DModel, e.g. for klein-4B:
    patch_size = 1, in_channels = 128, num_layers = 5, num_single_layers = 20,
    attention_head_dim = 128, num_attention_heads = 24, joint_attention_dim = 7680,
    timestep_guidance_channels = 256, mlp_ratio = 3.0, axes_dims_rope = [32, 32, 32, 32],
    rope_theta = 2000, guidance_embeds = false

The transformer works on packed latents: one token per 16x16 image pixels (VAE /8, then 2x2
patches), so a graph class is (batch, image tokens, text tokens) and 1024x768 and 768x1024 are
one program. The weights are random (no download): weights never enter a key.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import Flux2Transformer2DModel

PIXELS_PER_TOKEN = 16


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
    if spec["module"] != "transformer":
        raise ValueError(f"flux2 families have one module, 'transformer', not {spec['module']!r}")
    config = dict(spec.get("config") or {})
    unknown = sorted(set(config) - {"model"})
    if unknown or not isinstance(config.get("model"), dict):
        raise ValueError(
            "flux2 config must be exactly a [config.model] table of Flux2Transformer2DModel kwargs"
        )
    text_len = spec.get("text_len")
    if not isinstance(text_len, int) or text_len < 1:
        raise ValueError(f"flux2 needs a positive text_len, got {text_len!r}")
    height, width, batch = int(spec["height"]), int(spec["width"]), int(spec["batch"])
    tokens = image_tokens(height, width)

    model = Flux2KleinTransformer(**config["model"])
    cfg = model.config
    img_ids, txt_ids = _position_ids(height, width, text_len)
    args = (
        torch.randn(batch, tokens, cfg.in_channels),
        torch.randn(batch, text_len, cfg.joint_attention_dim),
        torch.rand(batch),
        img_ids,
        txt_ids,
    )
    return model, args, {}
