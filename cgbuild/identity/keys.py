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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cgbuild.core.canon import canonical_json

KEY_SCHEME = "cgbuild.key/1"
_SCHEME_JSON = f'"{KEY_SCHEME}"'


@dataclass(frozen=True)
class AxisKind:
    """One key axis: its name and the fields of its readable block that are its identity.

    The identity is projected from the readable block by these fields, so what is hashed, what
    `plan`, `why` and `diff` compare and what a recorded plan must hold cannot disagree."""

    name: str
    fields: tuple[str, ...]

    def axis(self, readable: dict[str, Any]) -> Axis:
        return Axis({f: readable[f] for f in self.fields}, readable)

    def identity(self, readable: dict[str, Any]) -> dict[str, Any]:
        """The identity read from a readable block (a recorded plan's)."""
        return {f: readable.get(f) for f in self.fields}

    def moved(self, old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
        """Every identity field that differs between two readable blocks: the one comparison
        `plan`, `why` and `diff` make."""
        return [(f, old.get(f), new.get(f)) for f in self.fields if old.get(f) != new.get(f)]

    def move_text(self, old: Mapping[str, Any], new: Mapping[str, Any]) -> tuple[str, str]:
        """(before, after) of a move as a person reads it: the sm itself; a layout's stamp with
        each moved digest; otherwise each moved field's digest, shortened."""
        fields = self.moved(old, new) or [(f, old.get(f), new.get(f)) for f in self.fields]
        if self is SM:
            return str(old.get("sm")), str(new.get("sm"))

        def side(block: Mapping[str, Any], values: list[Any]) -> str:
            moved = ", ".join(f"{f} {str(v)[:12]}" for (f, *_), v in zip(fields, values, strict=True))
            if self is GRAPH and old.get("strides") != new.get("strides"):
                return f"{moved}, traced strides {strides_text(block.get('strides'))}"
            return f"{block.get('stamp')} ({moved})" if self is LAYOUT else moved

        return side(old, [o for _, o, _ in fields]), side(new, [n for _, _, n in fields])


def strides_text(strides: Mapping[str, Any] | None) -> str:
    """A graph's non-contiguous traced inputs as a person reads them: `hidden_states [128, 1,
    8]`, or `contiguous` when it has none."""
    if not strides:
        return "contiguous"
    return "; ".join(f"{name} [{', '.join(map(str, stride))}]" for name, stride in strides.items())


GRAPH = AxisKind("graph", ("digest",))
SM = AxisKind("sm", ("sm",))
TOOLCHAIN = AxisKind("toolchain", ("platform", "fold"))
LAYOUT = AxisKind("layout", ("topology", "quant"))
KINDS = {kind.name: kind for kind in (GRAPH, SM, TOOLCHAIN, LAYOUT)}
AXES = tuple(KINDS)


@dataclass(frozen=True)
class Axis:
    identity: dict[str, Any]
    readable: dict[str, Any]

    @functools.cached_property
    def canonical(self) -> str:
        """The identity block's canonical JSON, guarded once per axis object (plans share axes)."""
        return canonical_json(self.identity)


def graph_axis(
    graph_digest: str, *, torch: str, nodes: int | None, strides: dict[str, Any] | None = None
) -> Axis:
    """`strides`: the traced strides of the inputs not laid out contiguously, as the trace's
    contract names them. The digest already holds them (the trace rule folds them in); the
    readable block carries them so a move names them. Absent for a contiguous trace, whose
    block stays what it was before strides counted."""
    readable: dict[str, Any] = {"digest": graph_digest, "traced_with": torch, "nodes": nodes}
    if strides:
        readable["strides"] = strides
    return GRAPH.axis(readable)


def sm_axis(sm: str) -> Axis:
    return SM.axis({"sm": sm})


def toolchain_axis(platform: str, fold: str, source: str) -> Axis:
    return TOOLCHAIN.axis({"platform": platform, "fold": fold, "source": source})


def key_of(axes: dict[str, Axis]) -> str:
    """The key: sha256 of the canonical identity blocks of exactly the four axes."""
    if set(axes) != set(AXES):
        raise ValueError(f"a key needs exactly the axes {AXES}, got {sorted(axes)}")
    # Byte-identical to digest({"scheme": KEY_SCHEME, **identities}): the top-level keys in sorted
    # order, each block already canonical. Joining pre-rendered blocks keeps 10,000 keys cheap.
    parts = {**{name: axes[name].canonical for name in AXES}, "scheme": _SCHEME_JSON}
    text = "{" + ",".join(f'"{name}":{parts[name]}' for name in sorted(parts)) + "}"
    return hashlib.sha256(text.encode("ascii")).hexdigest()
