"""Targets: family × module × graph class × layout × sm, expanded from a Cgfile.

A graph class is one static bucket of a module's envelope (shape × text length × batch); its
name is derived, e.g. `1024x1024-t512-b1`. Guidance values never change the program, so they are
part of every facet but of no graph class name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cgbuild.config.cgfile import Cgfile, Family, Module
from cgbuild.config.labels import Selector, TargetId
from cgbuild.core.errors import UserError
from cgbuild.core.platform import device_of


@dataclass(frozen=True)
class GraphClass:
    name: str
    height: int
    width: int
    text_len: int | None
    batch: int

    def facet(self, guidance: tuple[str, ...]) -> dict[str, Any]:
        return {
            "shape": f"{self.height}x{self.width}",
            "text_len": self.text_len,
            "batch": self.batch,
            "guidance": list(guidance),
        }


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
        return self.graph_class.facet(self.module.envelope.guidance)


def graph_classes(module: Module) -> list[GraphClass]:
    env = module.envelope
    out = []
    for h, w in env.shapes:
        for t in env.text_lengths or (None,):
            for b in env.batch_sizes:
                text = "" if t is None else f"-t{t}"
                out.append(GraphClass(f"{h}x{w}{text}-b{b}", h, w, t, b))
    return out


def expand(cg: Cgfile) -> list[Target]:
    """Every target the Cgfile declares, in declaration order."""
    targets = []
    for fam in cg.families.values():
        sms: dict[str, list[str]] = {}
        for sku in fam.skus:
            sms.setdefault(cg.skus[sku].sm, []).append(sku)
        for module in fam.modules.values():
            for gc in graph_classes(module):
                for layout in fam.layouts:
                    for sm, skus in sms.items():
                        tid = TargetId(fam.name, module.name, gc.name, layout, sm)
                        targets.append(Target(tid, fam, module, gc, tuple(skus)))
    return targets


def select(cg: Cgfile, targets: list[Target], selector: Selector) -> list[Target]:
    """Targets a selector names; an unknown family, layout or sm/SKU is an error, not an empty set."""
    sku_sm = {name: sku.sm for name, sku in cg.skus.items()}
    if selector.path and selector.path[0] not in cg.families:
        raise UserError(f"no family '{selector.path[0]}' in the Cgfile", file=str(cg.path), field="label")
    if selector.layout and selector.layout not in cg.layouts:
        raise UserError(f"no layout '{selector.layout}' in the Cgfile", file=str(cg.path), field="label")
    known_sms = set(sku_sm.values())
    if selector.sm_or_sku and selector.sm_or_sku not in known_sms and selector.sm_or_sku not in sku_sm:
        raise UserError(
            f"'{selector.sm_or_sku}' is neither an sm nor a SKU of the Cgfile "
            f"(sms: {', '.join(sorted(known_sms))}; SKUs: {', '.join(sorted(sku_sm))})",
            file=str(cg.path),
            field="label",
        )
    return [t for t in targets if selector.matches(t.id, sku_sm, t.skus)]
