"""Kernel lanes: what a program carries, what a mint measures, and the fit rule that picks one.

A lane is a runtime kernel choice (`linear=baseline|chunked`). It is NOT a key axis: one sealed
artifact carries every buildable implementation and the choice is bound at adopt, so keys stay
computable at plan time. This module is the engine's half, pure and torch-free:

- `LaneTable` / `read_lane_table`: the implementations an entry provides and what each needs
  (device type, triton, a minimum sm), read from the entry's literal `LANES` table WITHOUT
  importing it, so the Cgfile can be validated (file:line:field) and a warm plan never pays for
  torch.
- `program_lanes`: the values compiled into one target's program: declared AND buildable on its
  sm with its toolchain (plan-time facts only, so the graph digest stays plan-time).
- `candidates`: the combinations a mint benchmarks: the program's values that also passed the
  numerics self-check against the axis's reference, combined as `<a>+<b>` in axis declaration
  order. An axis with one such value adds none; fewer than two combinations means no benchmark.
- `decide` / `Verdict.refit`: the fit-constrained speed rule at mint (on measured peaks) and its
  re-fit at adopt (on the recorded peaks, rounded up: stricter, never looser).
- `Switches`, `Verdict`, `LaneBlock`: a program's lanes as frozen values, the axes it carries, how a
  choice reaches it (the selector input, or one-hot literals in artifacts sealed before) and the
  sealed verdict. The mint builds them and seals their JSON; `cgbuild.store.sealed.parse` reads the
  `lanes` block back into a `LaneBlock` once `cgbuild.store.metadata` checked its fields; the
  selector arithmetic that needs torch is `cgbuild_rules.lanes`'s, over a `Switches`.

Numbers are integers throughout (bytes, nanoseconds, percents): the verdict lands in sealed
metadata, whose identity blocks refuse floats, and integer comparisons cannot drift.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cgbuild.core.codes import Code
from cgbuild.core.errors import UserError
from cgbuild.core.fields import each, natural, need, obj, string
from cgbuild.core.literal import read_entry_literal
from cgbuild.core.platform import device_of, sm_number

LANES_SCHEMA = "cgbuild.lanes/2"
"""/2: the lane choice is the selector input's sizes (`selector`); /1: a one-hot literal per axis (`fqn`)."""
RULE = "fit-constrained-speed/1"
GIB = 1 << 30
QUANTUM = 256 << 20
"""Recorded peaks are rounded UP to this: two mints of one key then record the same peaks."""
ALLOWANCE_PERCENT = 120
"""Required memory is peak × 1.20 (activation spikes, resolution variance) …"""
ALLOWANCE_BYTES = GIB
"""… + 1 GiB (allocator fragmentation, runtime context)."""
TIE_BAND_PERCENT = 5
"""Runners-up within 5% of the fastest fitting lane tie with it; the smallest peak wins the tie."""
TABLE_NAME = "LANES"
NEED_KEYS = ("device", "triton", "min_sm")
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


@dataclass(frozen=True)
class Needs:
    """What one implementation needs to be compiled into a target's program."""

    device: str | None = None
    """`cuda` or `cpu`; None runs on either."""
    triton: bool = False
    """The target platform's toolchain must carry triton."""
    min_sm: int | None = None
    """Lowest CUDA architecture (90 for sm_90); implies a CUDA device."""

    def refusal(self, sm: str, triton: bool) -> str | None:
        """Why this implementation cannot be built for `sm` with this toolchain, or None."""
        if self.device is not None and self.device != device_of(sm):
            return f"needs a {self.device} device"
        if self.min_sm is not None:
            number = sm_number(sm)
            if number is None or number < self.min_sm:
                return f"needs sm_{self.min_sm} or newer"
        if self.triton and not triton:
            return "needs triton in the toolchain"
        return None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.device is not None:
            out["device"] = self.device
        if self.triton:
            out["triton"] = True
        if self.min_sm is not None:
            out["min_sm"] = self.min_sm
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Needs:
        return cls(raw.get("device"), bool(raw.get("triton", False)), raw.get("min_sm"))


@dataclass(frozen=True)
class LaneTable:
    """An entry's lanes: axis → value → needs, in the entry's own order.

    The first value of an axis is its reference implementation: the baseline every other value's
    numerics are checked against, and index 0 of the compiled switch.
    """

    file: str
    line: int
    axes: dict[str, dict[str, Needs]] = field(default_factory=dict)


