"""A diffusers pipeline's own components, traced the way the pipeline calls them: a serving
process attaches their artifacts to the pipeline's modules as they are (no wrapper, no adapter).

- `transformer`: the stock `Flux2Transformer2DModel`, called as `Flux2KleinPipeline` calls it
  every step: keyword inputs, `hidden_states` with the strides the pipeline's packing leaves it
  (a transposed view), 3-D position ids, `guidance=None`, `joint_attention_kwargs=None`,
  `return_dict=False` (a tuple out);
- `vae.decode`: the stock `AutoencoderKLFlux2`, served by its `decode` (traced with `decode` as
  its forward: its tensor names are the VAE's own), called `decode(latents, return_dict=False)`.

Shapes are pixels: 16 pixels a token (the VAE's 8x, then 2x2 patches), 8 pixels a latent.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

PIXELS_PER_TOKEN = 16
PIXELS_PER_LATENT = 8


def transformer(config: dict[str, Any]) -> nn.Module:
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(**config).eval()


def vae(config: dict[str, Any]) -> nn.Module:
    from diffusers import AutoencoderKLFlux2

    return AutoencoderKLFlux2(**config).eval()


def position_ids(rows: int, cols: int, text_len: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(image ids, text ids) as the pipeline builds them: (t, h, w, l) per token, batched."""
    img = torch.zeros(batch, rows * cols, 4, dtype=torch.int64)
    img[..., 1] = torch.arange(rows).repeat_interleave(cols)
    img[..., 2] = torch.arange(cols).repeat(rows)
    txt = torch.zeros(batch, text_len, 4, dtype=torch.int64)
    txt[..., 3] = torch.arange(text_len)
    return img, txt


def build(spec: dict[str, Any]) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    config, name = spec["config"], spec["module"]
    h, w, b = int(spec["height"]), int(spec["width"]), int(spec["batch"])
    if name == "transformer":
        model = transformer(config["transformer"])
        rows, cols, text = h // PIXELS_PER_TOKEN, w // PIXELS_PER_TOKEN, int(spec["text_len"])
        channels = model.config.in_channels
        img_ids, txt_ids = position_ids(rows, cols, text, b)
        kwargs = {
            # the pipeline's packing permutes: its hidden states are a transposed view
            "hidden_states": torch.randn(b, channels, rows * cols).transpose(1, 2),
            "timestep": torch.rand(b),
            "guidance": None,
            "encoder_hidden_states": torch.randn(b, text, model.config.joint_attention_dim),
            "txt_ids": txt_ids,
            "img_ids": img_ids,
            "joint_attention_kwargs": None,
            "return_dict": False,
        }
        return model, (), kwargs
    if name == "vae.decode":
        decoder = vae(config["vae"])
        decoder.forward = decoder.decode  # type: ignore[method-assign]
        latent = torch.randn(
            b, decoder.config.latent_channels, h // PIXELS_PER_LATENT, w // PIXELS_PER_LATENT
        )
        return decoder, (latent,), {"return_dict": False}
    raise ValueError(f"zoo_pipelines has a transformer and a vae.decode, not {name!r}")
