"""The mint worker's conversation with its stage children (`python -m cgbuild_rules.mint --stage NAME`).

One mechanism, the spawner's (`cgbuild.protocol.spawn`): the worker starts a stage with one
`StageStart` line on its stdin (the job, the stage's environment and, unless a hold started it,
the key's request) and keeps that stdin open (`Channel`); it hands each part its input as a `Go`
line once it has it (a hold's key request is known only at the compile's go). The stage answers
each part with one line on its protocol stream, the part's typed result (`Traced`, `Compiled`,
`Verified`, `Measured`, `Served`), or ends with a `MintFailed` that carries its phase. A stage
that ends without that line is typed by how it ended (`spawn.Ended`).

Every line is parsed here, at the process edge, into its frozen type; one that parses as none
is refused by name (`BadMessage`: the message and the field), never passed on as a dict. The
types are shared by the worker and its stages (`cgbuild_rules.mint`) and by the engine's own
serve check (`cgbuild verify --run`), which runs the `serve` stage alone.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Self

from cgbuild.core.codes import Code
from cgbuild.core.fields import Malformed, need, obj
from cgbuild.lanes import Switches
from cgbuild.protocol.contract import CallContract
from cgbuild.protocol.mint import BadRequest, MintFailed, MintRequest, Phase
from cgbuild.protocol.spawn import Talk, spawn
from cgbuild.protocol.trace import FACT_KEYS, BadJob, TraceJob


class BadMessage(ValueError):
    """A line between the worker and a stage that is not the message it must be."""


def _fields(cls: Any, raw: Any, what: str, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """`raw`'s fields for `cls`: an object with every required field and no unknown one (else
    BadMessage naming `what` and the field)."""
    if not isinstance(raw, Mapping):
        raise BadMessage(f"{what}: not a JSON object")
    known = {f.name for f in fields(cls)}
    required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
    missing = [k for k in required if k not in raw]
    if missing:
        raise BadMessage(f"{what}: missing {', '.join(missing)}")
    unknown = sorted(set(raw) - known - set(skip))
    if unknown:
        raise BadMessage(f"{what}: unknown field {unknown[0]!r}")
    return {k: raw[k] for k in raw if k in known}


@dataclass(frozen=True)
class StageEnv:
    """Where a stage works: the mint's work folder (its package, literals, temp files), the
    host compiler chosen for the compile (`CXX`), and the compile sandbox at its fixed path."""

    work: str
    cxx: str | None = None
    sandbox: str | None = None


@dataclass(frozen=True)
class Go:
    """A part's input, handed over once the worker has it: the key's request (`compile`,
    `verify`), the lanes to measure (`measure`), the sealed artifact (`serve`)."""

    part: str
    request: MintRequest | None = None
    candidates: tuple[str, ...] | None = None
    artifact: str | None = None

    INPUTS: ClassVar[Mapping[str, str]] = {
        "compile": "request",
        "verify": "request",
        "measure": "candidates",
        "serve": "artifact",
    }

    def to_json(self) -> dict[str, Any]:
        value = getattr(self, self.INPUTS[self.part])
        if isinstance(value, MintRequest):
            value = value.to_json()
        elif isinstance(value, tuple):
            value = list(value)
        return {"part": self.part, self.INPUTS[self.part]: value}

    @classmethod
    def from_json(cls, raw: Any) -> Go:
        kw = _fields(cls, raw, "go")
        part = kw["part"]
        if part not in cls.INPUTS or cls.INPUTS[part] not in kw or len(kw) != 2:
            raise BadMessage(f"go: part {part!r} takes exactly its input {cls.INPUTS.get(part)!r}")
        value = kw[cls.INPUTS[part]]
        if part in ("compile", "verify"):
            try:
                return cls(part, request=MintRequest.from_json(value))
            except BadRequest as e:
                raise BadMessage(f"go {part}: {e}") from None
        if part == "measure":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise BadMessage("go measure: candidates must be a list of lane names")
            return cls(part, candidates=tuple(value))
        if not isinstance(value, str):
            raise BadMessage("go serve: artifact must be a path")
        return cls(part, artifact=value)


@dataclass(frozen=True)
class StageStart:
    """A stage's first line: its job, its environment, the key's request (None for a hold's:
    it comes with the go) and, for the serve stage run alone, its one part's go."""

    job: TraceJob
    env: StageEnv
    request: MintRequest | None = None
    go: Go | None = None

    @property
    def held(self) -> bool:
        return self.request is None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"job": self.job.to_json(), "env": vars(self.env)}
        if self.request is not None:
            out["request"] = self.request.to_json()
        if self.go is not None:
            out["go"] = self.go.to_json()
        return out

    @classmethod
    def from_json(cls, raw: Any) -> StageStart:
        kw = _fields(cls, raw, "stage start")
        try:
            job = TraceJob.from_json(kw["job"])
            request = MintRequest.from_json(kw["request"]) if "request" in kw else None
        except (BadJob, BadRequest) as e:
            raise BadMessage(f"stage start: {e}") from None
        env = StageEnv(**_fields(StageEnv, kw["env"], "stage start env"))
        go = Go.from_json(kw["go"]) if "go" in kw else None
        return cls(job, env, request, go)


