"""Declared ranges: a dynamic dimension of a module's envelope, `frames = {min = 2, max = 4}`.

A dimension (frames, text length, batch) is declared either as an array of values, one static
graph class each, or as one range, one graph class whose single program serves every value in
it. The range is the Cgfile's, not only the entry's: the graph class names it (`8x8-f2..4-t4-b1`),
the entry must export it as a `torch.export.Dim` of the same name and bounds (docs/entry.md), and
the mint checks the artifact at both ends and at one value inside. A declaration the entry could
ignore would be a label that lies, so every check refuses rather than let one pass unverified.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cgbuild.config.reader import Reader, is_int, is_int_list

MAX_DIM = 1 << 20
"""Bound on every envelope integer (height, width, text length, batch, frames): a typo, not a bucket."""

SPEC_NAME = {"frames": "frames", "text_lengths": "text_len", "batch_sizes": "batch"}
"""Cgfile key → the spec key the entry reads it under, and the name of its `torch.export.Dim`."""
LETTER = {"frames": "f", "text_len": "t", "batch": "b"}
"""Spec key → its letter in a graph class name (`-f9`, `-t512`, `-b1`)."""
FIELD = {spec: key for key, spec in SPEC_NAME.items()}
"""Spec key → the Cgfile key that declares it (where a refusal points)."""


@dataclass(frozen=True)
class Range:
    """A declared dynamic dimension: every integer in [min, max], min < max."""

    min: int
    max: int

    @property
    def text(self) -> str:
        """The range as a graph class name writes it: `2..4`."""
        return f"{self.min}..{self.max}"

    @property
    def traced(self) -> int:
        """The size the program is traced at: the middle, and at least 2 (torch.export turns a
        size-1 example into a constant, which would specialize the range away)."""
        return min(self.max, max(2, (self.min + self.max) // 2))

    @property
    def points(self) -> tuple[int, ...]:
        """Where a mint checks the artifact against eager: both ends and the traced size, which
        lies strictly inside whenever the range holds a value between its ends."""
        return tuple(sorted({self.min, self.traced, self.max}))

    def to_json(self) -> dict[str, int]:
        return {"min": self.min, "max": self.max}

    @classmethod
    def from_json(cls, value: Any) -> Range | None:
        """The range a job or a facet states, or None when `value` is not one."""
        if not isinstance(value, dict) or set(value) != {"min", "max"}:
            return None
        lo, hi = value["min"], value["max"]
        if not (is_int(lo) and is_int(hi) and 0 < lo < hi <= MAX_DIM):
            return None
        return cls(lo, hi)


Declared = tuple[int, ...] | Range
"""A dimension as the Cgfile declares it: its values (one graph class each), or one range."""


def dimension(r: Reader, t: dict[str, Any], where: tuple[str, ...], key: str, what: str) -> Declared | None:
    """`t[key]` read as an array of `what` or one range table; None when absent. The values'
    own checks (empty, duplicates, bounds) are the caller's; a range is checked whole here."""
    if key not in t:
        return None
    value = t[key]
    if isinstance(value, list) and any(isinstance(v, dict) for v in value):
        raise r.fail(
            f"'{key}' is an array of values or one range {{min = .., max = ..}}, not both", *where, key
        )
    if not isinstance(value, dict):
        values = r.get(t, where, key, is_int_list, f"an array of {what} or a range {{min = .., max = ..}}")
        return tuple(values)
    at = (*where, key)
    r.table(value, at, {"min", "max"})
    lo = r.get(value, at, "min", is_int, "an integer", required=True)
    hi = r.get(value, at, "max", is_int, "an integer", required=True)
    r.positive(lo, MAX_DIM, *at, "min")
    r.positive(hi, MAX_DIM, *at, "max")
    if lo > hi:
        raise r.fail(f"min {lo} > max {hi}: a range runs from its min up to its max", *at)
    if lo == hi:
        raise r.fail(f"a range of one value ({lo}): declare it as {key} = [{lo}]", *at)
    return Range(lo, hi)