def _needs(raw: Any, where: str, fail: Any) -> Needs:
    if not isinstance(raw, dict):
        raise fail(f"{where}: expected a dict of needs, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(NEED_KEYS))
    if unknown:
        raise fail(f"{where}: unknown need {unknown[0]!r} (known: {', '.join(NEED_KEYS)})")
    device = raw.get("device")
    if device not in (None, "cpu", "cuda"):
        raise fail(f"{where}.device: expected 'cpu' or 'cuda', got {device!r}")
    triton = raw.get("triton", False)
    if not isinstance(triton, bool):
        raise fail(f"{where}.triton: expected a boolean, got {triton!r}")
    min_sm = raw.get("min_sm")
    if min_sm is not None and (not isinstance(min_sm, int) or isinstance(min_sm, bool) or min_sm <= 0):
        raise fail(f"{where}.min_sm: expected a positive integer (90 for sm_90), got {min_sm!r}")
    if min_sm is not None and device == "cpu":
        raise fail(f"{where}: min_sm needs a cuda device, but device is 'cpu'")
    return Needs(device, triton, min_sm)


def _lane_table(raw: Any, line: int, file: str) -> LaneTable:
    """The entry's `LANES` literal (read at `file:line`) as a table, checked by field."""

    def fail(message: str) -> UserError:
        return UserError(message, file=file, line=line, field=TABLE_NAME)

    if not isinstance(raw, dict) or not raw:
        raise fail(f"{TABLE_NAME} must be a non-empty dict: axis -> value -> needs")
    axes: dict[str, dict[str, Needs]] = {}
    for axis, values in raw.items():
        if not isinstance(axis, str) or not _NAME.fullmatch(axis):
            raise fail(f"bad axis name {axis!r}: names use [a-z0-9._-]")
        if not isinstance(values, dict) or not values:
            raise fail(f"{TABLE_NAME}[{axis!r}] must be a non-empty dict: value -> needs")
        axes[axis] = {}
        for value, needs in values.items():
            if not isinstance(value, str) or not _NAME.fullmatch(value):
                raise fail(f"{TABLE_NAME}[{axis!r}]: bad value name {value!r}: names use [a-z0-9._-]")
            axes[axis][value] = _needs(needs, f"{TABLE_NAME}[{axis!r}][{value!r}]", fail)
    return LaneTable(file, line, axes)


def read_lane_table(root: Path, entry: str) -> LaneTable | None:
    """Read an entry's lane table from its source under `root`; None when it has none."""
    found = read_entry_literal(root, entry, TABLE_NAME)
    return None if found is None else _lane_table(*found)


# ---- what a target's program carries, and what its mint benchmarks --------------------------------
Axes = Sequence[tuple[str, Sequence[str]]]
"""Declared lane axes in declaration order: (axis, declared values)."""
NeedsTable = Mapping[str, Mapping[str, Needs]]
"""axis → value → needs, in the entry's order."""


def program_lanes(declared: Axes, table: NeedsTable, sm: str, triton: bool) -> dict[str, list[str]]:
    """axis → the values compiled into this target's program, in the entry's order.

    A value is compiled in when it is declared and buildable here (device, sm, triton). The
    entry's order, not the declaration order, fixes the program: reordering a Cgfile's lanes
    then moves no graph digest. Adding or removing a buildable value is a graph change.
    """
    out: dict[str, list[str]] = {}
    for axis, values in declared:
        wanted = set(values)
        out[axis] = [
            v for v, needs in table[axis].items() if v in wanted and needs.refusal(sm, triton) is None
        ]
    return out


def exclusions(declared: Axes, table: NeedsTable, sm: str, triton: bool) -> dict[str, str]:
    """`axis.value` → why a declared value is not compiled into this target's program."""
    out: dict[str, str] = {}
    for axis, values in declared:
        for v in values:
            why = table[axis][v].refusal(sm, triton)
            if why is not None:
                out[f"{axis}.{v}"] = f"not-buildable: {why}"
    return out


def combinations(axes: Sequence[tuple[str, Sequence[str]]]) -> list[str]:
    """Every combination named `<a>+<b>` in axis order (values cannot contain `+`)."""
    if not axes:
        return []
    return ["+".join(combo) for combo in itertools.product(*(values for _, values in axes))]


def candidates(
    declared: Axes,
    table: NeedsTable,
    sm: str,
    triton: bool,
    numerics: Mapping[str, Mapping[str, bool]] | None = None,
) -> list[str]:
    """The combinations a mint benchmarks, from capability checks only; [] means no benchmark.

    Capability: buildable for `sm` with(out) triton, and (when given) a passed numerics
    self-check against the axis's reference. An axis with one surviving value multiplies
    nothing; fewer than two combinations is no choice at all.
    """
    program = program_lanes(declared, table, sm, triton)
    numerics = numerics or {}
    surviving = [
        (axis, [v for v in program[axis] if numerics.get(axis, {}).get(v, True)]) for axis, _ in declared
    ]
    combos = combinations(surviving)
    return combos if len(combos) >= 2 else []


def split(lane: str, axes: Sequence[str]) -> dict[str, str]:
    """`baseline+packed` → {linear: baseline, modulation: packed} for axes in declaration order."""
    parts = lane.split("+")
    if len(parts) != len(axes):
        raise ValueError(f"lane {lane!r} names {len(parts)} values for {len(axes)} axes {list(axes)}")
    return dict(zip(axes, parts, strict=True))


# ---- the fit rule ------------------------------------------------------------------------------
def quantize(peak_bytes: int) -> int:
    """A peak rounded UP to the recording quantum (256 MiB): what metadata records."""
    return -(-peak_bytes // QUANTUM) * QUANTUM


def required_bytes(peak_bytes: int) -> int:
    """peak × 1.20 + 1 GiB, rounded up to a byte."""
    return -(-peak_bytes * ALLOWANCE_PERCENT // 100) + ALLOWANCE_BYTES


def fits(peak_bytes: int, memory_bytes: int) -> bool:
    return required_bytes(peak_bytes) <= memory_bytes


def in_tie_band(median_ns: int, fastest_ns: int) -> bool:
    """Within 5% of the fastest (integer arithmetic: no float can sit on the edge)."""
    return (median_ns - fastest_ns) * 100 <= TIE_BAND_PERCENT * fastest_ns


@dataclass(frozen=True)
class Measured:
    """One candidate's measurement: median of the timed calls and peak bytes."""

    lane: str
    median_ns: int
    peak_bytes: int


@dataclass(frozen=True)
class Choice:
    """The rule's pick among some candidates, and which term of the rule bound it."""

    lane: str
    binding: str
    """`speed` (the fastest fitting lane, memory did not bind), `tie-peak` (a slower lane within
    the tie band won on its smaller peak), `fit` (a faster lane did not fit), `no-fit` (nothing
    fits: smallest peak)."""


def choose(measured: Sequence[Measured], memory_bytes: int) -> Choice:
    """Fit-constrained speed: among candidates that fit, the fastest; runners-up within 5% form a
    tie class won by the smallest peak; nothing fits → the smallest peak.

    Fit is tested on the peaks as given (measured at mint). Peaks are COMPARED at the recording
    quantum, then by candidate order, so noise below 256 MiB never decides a tie.
    """
    if not measured:
        raise ValueError("no candidates to choose from")
    order = {m.lane: i for i, m in enumerate(measured)}

    def by_peak(m: Measured) -> tuple[int, int]:
        return quantize(m.peak_bytes), order[m.lane]

    fitting = [m for m in measured if fits(m.peak_bytes, memory_bytes)]
    if not fitting:
        return Choice(min(measured, key=by_peak).lane, Code.NO_FIT)
    fastest = min(fitting, key=lambda m: (m.median_ns, order[m.lane]))
    tied = [m for m in fitting if in_tie_band(m.median_ns, fastest.median_ns)]
    winner = min(tied, key=by_peak) if len(tied) > 1 else fastest
    overall = min(measured, key=lambda m: (m.median_ns, order[m.lane]))
    if not fits(overall.peak_bytes, memory_bytes) and overall.median_ns < winner.median_ns:
        binding = "fit"
    elif winner is not fastest:
        binding = Code.TIE_PEAK
    else:
        binding = "speed"
    return Choice(winner.lane, binding)


def decide(measured: Sequence[Measured], sku: str, memory_bytes: int) -> dict[str, Any]:
    """The sealed verdict: discrete facts only, so two mints of one key agree.

    `fallback` is the order adopt walks on a card where the winner does not fit: successive
    winners of the rule on the remaining candidates. `margin` holds the tie band and the winner's
    headroom on the fit SKU (memory − required, from the ROUNDED peak).
    """
    rest = list(measured)
    first = choose(rest, memory_bytes)
    fallback: list[str] = []
    while rest:
        pick = choose(rest, memory_bytes).lane
        fallback.append(pick)
        rest = [m for m in rest if m.lane != pick]
    peaks = {m.lane: quantize(m.peak_bytes) for m in measured}
    return {
        "rule": RULE,
        "winner": first.lane,
        "binding": first.binding,
        "margin": {
            "tie_band_percent": TIE_BAND_PERCENT,
            "headroom_bytes": memory_bytes - required_bytes(peaks[first.lane]),
        },
        "allowance": {"percent": ALLOWANCE_PERCENT, "bytes": ALLOWANCE_BYTES},
        "sku": {"name": sku, "memory_bytes": memory_bytes},
        "candidates": [m.lane for m in measured],
        "peaks": peaks,
        "quantum_bytes": QUANTUM,
        "fallback": fallback,
    }


def unmeasured(lane: str, why: str) -> dict[str, Any]:
    """The verdict when there is nothing to choose: the one lane, no peaks (adopt: unverified)."""
    return {
        "rule": RULE,
        "winner": lane,
        "binding": why,
        "candidates": [],
        "peaks": {},
        "fallback": [lane],
    }


@dataclass(frozen=True)
class Refit:
    """Adopt's lane for this device and why: a typed `code` and a sentence."""

    lane: str
    code: Code
    """`lane-adopted` (the recorded winner fits), `lane-refit` (the next recorded lane in fallback
    order that fits), `lane-refit-no-fit` (nothing fits: smallest recorded peak),
    `lane-unverified` (no recorded peaks: the recorded winner, unchecked), `lane-pinned`."""
    detail: str


def has_triton(components: Mapping[str, Any]) -> bool:
    """Whether a platform's toolchain components carry triton (CPU toolchains never do)."""
    comp = components.get("triton")
    return isinstance(comp, Mapping) and comp.get("absent") is not True


# ---- a program's lanes as values ----------------------------------------------------------------
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
    def parse(cls, raw: Any, where: str) -> Switches:
        """The table of a JSON document anyone could have written (sealed metadata, a stage's
        answer): `Malformed` naming the first field that is wrong. Each axis of two or more values
        is switched one way: by the selector input (what a trace makes) or by its one-hot literal
        (artifacts sealed before), never neither (adopt would bind nothing and the program run its
        default) and never both."""
        block = obj(raw, where)
        rows = each(block.get("axes"), f"{where}.axes", _axis_row)
        selector = obj(block.get("selector"), f"{where}.selector", optional=True)
        dims: list[str] = []
        if selector:
            string(selector.get("input"), f"{where}.selector.input")
            each(selector.get("axes"), f"{where}.selector.axes", string, optional=False)
            natural(selector.get("base"), f"{where}.selector.base")
            dims = selector["axes"]
            need(len(set(dims)) == len(dims), f"{where}.selector.axes", "repeat an axis")
        for i, row in enumerate(rows):
            switched = len(row["values"]) > 1
            ways = int(bool(row.get("fqn"))) + int(row["axis"] in dims)
            need(
                ways == int(switched), f"{where}.axes[{i}]", "not switched by exactly one selector or one-hot"
            )
        unknown = sorted(set(dims) - {row["axis"] for row in rows})
        need(not unknown, f"{where}.selector.axes", f"names {unknown[0] if unknown else ''!r}, not an axis")
        return cls.from_json(block)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Switches:
        """The table of a document already checked (`parse`), or written by this process."""
        selector = raw.get("selector")
        return cls(
            tuple(LaneAxis.from_json(r) for r in raw.get("axes") or ()),
            Selector.from_json(selector) if selector else None,
        )


def _axis_row(value: Any, where: str) -> dict[str, Any]:
    row = obj(value, where)
    string(row.get("axis"), f"{where}.axis")
    each(row.get("values"), f"{where}.values", string, optional=False)
    need(bool(row["values"]), f"{where}.values", "empty")
    need(row.get("fqn") is None or isinstance(row["fqn"], str), f"{where}.fqn", "not a string")
    return row


@dataclass(frozen=True)
class Verdict:
    """The fit rule's sealed choice as adopt reads it: the winner, the term that bound it, the
    recorded (rounded) peaks and the order adopt walks where the winner does not fit. The rest of
    the sealed verdict (margin, allowance, SKU) is for people: `inspect --json` shows the document."""

    winner: str
    binding: str | None
    peaks: Mapping[str, int]
    fallback: tuple[str, ...]

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Verdict:
        peaks = {str(k): int(v) for k, v in (raw.get("peaks") or {}).items()}
        binding = raw.get("binding")
        fallback = tuple(str(v) for v in raw.get("fallback") or ())
        return cls(str(raw["winner"]), str(binding) if binding else None, peaks, fallback)

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