@dataclass(frozen=True)
class Answer:
    """A part's answer: `{"part", "ok": true, ...its fields}` on the stage's protocol stream."""

    PART: ClassVar[str]
    TYPED: ClassVar[Mapping[str, Any]] = {}
    """field → the frozen type its JSON parses into (`from_json(raw, where)`; `to_json()` back)."""

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update({name: out[name].to_json() for name in self.TYPED if out[name] is not None})
        return {"part": self.PART, "ok": True, **out}

    @classmethod
    def from_json(cls, raw: Any) -> Self:
        what = f"the {cls.PART} result"
        kw = _fields(cls, raw, what, skip=("part", "ok"))
        if raw.get("part") != cls.PART or raw.get("ok") is not True:
            raise BadMessage(f"{what}: part {raw.get('part')!r}, ok {raw.get('ok')!r}")
        optional = {f.name for f in fields(cls) if f.default is None}  # absent or null: None
        try:
            kw.update(
                {
                    n: typ.from_json(kw[n], n)
                    for n, typ in cls.TYPED.items()
                    if n in kw and not (kw[n] is None and n in optional)
                }
            )
        except Malformed as e:
            raise BadMessage(f"{what}: {e}") from None
        return cls(**kw)


@dataclass(frozen=True)
class AotiFacts:
    """What a compiled package needs of its host (sealed in the `host` block): the CPU ISA its
    host code was built for (AOTInductor's `AOTI_CPU_ISA`, '' when it records none) and the
    highest GLIBC/GLIBCXX/CXXABI versions its `.so` files require."""

    cpu_isa: str
    runtime: Mapping[str, str]

    def to_json(self) -> dict[str, Any]:
        return {"cpu_isa": self.cpu_isa, "runtime": dict(self.runtime)}

    @classmethod
    def from_json(cls, raw: Any, where: str = "aoti") -> AotiFacts:
        if not isinstance(raw, Mapping) or not isinstance(raw.get("cpu_isa"), str):
            raise Malformed(f"{where}.cpu_isa: not a string")
        runtime = raw.get("runtime")
        if not isinstance(runtime, Mapping) or not all(isinstance(v, str) for v in runtime.values()):
            raise Malformed(f"{where}.runtime: not a mapping of library to version")
        return cls(raw["cpu_isa"], dict(runtime))


@dataclass(frozen=True)
class Traced(Answer):
    """The compile stage's trace: the trace rule's facts (`FACT_KEYS`) and this machine's sm for
    the job's device (None: it has none, and a hold traced fake)."""

    graph_digest: str
    contract: CallContract
    topology: list[Any]
    nodes: int
    torch: str
    sm: str | None

    PART: ClassVar[str] = "trace"
    TYPED: ClassVar[Mapping[str, Any]] = {"contract": CallContract}

    def facts(self) -> dict[str, Any]:
        """What the engine takes from a hold's trace line (`{"traced": <this, as JSON>}`): the
        trace rule's result shape, as the plan and the trace cache read it."""
        out = {k: getattr(self, k) for k in (*FACT_KEYS, "sm")}
        return {"ok": True, **out, "contract": self.contract.to_json()}


