"""The mint request: what the engine asks `python -m cgbuild_rules.mint` to build for ONE key.

Built by the engine (`cgbuild.exec.mint.request_for`) and validated by the worker with the same
type, so a field cannot be written on one side and read under another name on the other. The
full field list and the result line are documented in `cgbuild_rules.mint`'s module docstring.

Identity vs metadata, visible in the type: `key`, `job`, `sm`, `graph_digest`, `toolchain` and
`layout` are what the worker re-derives and refuses drift on; the rest (labels, facets, paths,
timeouts) only shape the run and the sealed coverage.

A `MintHold` starts a worker before its key exists: it traces the job where it will compile it
and reports the graph facts the plan keys it with, then waits for the key's `MintRequest` (or
the end of its input) on the same stdin. The plan's trace and the compile's are then one
(docs/architecture.md, "One trace per mint").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from cgbuild.core.platform import device_of
from cgbuild.protocol.spawn import Channel, spawn
from cgbuild.protocol.trace import BadJob, TraceJob

PHASES = ("compile", "verify", "lanes", "seal", "adopt")
"""The phases a mint worker announces (`{"progress": phase}`), in the order they run: the worker
names its phases from this tuple and the CLI's progress counts its steps by it."""

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
    fresh: bool | None = None
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
        if req.fresh or req.compare_with:
            return "a held worker mints in the shared sandbox: fresh and compare_with are refused"
        return None


def run_worker(
    request: dict[str, Any],
    log: Path,
    on_progress: Callable[[str], None] | None = None,
    *,
    on_traced: Callable[[dict[str, Any]], None] | None = None,
    channel: Channel | None = None,
    started: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """One mint child; its stderr goes to `log`; a child that dies still yields a typed result.

    The child announces each phase on its protocol stream (`{"progress": "compile"}`) before
    its one result line. A hold's child also reports its trace (`{"traced": ...}`, to
    `on_traced`) and reads its key's request through `channel`.
    """
    result: dict[str, Any] | None = None

    def take(message: dict[str, Any]) -> None:
        nonlocal result
        if on_traced is not None and isinstance(message.get("traced"), dict):
            on_traced(message["traced"])
        elif "progress" in message:
            if on_progress:
                on_progress(str(message["progress"]))
        elif "ok" in message:
            result = message

    ended = spawn(
        "cgbuild_rules.mint", request=request, on_message=take, log=log, channel=channel, started=started
    )
    if result is not None:
        return result
    failure = ended.failure("mint worker")
    return {**failure, "phase": "worker", "detail": f"{failure['detail']} (log: {log})"}
