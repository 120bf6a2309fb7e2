"""The mint request: what the engine asks `python -m cgbuild_rules.mint` to build for ONE key.

Built by the engine (`cgbuild.exec.mint.request_for`) and validated by the worker with the same
type, so a field cannot be written on one side and read under another name on the other. The
full field list and the result line are documented in `cgbuild_rules.mint`'s module docstring.

Identity vs metadata, visible in the type: `key`, `job`, `sm`, `graph_digest`, `toolchain` and
`layout` are what the worker re-derives and refuses drift on; the rest (labels, facets, paths,
timeouts) only shape the run and the sealed coverage.

A key's mint ends in ONE outcome type, `Minted | MintFailed`: the worker builds it for its result
line, and the engine's every producer (spawn, admission, the fleet) builds the same type, so a
failure's `retryable` follows from its code alone and every reader (the CLI, its progress and
JSON, the mint records) reads one shape.

A `MintHold` starts a worker before its key exists: it traces the job where it will compile it
and reports the graph facts the plan keys it with, then waits for the key's `MintRequest` (or
the end of its input) on the same stdin. The plan's trace and the compile's are then one
(docs/architecture.md, "One trace per mint").
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar

from cgbuild.core.codes import RETRYABLE, Code
from cgbuild.core.platform import device_of
from cgbuild.protocol.spawn import Channel, Ended, Talk, spawn
from cgbuild.protocol.trace import BadJob, TraceJob


class Phase(StrEnum):
    """Where a mint is, or where it failed: the worker's phases, then the engine's."""

    REQUEST = "request"
    """the request is checked (a `bad-request` fails here)"""
    TRACE = "trace"
    """a held worker's trace, before its key is known"""
    COMPILE = "compile"
    VERIFY = "verify"
    LANES = "lanes"
    SEAL = "seal"
    SERVE = "serve"
    """the sealed artifact adopted and called in a serving process (the serve check)"""
    ADMIT = "admit"
    PUBLISH = "publish"
    CHECK = "check"
    """`mint --check`: the stored artifact read back before its re-mint"""
    WORKER = "worker"
    """the worker process ended without a result"""
    FLEET = "fleet"


PHASES = (Phase.COMPILE, Phase.VERIFY, Phase.LANES, Phase.SEAL, Phase.SERVE)
"""The phases a mint worker announces (`{"progress": phase}`), in the order they run: the worker
names its phases from this tuple and the CLI's progress counts its steps by it."""

_COMPARED = ("reproducible", "differing", "fields", "verdict_moved")
"""What a re-mint compared with an earlier artifact adds to its result (`compare_with`)."""


class BadResult(ValueError):
    """A result line that is not a mint outcome."""


@dataclass(frozen=True)
class Minted:
    """A sealed artifact the worker adopted in a serving process; the engine adds its admission."""

    key: str
    artifact: str
    """the sealed file, until the engine admits it"""
    sha256: str
    size: int
    members: Mapping[str, str]
    phases: Mapping[str, float]
    """seconds per phase (never sealed)"""
    verify: list[Mapping[str, Any]] = field(default_factory=list)
    served: list[Mapping[str, Any]] = field(default_factory=list)
    lane_evidence: Mapping[str, Any] | None = None
    compared: Mapping[str, Any] | None = None
    """`reproducible`, `differing`, `fields`, `verdict_moved` of a re-mint (`compare_with`)"""
    device: Mapping[str, Any] | None = None
    """the device the artifact was verified on: its type, the `CUDA_VISIBLE_DEVICES` the mint
    ran under and, on a GPU, its index, name and UUID (a machine fact: never sealed)"""
    admission: str | None = None
    evidence: str | None = None
    """why the lane evidence stayed on this machine, when it did"""
    id: str | None = None

    ok: ClassVar[bool] = True

    @property
    def reproducible(self) -> bool:
        return bool((self.compared or {}).get("reproducible"))

    def admitted(self, status: str, evidence: str | None = None) -> Minted:
        return replace(self, admission=status, evidence=evidence)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ok": True}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "compared":
                out.update(value or {})
            elif value is not None:
                out[f.name] = value
        return out


