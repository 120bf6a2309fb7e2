"""The artifact key: one hash over the four key axes, each with exactly one producer.

Membership axiom: key on exactly what requires a recompile. `graph` (the trace rule's digest),
`sm` (the target's architecture), `toolchain` (the platform's fold, `toolchain.py`) and `layout`
(the digest pair, `layout.py`). The envelope facet is coverage, not identity; family names, SKU
names and memory, lanes and trace-time libraries never enter. Each axis has an identity block
(what is hashed) and a readable block (what `why` and `diff` show).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .canon import digest

KEY_SCHEME = "cgbuild.key/1"
AXES = ("graph", "sm", "toolchain", "layout")


@dataclass(frozen=True)
class Axis:
    identity: dict[str, Any]
    readable: dict[str, Any]


def graph_axis(graph_digest: str, *, torch: str, nodes: int | None) -> Axis:
    return Axis({"digest": graph_digest}, {"digest": graph_digest, "traced_with": torch, "nodes": nodes})


def sm_axis(sm: str) -> Axis:
    return Axis({"sm": sm}, {"sm": sm})


def toolchain_axis(platform: str, fold: str, source: str) -> Axis:
    return Axis({"platform": platform, "fold": fold}, {"platform": platform, "fold": fold, "source": source})


def key_of(axes: dict[str, Axis]) -> str:
    """The key: sha256 of the canonical identity blocks of exactly the four axes."""
    if set(axes) != set(AXES):
        raise ValueError(f"a key needs exactly the axes {AXES}, got {sorted(axes)}")
    return digest({"scheme": KEY_SCHEME, **{name: axes[name].identity for name in AXES}})
