"""Trace jobs exactly as the engine sends them, and the graph digests two of them are banked at."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from support.toy import EXAMPLES

TOY = EXAMPLES / "toy"
FLUX = EXAMPLES / "flux2_klein"

TINY_FLUX2 = {
    "model": {
        "patch_size": 1,
        "in_channels": 8,
        "num_layers": 1,
        "num_single_layers": 1,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": 32,
        "timestep_guidance_channels": 32,
        "mlp_ratio": 2.0,
        "axes_dims_rope": [4, 4, 4, 4],
        "guidance_embeds": False,
    }
}

# Banked fixture digests (torch 2.13.0, diffusers 0.42.1). Moving one of these is a fleet-wide
# re-mint: every artifact key of that graph moves. Only change them together with digest.SCHEME, or for a
# deliberate, reviewed change of the traced program.
BANKED = {
    "toy/mlp/8x64-b1": "769699c9d70258ade193136e61d36fe5145000e6c719bb9a52a4f40208d164a3",
    "flux2-klein-tiny/transformer/64x48-t8-b1": (
        "f39cbc0f9b77f1110a1527be3fd0724afc7804089b623d5ee71e2f5ed2ec10dc"
    ),
}


def make_job(
    module: str = "mlp",
    *,
    height: int = 8,
    width: int = 64,
    batch: int = 1,
    text_len: int | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    config: dict[str, Any] | None = None,
    entry: str = "toy_models:build",
    root: Path = TOY,
    family: str = "toy",
    job_id: str = "job",
    quant: str | None = None,
    lanes: dict[str, list[str]] | None = None,
) -> dict[str, Any]:
    """A trace job exactly as the engine sends it: of the plain layout of `dtype` unless `quant`
    names another, with the `lanes` program given (none: no lane axes)."""
    plain = {"float32": "plain.fp32", "bfloat16": "plain.bf16", "float16": "plain.fp16"}
    job = {
        "id": job_id,
        "entry": entry,
        "root": str(root),
        "config": config if config is not None else {},
        "quant": quant or plain[dtype],
        "spec": {
            "family": family,
            "module": module,
            "graph_class": f"{height}x{width}-b{batch}",
            "height": height,
            "width": width,
            "text_len": text_len,
            "batch": batch,
            "dtype": dtype,
            "device": device,
        },
    }
    if lanes is not None:
        job["spec"]["lanes"] = lanes
    return job


def flux_job(height: int = 64, width: int = 48, text_len: int = 8, **kw: Any) -> dict[str, Any]:
    return make_job(
        "transformer",
        height=height,
        width=width,
        text_len=text_len,
        config=TINY_FLUX2,
        entry="flux2_entry:build",
        root=FLUX,
        family="flux2-klein-tiny",
        **kw,
    )