@dataclass(frozen=True)
class MintFailed:
    """A key's typed failure: what failed (`code`), where (`phase`), in words (`detail`), and
    the facts its code names (`old`/`new` of a drift, `signal`, the `standing` artifact, ...)."""

    code: Code
    phase: Phase
    detail: str
    facts: Mapping[str, Any] = field(default_factory=dict)
    id: str | None = None

    ok: ClassVar[bool] = False
    reproducible: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not isinstance(self.code, Code) or not isinstance(self.phase, Phase):
            raise TypeError(f"a mint failure needs a Code and a Phase, not {self.code!r} and {self.phase!r}")

    @property
    def retryable(self) -> bool:
        return self.code in RETRYABLE

    @classmethod
    def ended(cls, ended: Ended, what: str, phase: Phase, timeout_s: float | None = None) -> MintFailed:
        """How a child that gave no result ended (`cgbuild.protocol.spawn`), as this phase's failure."""
        failure = ended.failure(what, timeout_s)
        facts = {"signal": failure["signal"]} if "signal" in failure else {}
        return cls(Code(failure["code"]), phase, str(failure["detail"]), facts)

    def to_json(self) -> dict[str, Any]:
        head = {"id": self.id, "ok": False, "code": self.code, "retryable": self.retryable}
        return {**head, "phase": self.phase, "detail": self.detail, **self.facts}


MintOutcome = Minted | MintFailed


def outcome_from_json(raw: Any) -> MintOutcome:
    """A result line read back as its outcome; BadResult names what makes it none."""
    if not isinstance(raw, Mapping) or not isinstance(raw.get("ok"), bool):
        raise BadResult("not an object with a boolean `ok`")
    if not raw["ok"]:
        code, phase, detail = str(raw.get("code")), str(raw.get("phase")), raw.get("detail")
        if code not in Code._value2member_map_ or phase not in Phase._value2member_map_:
            raise BadResult(f"code {code!r} and phase {phase!r}: not a registered code and phase")
        head = ("id", "ok", "code", "retryable", "phase", "detail")
        facts = {k: v for k, v in raw.items() if k not in head}
        return MintFailed(Code(code), Phase(phase), str(detail), facts, raw.get("id"))
    known = {f.name for f in fields(Minted)} - {"compared"}
    unknown = sorted(set(raw) - known - set(_COMPARED) - {"ok"})
    if unknown:
        raise BadResult(f"unknown field {unknown[0]!r}")
    compared = {k: raw[k] for k in _COMPARED if k in raw}
    try:
        return Minted(**{k: v for k, v in raw.items() if k in known}, compared=compared or None)
    except TypeError as e:  # a required field missing
        raise BadResult(str(e)) from None


REQUEST_SCHEMA = "cgbuild.mint-request/1"
HOLD_SCHEMA = "cgbuild.mint-hold/1"


class BadRequest(ValueError):
    """A request that is not what this protocol says; the worker answers it `bad-request`."""


def _to_json(doc: Any, schema: str) -> dict[str, Any]:
    """A request's JSON: its schema and every field that is set (the job as its own JSON)."""
    out: dict[str, Any] = {"schema": schema}
    for f in fields(doc):
        value = getattr(doc, f.name)
        if f.name == "job":
            out["job"] = value.to_json()
        elif value is not None:
            out[f.name] = value
    return out


def _checked(cls: Any, raw: Any, schema: str, required: tuple[str, ...]) -> dict[str, Any]:
    """The schema, required and unknown fields of `raw` checked for `cls`: its keyword arguments
    (the job parsed)."""
    if not isinstance(raw, Mapping) or raw.get("schema") != schema:
        raise BadRequest(f"schema must be {schema!r}")
    missing = [k for k in required if k not in raw]
    if missing:
        raise BadRequest(f"missing {', '.join(missing)}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - known - {"schema"})
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r}")
    try:
        job = TraceJob.from_json(raw["job"])
    except BadJob as e:
        raise BadRequest(str(e)) from None
    return {**{k: raw[k] for k in raw if k in known}, "job": job}


