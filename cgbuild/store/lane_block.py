"""A program's lanes as frozen values: the axes it carries, how a choice reaches it, and the verdict.

The mint builds these (`Switches` from the built module's switch table, the `Verdict` from the fit
rule), seals them as the metadata's `lanes` block, and `cgbuild.store.sealed.parse` reads that
block back into a `LaneBlock` once the field checks of `cgbuild.store.metadata` passed. Adopt,
`inspect` and the mint's serve check then read attributes; the selector arithmetic that needs
torch stays in `cgbuild_rules.lanes`, which takes a `Switches`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cgbuild.core.codes import Code
from cgbuild.lanes import GIB, Refit, combinations, fits, required_bytes


@dataclass(frozen=True)
class LaneAxis:
    """One axis a program carries, its values in the entry's order (the first is the reference)
    and, in artifacts sealed before the selector, the FQN of its one-hot literal."""

    axis: str
    values: tuple[str, ...]
    fqn: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"axis": self.axis, "values": list(self.values)}
        if self.fqn:
            out["fqn"] = self.fqn
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> LaneAxis:
        return cls(str(raw["axis"]), tuple(str(v) for v in raw["values"]), raw.get("fqn") or None)


@dataclass(frozen=True)
class Selector:
    """The selector input: its name, the axes of its dimensions and the size that means value 0."""

    input: str
    axes: tuple[str, ...]
    base: int

    def to_json(self) -> dict[str, Any]:
        return {"input": self.input, "axes": list(self.axes), "base": self.base}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Selector:
        return cls(str(raw["input"]), tuple(str(a) for a in raw["axes"]), int(raw["base"]))


@dataclass(frozen=True)
class Switches:
    """The lane axes a program carries and how a lane choice is passed to it."""

    axes: tuple[LaneAxis, ...]
    selector: Selector | None = None

    @classmethod
    def selected(cls, axes: Sequence[LaneAxis], input_name: str, base: int) -> Switches:
        """A traced program's table: every axis of two or more values is a selector dimension
        (by name, sorted); with none, the program takes no selector."""
        dims = tuple(sorted(a.axis for a in axes if len(a.values) > 1))
        return cls(tuple(axes), Selector(input_name, dims, base) if dims else None)

    @property
    def names(self) -> list[str]:
        return [a.axis for a in self.axes]

    def values(self, axis: str) -> tuple[str, ...]:
        return next(a.values for a in self.axes if a.axis == axis)

    def carried(self) -> list[str]:
        """Every lane the program carries, `<a>+<b>` in axis order."""
        return combinations([(a.axis, a.values) for a in self.axes])

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"axes": [a.to_json() for a in self.axes]}
        if self.selector is not None:
            out["selector"] = self.selector.to_json()
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Switches:
        selector = raw.get("selector")
        return cls(
            tuple(LaneAxis.from_json(r) for r in raw.get("axes") or ()),
            Selector.from_json(selector) if selector else None,
        )


@dataclass(frozen=True)
class Verdict:
    """The fit rule's sealed choice: the winner, the term that bound it, the recorded (rounded)
    peaks and the order adopt walks where the winner does not fit. `doc` keeps the whole sealed
    verdict (its margin, allowance and SKU) for people and `inspect --json`."""

    winner: str
    binding: str | None
    peaks: Mapping[str, int]
    fallback: tuple[str, ...]
    doc: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Verdict:
        peaks = {str(k): int(v) for k, v in (raw.get("peaks") or {}).items()}
        binding = raw.get("binding")
        fallback = tuple(str(v) for v in raw.get("fallback") or ())
        return cls(str(raw["winner"]), str(binding) if binding else None, peaks, fallback, raw)

    def refit(self, memory_bytes: int) -> Refit:
        """Re-apply the fit to THIS device on the recorded (rounded-up) peaks; never re-benchmarks."""
        winner, peaks = self.winner, self.peaks
        mem = f"{memory_bytes / GIB:.1f} GiB"
        if not peaks:
            return Refit(
                winner,
                Code.LANE_UNVERIFIED,
                f"{winner}: the artifact records no measured peaks ({self.binding})",
            )
        need = required_bytes(peaks[winner])
        if need <= memory_bytes:
            return Refit(winner, Code.LANE_ADOPTED, f"{winner} needs {need / GIB:.1f} GiB of {mem}")
        for lane in self.fallback:
            if lane != winner and lane in peaks and fits(peaks[lane], memory_bytes):
                return Refit(
                    lane,
                    Code.LANE_REFIT,
                    f"{winner} needs {need / GIB:.1f} GiB, more than {mem}; "
                    f"{lane} needs {required_bytes(peaks[lane]) / GIB:.1f} GiB",
                )
        order = list(self.fallback or peaks)
        smallest = min(
            peaks, key=lambda lane: (peaks[lane], order.index(lane) if lane in order else len(order))
        )
        return Refit(
            smallest,
            Code.LANE_REFIT_NO_FIT,
            f"no recorded lane fits {mem}; {smallest} has the smallest peak "
            f"({peaks[smallest] / GIB:.2f} GiB recorded)",
        )


@dataclass(frozen=True)
class LaneBlock:
    """The sealed `lanes` block of an artifact that carries lane axes."""

    switches: Switches
    verdict: Verdict
    excluded: Mapping[str, str]
    """`axis.value` → why a declared value is not in the program (not buildable, numerics)."""

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | None) -> LaneBlock | None:
        """The block as checked by `cgbuild.store.metadata`; None when it carries no axis."""
        if not raw or not raw.get("axes"):
            return None
        excluded = {str(k): str(v) for k, v in (raw.get("excluded") or {}).items()}
        return cls(Switches.from_json(raw), Verdict.from_json(raw["verdict"]), excluded)
