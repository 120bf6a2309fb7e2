"""The FLUX.2 VAE decoder of the `flux2-klein` family, traced as `Flux2KleinPipeline` calls it:
`vae.decode(latents, return_dict=False)` on latents of 32 channels at 1/8 of the image's size,
a tuple back. The stock `AutoencoderKLFlux2` with `decode` as its forward, so its tensor names
are the VAE's own and the artifact attaches to the pipeline's `vae.decode` (module key `serves`).

Config: `[config.vae]`, keyword arguments of `AutoencoderKLFlux2` (none: FLUX.2's own VAE, the
class's defaults). The weights are random, as the transformer's.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import AutoencoderKLFlux2
from torch import nn

PIXELS_PER_LATENT = 8


def build_decoder(
    config: dict[str, Any], height: int, width: int, batch: int
) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    if height % PIXELS_PER_LATENT or width % PIXELS_PER_LATENT:
        raise ValueError(f"{height}x{width}: height and width must be multiples of {PIXELS_PER_LATENT}")
    vae = AutoencoderKLFlux2(**config).eval()
    vae.forward = vae.decode  # type: ignore[method-assign]
    latents = torch.randn(
        batch, vae.config.latent_channels, height // PIXELS_PER_LATENT, width // PIXELS_PER_LATENT
    )
    return vae, (latents,), {"return_dict": False}
