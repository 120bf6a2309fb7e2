"""Labels and selectors: `//family/module/graph-class@layout:sm`.

A canonical label names exactly one target. A selector drops parts from either side and the parts
compose: `//flux2-klein:sm_120`, `//...`, `@bf16`, `:cpu`, `:rtx5090` (a SKU name stands for its
sm). Matching is structural on parsed parts; labels are never matched as strings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cgbuild.core.errors import UserError

_PART = r"[a-z0-9][a-z0-9._-]*"
ATTRIBUTE_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
"""A pipeline attribute a module serves (`transformer`, `vae.decode`): the Cgfile's `serves`
and the serving manifest's, one pattern."""
_SELECTOR = re.compile(
    rf"(?://(?P<path>\.\.\.|{_PART}(?:/{_PART}){{0,2}}(?:/\.\.\.)?))?"
    rf"(?:@(?P<layout>{_PART}))?(?::(?P<sm>{_PART}))?"
)


@dataclass(frozen=True)
class TargetId:
    family: str
    module: str
    graph_class: str
    layout: str
    sm: str

    @property
    def label(self) -> str:
        return f"//{self.family}/{self.module}/{self.graph_class}@{self.layout}:{self.sm}"


@dataclass(frozen=True)
class Selector:
    text: str
    path: tuple[str, ...]  # family, module, graph class — a prefix
    layout: str | None
    sm_or_sku: str | None

    def matches(self, t: TargetId, sku_sm: dict[str, str], target_skus: tuple[str, ...]) -> bool:
        parts = (t.family, t.module, t.graph_class)
        if self.path != parts[: len(self.path)]:
            return False
        if self.layout is not None and self.layout != t.layout:
            return False
        if self.sm_or_sku is None:
            return True
        if self.sm_or_sku in sku_sm and self.sm_or_sku not in sku_sm.values():
            return self.sm_or_sku in target_skus
        return self.sm_or_sku == t.sm


def parse_selector(text: str) -> Selector:
    """Parse a label or selector; raises UserError (exit 2) with the grammar on failure.

    The whole text must match: no surrounding whitespace, no final newline (`$` would allow one).
    """
    m = _SELECTOR.fullmatch(text)
    if not m or text in ("", "//"):
        raise UserError(
            f"bad label '{text}': expected //family[/module[/graph-class]][@layout][:sm-or-sku], "
            "'//...', '@layout' or ':sm' (names use [a-z0-9._-])",
            field="label",
        )
    path_text = m.group("path") or "..."
    path = tuple(p for p in path_text.split("/") if p != "...")
    return Selector(text, path, m.group("layout"), m.group("sm"))


def parse_label(text: str) -> TargetId:
    """Parse a canonical label (all five parts)."""
    sel = parse_selector(text)
    if len(sel.path) != 3 or sel.layout is None or sel.sm_or_sku is None:
        raise UserError(
            f"'{text}' is a selector, not a canonical label //family/module/graph-class@layout:sm",
            field="label",
        )
    return TargetId(*sel.path, sel.layout, sel.sm_or_sku)