@dataclass(frozen=True)
class Compiled(Answer):
    """The compile stage's result: the graph it re-derived and its call contract, the toolchain it
    probed, the policy applied, the package's constant table, layout block and host needs (all
    sealed), and the seconds its `export` and `compile` took (never sealed).

    The toolchain, policy, constant table, layout block and configuration record stay the JSON
    documents they are sealed as: the worker copies them into the metadata unread, and
    `cgbuild.store.sealed` types what a reader takes from them."""

    graph_digest: str
    contract: CallContract
    nodes: int
    module: Mapping[str, Any] | None
    toolchain: Mapping[str, Any]
    policy: Mapping[str, Any]
    constants: Mapping[str, Any]
    layout: Mapping[str, Any] | None
    aoti: AotiFacts
    torch: str
    forensics: Mapping[str, str]
    seconds: Mapping[str, float]

    PART: ClassVar[str] = "compile"
    TYPED: ClassVar[Mapping[str, Any]] = {"contract": CallContract, "aoti": AotiFacts}


@dataclass(frozen=True)
class VerifiedLanes:
    """What verify found of a program's lanes: its switch table (what is sealed), each lane's
    errors against eager with the same lane, and each value's numerics against its axis's
    reference (`{"ok", "rel_rms"}`, or `{"ok": false, "detail"}`: then it is no candidate)."""

    table: Switches
    checked: Mapping[str, Any]
    numerics: Mapping[str, Mapping[str, Mapping[str, Any]]]

    def passed(self) -> dict[str, dict[str, bool]]:
        """axis → value → whether it passed its numerics check."""
        return {a: {v: bool(r["ok"]) for v, r in vals.items()} for a, vals in self.numerics.items()}

    def to_json(self) -> dict[str, Any]:
        return {**self.table.to_json(), "checked": dict(self.checked), "numerics": dict(self.numerics)}

    @classmethod
    def from_json(cls, raw: Any, where: str = "lanes") -> VerifiedLanes:
        table = Switches.parse(raw, where)
        numerics = obj(raw.get("numerics"), f"{where}.numerics")
        for axis, vals in numerics.items():
            for value, row in obj(vals, f"{where}.numerics.{axis}").items():
                at = f"{where}.numerics.{axis}.{value}"
                need(isinstance(obj(row, at).get("ok"), bool), f"{at}.ok", "not a boolean")
        checked = obj(raw.get("checked"), f"{where}.checked")
        return cls(table, checked, numerics)


@dataclass(frozen=True)
class Verified(Answer):
    """The package against eager: one error row per output, the device it ran on and, with
    lanes, what verify found of them."""

    errors: Sequence[Mapping[str, Any]]
    device: Mapping[str, Any]
    lanes: VerifiedLanes | None = None

    PART: ClassVar[str] = "verify"
    TYPED: ClassVar[Mapping[str, Any]] = {"lanes": VerifiedLanes}


@dataclass(frozen=True)
class Measured(Answer):
    """Each candidate lane's benchmark, and the device measured on (none without candidates)."""

    runs: Mapping[str, Any] = field(default_factory=dict)
    device: Mapping[str, Any] | None = None

    PART: ClassVar[str] = "measure"


@dataclass(frozen=True)
class Served(Answer):
    """The sealed artifact adopted as a serving process adopts it: error rows, served counters."""

    errors: Sequence[Mapping[str, Any]]
    served: Sequence[Mapping[str, Any]]

    PART: ClassVar[str] = "serve"


PART_PHASE: Mapping[str, Phase] = {
    "trace": Phase.COMPILE,
    "compile": Phase.COMPILE,
    "verify": Phase.VERIFY,
    "measure": Phase.LANES,
    "serve": Phase.SERVE,
}
"""The mint phase a part runs in (a hold's trace runs in `Phase.TRACE`, before its key)."""


def serve_check(job: TraceJob, artifact: Path) -> dict[str, Any]:
    """The mint's serve check run on a stored artifact (`cgbuild verify --run`): the worker's
    `serve` stage alone in a child of its own (its go in its start line), adopting `artifact`
    strictly into the entry's live module and comparing every lane it carries with eager. Its
    answer (`Served`), its failure, or how it ended without either, as JSON."""
    answers: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="cgbuild-verify-") as tmp:
        start = StageStart(job, StageEnv(tmp), go=Go("serve", artifact=str(artifact)))
        ended = spawn(
            "cgbuild_rules.mint",
            ["--stage", "serve"],
            talk=Talk(start.to_json(), answers.append),
            env={**os.environ, "TMPDIR": tmp},
        )
    if not answers:
        return MintFailed.ended(ended, "serve stage", Phase.SERVE).to_json()
    if answers[0].get("ok") is False:
        return answers[0]
    try:
        return Served.from_json(answers[0]).to_json()
    except BadMessage as e:
        return MintFailed(Code.MINT_ERROR, Phase.SERVE, str(e)).to_json()
