"""Targets: family × module × graph class × layout × sm, expanded from a Cgfile.

A graph class is one bucket of a module's envelope (shape × frames × text length × batch); its
name is derived, e.g. `1024x1024-t512-b1`, or `32x32-f9-t16-b1` for a video module (9 of its own
input frames); an image module's names and facets carry no frames. A declared range is one
bucket of its own, named by its ends (`32x32-f2..4-t16-b1`: one program for 2 to 4 frames), its
facet stating `{"min": 2, "max": 4}` where a static class states its value. Guidance values never
change the program, so they are part of every facet but of no graph class name.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from cgbuild.config.cgfile import Cgfile, Family, Module
from cgbuild.config.dims import LETTER, Declared, Range
from cgbuild.config.frames import Temporal
from cgbuild.config.labels import Selector, TargetId
from cgbuild.core.errors import UserError, Where
from cgbuild.core.platform import device_of


@dataclass(frozen=True)
class GraphClass:
    name: str
    height: int
    width: int
    text_len: int | None
    batch: int
    frames: int | None = None
    ranges: tuple[tuple[str, Range], ...] = ()
    """Spec key (`frames`, `text_len`, `batch`) → its declared range; that field then holds the
    size the program is traced at."""

    def facet(self, guidance: tuple[str, ...], temporal: Temporal | None = None) -> dict[str, Any]:
        """What the class covers; a video module whose entry states its pixel -> latent frame
        rule also says the pipeline's `pixel_frames` (coverage, as the rest: never identity)."""
        frames = {} if self.frames is None else {"frames": self.frames}
        facet: dict[str, Any] = {
            "shape": f"{self.height}x{self.width}",
            **frames,
            "text_len": self.text_len,
            "batch": self.batch,
            "guidance": list(guidance),
        }
        facet |= {name: r.to_json() for name, r in self.ranges}
        if self.frames is None or temporal is None:
            return facet
        declared = dict(self.ranges).get("frames") or (self.frames,)
        pixels = temporal.pixels(declared)
        return facet | {"pixel_frames": pixels.to_json() if isinstance(pixels, Range) else pixels[0]}


@dataclass(frozen=True)
class Target:
    id: TargetId
    family: Family
    module: Module
    graph_class: GraphClass
    skus: tuple[str, ...]

    @property
    def label(self) -> str:
        return self.id.label

    @property
    def device(self) -> str:
        return device_of(self.id.sm)

    @property
    def facet(self) -> dict[str, Any]:
        return self.graph_class.facet(self.module.envelope.guidance, self.module.temporal)


def graph_classes(module: Module) -> list[GraphClass]:
    env = module.envelope
    out = []
    for h, w in env.shapes:
        for f in _buckets(env.frames):
            for t in _buckets(env.text_lengths):
                for b in _buckets(env.batch_sizes):
                    dims = {"frames": f, "text_len": t, "batch": b}
                    name = "".join(f"-{LETTER[k]}{_text(v)}" for k, v in dims.items() if v is not None)
                    ranges = tuple((k, v) for k, v in dims.items() if isinstance(v, Range))
                    size = {k: v.traced if isinstance(v, Range) else v for k, v in dims.items()}
                    batch = size["batch"]
                    assert batch is not None  # a module always has a batch
                    out.append(
                        GraphClass(f"{h}x{w}{name}", h, w, size["text_len"], batch, size["frames"], ranges)
                    )
    return out


def _buckets(declared: Declared | None) -> tuple[int | Range | None, ...]:
    """A dimension's buckets: each declared value, the one range, or None when not declared."""
    if declared is None:
        return (None,)
    return (declared,) if isinstance(declared, Range) else declared


def _text(value: int | Range) -> str:
    return value.text if isinstance(value, Range) else str(value)