@dataclass(frozen=True)
class MintRequest:
    id: str
    key: str
    job: TraceJob
    sm: str
    graph_digest: str
    toolchain: Mapping[str, Any]
    """`{platform, fold, components}` of the key's platform."""
    out: str
    """The folder the worker writes `<key>.tar.gz` into."""
    labels: list[str] = field(default_factory=list)
    axes: Mapping[str, Any] | None = None
    facets: list[Mapping[str, Any]] | None = None
    stamp: str | None = None
    layout: Mapping[str, Any] | None = None
    lanes: Mapping[str, Any] | None = None
    cxx: str | None = None
    sandbox: str | None = None
    empty_sandbox: bool | None = None
    """Empty the compile sandbox first, under an exclusive lock (`mint --check`)."""
    compare_with: str | None = None
    timeout_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return _to_json(self, REQUEST_SCHEMA)

    @classmethod
    def from_json(cls, raw: Any) -> MintRequest:
        """Validate a request; BadRequest names what is wrong."""
        kw = _checked(
            cls, raw, REQUEST_SCHEMA, ("id", "key", "job", "sm", "graph_digest", "toolchain", "out")
        )
        if not isinstance(raw["toolchain"], Mapping):
            raise BadRequest("toolchain must be an object")
        device, platform = kw["job"].spec["device"], raw["toolchain"].get("platform")
        if not isinstance(raw["sm"], str) or device_of(raw["sm"]) != device or platform != device:
            raise BadRequest(
                f"sm {raw['sm']!r}, job device {device!r} and toolchain platform {platform!r} disagree"
            )
        return cls(**kw)


@dataclass(frozen=True)
class MintHold:
    """A worker started for a trace unit (`id`: its trace inputs) before the plan keys it."""

    id: str
    job: TraceJob
    out: str
    cxx: str | None = None
    sandbox: str | None = None
    timeout_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return _to_json(self, HOLD_SCHEMA)

    @classmethod
    def from_json(cls, raw: Any) -> MintHold:
        return cls(**_checked(cls, raw, HOLD_SCHEMA, ("id", "job", "out")))

    def admits(self, req: MintRequest) -> str | None:
        """Why `req` cannot be minted by this held worker (None: it can): the job it traced and
        everything its environment was started with must be the request's."""
        if req.job.to_json() | {"id": None} != self.job.to_json() | {"id": None}:
            return "the request's job is not the job this worker traced"
        for name in (f.name for f in fields(self) if f.name not in ("id", "job")):
            if getattr(req, name) != getattr(self, name):
                return f"the request's {name} is not the one this worker was started with"
        if req.empty_sandbox or req.compare_with:
            return "a held worker mints in the shared sandbox: empty_sandbox and compare_with are refused"
        return None


def run_worker(
    request: dict[str, Any],
    log: Path,
    on_progress: Callable[[str], None] | None = None,
    *,
    on_traced: Callable[[dict[str, Any]], None] | None = None,
    channel: Channel | None = None,
    started: Callable[[int], None] | None = None,
    env: Mapping[str, str] | None = None,
) -> MintOutcome:
    """One mint child; its stderr goes to `log`; a child that dies still yields a typed result.
    `env` is the child's whole environment (None: this process's).

    The child announces each phase on its protocol stream (`{"progress": "compile"}`) before
    its one result line. A hold's child also reports its trace (`{"traced": ...}`, to
    `on_traced`) and reads its key's request through `channel`.
    """
    result: MintOutcome | None = None

    def take(message: dict[str, Any]) -> None:
        nonlocal result
        if on_traced is not None and isinstance(message.get("traced"), dict):
            on_traced(message["traced"])
        elif "progress" in message:
            if on_progress:
                on_progress(str(message["progress"]))
        elif "ok" in message:
            try:
                result = outcome_from_json(message)
            except BadResult as e:
                detail = f"the mint worker's result line is not a mint result: {e} (log: {log})"
                result = MintFailed(Code.MINT_ERROR, Phase.WORKER, detail)

    pids: list[int] = []

    def on_start(pid: int) -> None:
        pids.append(pid)
        if started is not None:
            started(pid)

    ended = spawn("cgbuild_rules.mint", talk=Talk(request, take, channel, on_start), log=log, env=env)
    if ended.stopped:  # interrupted: the worker was killed in its group and cleaned up nothing
        for work in Path(request["out"]).glob(f".mint-*-{pids[0]}"):
            shutil.rmtree(work, ignore_errors=True)
    if result is not None:
        return result
    failed = MintFailed.ended(ended, "mint worker", Phase.WORKER)
    return replace(failed, detail=f"{failed.detail} (log: {log})")
