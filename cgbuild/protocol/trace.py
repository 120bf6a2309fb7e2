"""The trace request: what the engine asks `python -m cgbuild_rules.trace` to trace.

The engine builds jobs here (`job_for`) and the rule parses them here (`TraceJob.from_json`),
so the two sides cannot disagree on a field. The job's JSON form is also a trace input (the
spec and quant rule are hashed into the trace cache's inputs), so `to_json` must keep its shape:
moving it re-traces every target (a spurious re-trace, stopped by early cutoff, never a wrong key).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cgbuild import lanes
from cgbuild.config.dims import LETTER, Range
from cgbuild.core.platform import CPU, CUDA
from cgbuild.identity.quantrule import QUANT_RULES

if TYPE_CHECKING:
    from cgbuild.config.cgfile import Cgfile
    from cgbuild.config.targets import Target

REQUEST_SCHEMA = "cgbuild.trace-request/1"
SPEC_KEYS = ("family", "module", "graph_class", "height", "width", "text_len", "batch", "dtype", "device")
DEVICES = (CPU, CUDA)
FACT_KEYS = ("graph_digest", "contract", "topology", "nodes", "torch")
"""What a trace reports of a job and the trace cache keeps (the trace rule's and a held mint's)."""


class BadJob(ValueError):
    """A job that is not what this protocol says; the rule answers it `trace-failed`."""


@dataclass(frozen=True)
class TraceJob:
    """One module × graph class × layout to trace: the entry protocol's spec (docs/architecture.md).

    `spec.lanes` is present only for a family that declares lanes (the values compiled into this
    program); the entry always sees `spec["lanes"]`, `{}` without lanes. `id` names the job in a
    request; it is not part of what is traced.
    """

    entry: str
    root: str
    config: Mapping[str, Any]
    spec: Mapping[str, Any]
    quant: str
    id: str | None = field(default=None, compare=False)

    def with_id(self, job_id: str) -> TraceJob:
        return TraceJob(self.entry, self.root, self.config, self.spec, self.quant, job_id)

    def to_json(self) -> dict[str, Any]:
        out = {
            "entry": self.entry,
            "root": self.root,
            "config": dict(self.config),
            "spec": dict(self.spec),
            "quant": self.quant,
        }
        return out if self.id is None else {**out, "id": self.id}

    @classmethod
    def from_json(cls, raw: Any) -> TraceJob:
        """Validate one job; BadJob names what is wrong."""
        if not isinstance(raw, Mapping):
            raise BadJob("bad job: not an object")
        spec = raw.get("spec")
        if not isinstance(spec, Mapping):
            raise BadJob("bad job: missing spec")
        missing = [k for k in ("id", "entry", "root", "quant") if k not in raw]
        missing += [f"spec.{k}" for k in SPEC_KEYS if k not in spec]
        if missing:
            raise BadJob(f"bad job: missing {', '.join(missing)}")
        config = raw.get("config") or {}
        if not isinstance(config, Mapping):
            raise BadJob("bad job: config must be an object")
        program = spec.get("lanes") or {}
        if not isinstance(program, Mapping) or not all(
            isinstance(v, list) and v and all(isinstance(x, str) for x in v) for v in program.values()
        ):
            raise BadJob("bad job: spec.lanes must map each axis to a non-empty list of values")
        frames = spec.get("frames")
        if frames is not None and (type(frames) is not int or frames < 1):
            raise BadJob(f"bad job: spec.frames {frames!r} is not a positive frame count")
        _check_ranges(spec)
        if spec["device"] not in DEVICES:
            raise BadJob(f"bad job: device {spec['device']!r} not in {list(DEVICES)}")
        for name in ("id", "entry", "root", "quant"):
            if not isinstance(raw[name], str):
                raise BadJob(f"bad job: {name} must be a string")
        return cls(raw["entry"], raw["root"], dict(config), dict(spec), raw["quant"], raw["id"])


def _check_ranges(spec: Mapping[str, Any]) -> None:
    """`spec.ranges`, present only for a module that declares one: each a dimension's range
    (`{"min": 2, "max": 4}`) holding the size the spec traces it at."""
    ranges = spec.get("ranges", {})
    if not isinstance(ranges, Mapping):
        raise BadJob("bad job: spec.ranges must map each dimension to its range")
    for name, value in ranges.items():
        declared = Range.from_json(value)
        if name not in LETTER or declared is None:
            raise BadJob(f"bad job: spec.ranges.{name} is not a range of {', '.join(LETTER)}")
        size = spec.get(name)
        if type(size) is not int or not declared.min <= size <= declared.max:
            raise BadJob(f"bad job: spec.{name} {size!r} is not inside its range {declared.text}")


def target_lanes(t: Target, quant: str, components: Mapping[str, Any] | None) -> dict[str, list[str]] | None:
    """The lane values compiled into a target's program (None: it carries no declared axis).

    Plan-time facts only (the sm, the layout's quant rule, whether the platform's toolchain
    carries triton), so the graph digest, and with it the key, stays computable before any mint
    (docs/lanes.md). A quant rule's axis reaches only targets of a layout with that rule.
    """
    axes = t.family.lanes_for(quant)
    if not axes:
        return None
    triton = lanes.has_triton(dict(components or {}))
    return lanes.program_lanes(axes, t.family.lane_table, t.id.sm, triton)


def job_for(cg: Cgfile, t: Target, components: Mapping[str, Any] | None = None) -> TraceJob:
    """The trace job of a target; the plan traces it and the mint re-derives its graph from it.

    `components` (the target platform's toolchain) decide which lane values are buildable.
    """
    lay = cg.layouts[t.id.layout]
    gc = t.graph_class
    spec: dict[str, Any] = {
        "family": t.id.family,
        "module": t.id.module,
        "graph_class": gc.name,
        "height": gc.height,
        "width": gc.width,
        "text_len": gc.text_len,
        "batch": gc.batch,
        "dtype": lay.dtype,
        "device": t.device,
    }
    if gc.frames is not None:  # a video module's: an image job's spec (a trace input) is unchanged
        spec["frames"] = gc.frames
    if gc.ranges:  # so is the spec of a module without a range
        spec["ranges"] = {name: r.to_json() for name, r in gc.ranges}
    program = target_lanes(t, lay.quant, components)
    if program is not None:
        spec["lanes"] = program
    return TraceJob(t.family.entry, str(cg.root), t.family.config, spec, QUANT_RULES[lay.quant].name)


def request(jobs: list[TraceJob]) -> dict[str, Any]:
    """One trace request: the jobs of one entry, answered one result line each."""
    return {"schema": REQUEST_SCHEMA, "jobs": [j.to_json() for j in jobs]}