def expand(cg: Cgfile) -> list[Target]:
    """Every target the Cgfile declares, in declaration order."""
    targets = []
    for fam in cg.families.values():
        sms: dict[str, list[str]] = {}
        for sku in fam.skus:
            sms.setdefault(cg.skus[sku].sm, []).append(sku)
        for module in fam.modules.values():
            for gc in graph_classes(module):
                for layout in module.layouts or fam.layouts:
                    for sm, skus in sms.items():
                        tid = TargetId(fam.name, module.name, gc.name, layout, sm)
                        targets.append(Target(tid, fam, module, gc, tuple(skus)))
    return targets


def select(cg: Cgfile, targets: list[Target], selector: Selector) -> list[Target]:
    """Targets a selector names. A selector that names nothing is an error naming the closest
    existing values (a typo must not mint nothing and exit 0); only `//...` may select nothing."""
    sku_sm = {name: sku.sm for name, sku in cg.skus.items()}
    where: Where = {"file": str(cg.path), "field": "label"}
    if selector.path and selector.path[0] not in cg.families:
        raise UserError(
            f"no family '{selector.path[0]}' in the Cgfile{_closest(selector.path[0], cg.families)}", **where
        )
    if selector.layout and selector.layout not in cg.layouts:
        raise UserError(
            f"no layout '{selector.layout}' in the Cgfile{_closest(selector.layout, cg.layouts)} "
            f"(layouts: {', '.join(sorted(cg.layouts))})",
            **where,
        )
    known_sms = set(sku_sm.values())
    if selector.sm_or_sku and selector.sm_or_sku not in known_sms and selector.sm_or_sku not in sku_sm:
        raise UserError(
            f"'{selector.sm_or_sku}' is neither an sm nor a SKU of the Cgfile"
            f"{_closest(selector.sm_or_sku, [*known_sms, *sku_sm])} "
            f"(sms: {', '.join(sorted(known_sms))}; SKUs: {', '.join(sorted(sku_sm))})",
            **where,
        )
    chosen = [t for t in targets if selector.matches(t.id, sku_sm, t.skus)]
    if not chosen and (selector.path or selector.layout or selector.sm_or_sku):
        raise UserError(
            f"no target matches '{selector.text}': {_why_nothing(targets, selector, sku_sm)}", **where
        )
    return chosen


def _closest(word: str, known: Iterable[str]) -> str:
    """' (did you mean 'a' or 'b'?)', or '' when nothing is close."""
    close = difflib.get_close_matches(word, sorted(set(known)), n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def _why_nothing(targets: list[Target], selector: Selector, sku_sm: dict[str, str]) -> str:
    """The first selector part that no target has together with the parts before it, with the
    values those targets do have and the closest of them."""
    kinds = ("family", "module", "graph class")
    pool = targets
    for depth, part in enumerate(selector.path):
        values = {(t.id.family, t.id.module, t.id.graph_class)[depth] for t in pool}
        if part not in values:
            scope = "//" + "/".join(selector.path[:depth]) if depth else "the Cgfile"
            return _missing(kinds[depth], part, scope, values)
        pool = [t for t in pool if (t.id.family, t.id.module, t.id.graph_class)[depth] == part]
    scope = "//" + "/".join(selector.path) if selector.path else "the Cgfile"
    if selector.layout is not None:
        values = {t.id.layout for t in pool}
        if selector.layout not in values:
            return _missing("layout", selector.layout, scope, values)
        pool = [t for t in pool if t.id.layout == selector.layout]
        scope += f"@{selector.layout}"
    wanted = selector.sm_or_sku or ""
    if wanted in sku_sm and wanted not in sku_sm.values():
        return _missing("SKU", wanted, scope, {s for t in pool for s in t.skus})
    return _missing("sm", wanted, scope, {t.id.sm for t in pool})


def _missing(kind: str, value: str, scope: str, values: set[str]) -> str:
    listed = ", ".join(sorted(values)) or "none"
    plural = "graph classes" if kind == "graph class" else f"{kind}s"
    return f"{scope} has no {kind} '{value}'{_closest(value, values)}; its {plural}: {listed}"
