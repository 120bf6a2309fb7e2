"""A diffusers pipeline's own components, traced the way the pipeline calls them: a serving
process attaches their artifacts to the pipeline's modules as they are (no wrapper, no adapter).

- `transformer`: the stock `Flux2Transformer2DModel`, called as `Flux2KleinPipeline` calls it
  every step: keyword inputs, `hidden_states` with the strides the pipeline's packing leaves it
  (a transposed view), 3-D position ids, `guidance=None`, `joint_attention_kwargs=None`,
  `return_dict=False` (a tuple out);
- `vae.decode`: the stock `AutoencoderKLFlux2`, served by its `decode` (traced with `decode` as
  its forward: its tensor names are the VAE's own), called `decode(latents, return_dict=False)`.

Shapes are pixels: 16 pixels a token (the VAE's 8x, then 2x2 patches), 8 pixels a latent.

Family `zoo-sdxl`: `StableDiffusionXLPipeline`'s `unet` (under classifier-free guidance, batch 2:
the sample and a 0-dim timestep by position, the text by keyword, SDXL's size conditioning as the
`added_cond_kwargs` dict) and its `AutoencoderKL`'s `decode`; 2 pixels a latent.
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
    if spec["family"] == "zoo-sdxl":
        return _sdxl(config, name, h, w, b, spec.get("text_len"))
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


def _sdxl(
    config: dict[str, Any], name: str, h: int, w: int, b: int, text_len: int | None
) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    from diffusers import AutoencoderKL, UNet2DConditionModel

    size = (h // 2, w // 2)
    if name == "unet":
        unet = UNet2DConditionModel(**config["unet"]).eval()
        cfg = unet.config
        pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
        added = {"text_embeds": torch.randn(b, pooled), "time_ids": torch.rand(b, 6) * 64}
        kwargs = {
            "encoder_hidden_states": torch.randn(b, int(text_len or 0), cfg.cross_attention_dim),
            "timestep_cond": None,
            "cross_attention_kwargs": None,
            "added_cond_kwargs": added,
            "return_dict": False,
        }
        return unet, (torch.randn(b, cfg.in_channels, *size), torch.tensor(500.0)), kwargs
    if name == "vae.decode":
        decoder = AutoencoderKL(**config["vae"]).eval()
        decoder.forward = decoder.decode  # type: ignore[method-assign]
        return decoder, (torch.randn(b, decoder.config.latent_channels, *size),), {"return_dict": False}
    raise ValueError(f"zoo-sdxl has a unet and a vae.decode, not {name!r}")
