"""The artifact key: one hash over the four key axes, each with exactly one producer.

Membership axiom: key on exactly what requires a recompile. `graph` (the trace rule's digest),
`sm` (the target's architecture), `toolchain` (the platform's fold, `toolchain.py`) and `layout`
(the digest pair, `layout.py`). The envelope facet is coverage, not identity; family names, SKU
names and memory, lanes and trace-time libraries never enter. Each axis has an identity block
(what is hashed) and a readable block (what `why` and `diff` show).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Any

from cgbuild.core.canon import canonical_json

KEY_SCHEME = "cgbuild.key/1"
_SCHEME_JSON = f'"{KEY_SCHEME}"'
AXES = ("graph", "sm", "toolchain", "layout")
# Which fields of each axis's readable block are its identity (what `why` and `diff` compare).
IDENTITY_FIELDS = {
    "graph": ("digest",),
    "sm": ("sm",),
    "toolchain": ("platform", "fold"),
    "layout": ("topology", "quant"),
}


def identity_of(name: str, readable: dict[str, Any]) -> dict[str, Any]:
    """The identity fields of axis `name` read from its readable block (a recorded plan's)."""
    return {f: readable.get(f) for f in IDENTITY_FIELDS[name]}


def moved_fields(name: str, old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """Every identity field of axis `name` that differs between two readable blocks: the one
    comparison `plan`, `why` and `diff` make."""
    return [(f, old.get(f), new.get(f)) for f in IDENTITY_FIELDS[name] if old.get(f) != new.get(f)]


def move_text(name: str, old: dict[str, Any], new: dict[str, Any]) -> tuple[str, str]:
    """(before, after) of one axis move as a person reads it: the sm itself; a layout's stamp
    with each moved digest; otherwise each moved field's digest, shortened."""
    fields = moved_fields(name, old, new) or [(f, old.get(f), new.get(f)) for f in IDENTITY_FIELDS[name]]
    if name == "sm":
        return str(old.get("sm")), str(new.get("sm"))

    def side(block: dict[str, Any], values: list[Any]) -> str:
        moved = ", ".join(f"{f} {str(v)[:12]}" for (f, *_), v in zip(fields, values, strict=True))
        return f"{block.get('stamp')} ({moved})" if name == "layout" else moved

    return side(old, [o for _, o, _ in fields]), side(new, [n for _, _, n in fields])


@dataclass(frozen=True)
class Axis:
    identity: dict[str, Any]
    readable: dict[str, Any]

    @functools.cached_property
    def canonical(self) -> str:
        """The identity block's canonical JSON, guarded once per axis object (plans share axes)."""
        return canonical_json(self.identity)


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
    # Byte-identical to digest({"scheme": KEY_SCHEME, **identities}): the top-level keys in sorted
    # order, each block already canonical. Joining pre-rendered blocks keeps 10,000 keys cheap.
    parts = {**{name: axes[name].canonical for name in AXES}, "scheme": _SCHEME_JSON}
    text = "{" + ",".join(f'"{name}":{parts[name]}' for name in sorted(parts)) + "}"
    return hashlib.sha256(text.encode("ascii")).hexdigest()
