"""Pixel frames and latent frames: a video pipeline's `num_frames` against its denoiser's input.

A video VAE compresses time causally: its first latent frame holds the first pixel frame and each
later one `factor` more (Wan 2.x, HunyuanVideo, CogVideoX: 4; LTX-Video: 8), so a pipeline asked
for `num_frames = factor * (k - 1) + 1` feeds its denoiser k frames. Only the entry knows its
VAE, so the entry states the factor, beside `LANES`, as a literal cgbuild reads without
importing it: `PIXEL_FRAMES = {"transformer": 4}`. A module of such an entry may then declare
either count, `frames` (its own input frames) or `pixel_frames` (the pipeline's), and the plan,
`why`, `inspect` and the serving manifest show both. Identity is the module's own count: the
label, the graph class and the key are the same whichever was declared.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cgbuild.config.dims import Declared, Range
from cgbuild.config.reader import NAME
from cgbuild.core.errors import UserError
from cgbuild.core.literal import read_entry_table

TABLE_NAME = "PIXEL_FRAMES"
MAX_FACTOR = 64


@dataclass(frozen=True)
class Temporal:
    """A module's pixel → latent frame rule: `pixel = factor * (latent - 1) + 1`."""

    factor: int

    def pixel(self, latent: int) -> int:
        return self.factor * (latent - 1) + 1

    def latent(self, pixel: int) -> int | None:
        """The latent frames a pipeline makes of `pixel` frames; None for a count it would round."""
        return None if (pixel - 1) % self.factor else (pixel - 1) // self.factor + 1

    def pixels(self, declared: Declared) -> Declared:
        """A declaration in latent frames as the pipeline counts it."""
        if isinstance(declared, Range):
            return Range(self.pixel(declared.min), self.pixel(declared.max))
        return tuple(self.pixel(v) for v in declared)

    def near(self, pixel: int) -> str:
        """The pipeline's counts either side of `pixel` (what a refusal offers instead)."""
        below = max(1, (pixel - 1) // self.factor * self.factor + 1)
        return f"{below} or {below + self.factor}"


def read_pixel_frames(root: Path, entry: str) -> dict[str, Temporal]:
    """module → its rule, from the entry's `PIXEL_FRAMES` under `root` ({} when it states none)."""
    found = read_entry_table(
        root,
        entry,
        TABLE_NAME,
        "module -> its VAE's temporal factor (pixel = factor * (latent - 1) + 1)",
        NAME,
    )
    if found is None:
        return {}
    raw, line, path = found
    out: dict[str, Temporal] = {}
    for module, factor in raw.items():
        if type(factor) is not int or not 1 <= factor <= MAX_FACTOR:
            raise UserError(
                f"{TABLE_NAME}[{module!r}]: {factor!r} is no temporal factor (an integer 1..{MAX_FACTOR})",
                file=path,
                line=line,
                field=TABLE_NAME,
            )
        out[module] = Temporal(factor)
    return out


def latent_frames(rule: Temporal, declared: Declared) -> Declared:
    """`declared` pixel frames as the module's own; `ValueError` names a count no latent count
    makes. Such a count is refused, not rounded (WanPipeline rounds `num_frames` down to 4k + 1
    with a warning): the label would name frames no call asked for."""

    def one(pixel: int) -> int:
        latent = rule.latent(pixel)
        if latent is None:
            raise ValueError(
                f"{pixel} pixel frames is no {rule.factor}k + 1 count, so no pipeline call makes it "
                f"(the entry's {TABLE_NAME} factor is {rule.factor}): declare {rule.near(pixel)}"
            )
        return latent

    if isinstance(declared, Range):
        return Range(one(declared.min), one(declared.max))
    return tuple(one(v) for v in declared)
