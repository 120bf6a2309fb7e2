"""The mint request: what the engine asks `python -m cgbuild_rules.mint` to build for ONE key.

Built by the engine (`cgbuild.exec.mint.request_for`) and validated by the worker with the same
type, so a field cannot be written on one side and read under another name on the other. The
full field list and the result line are documented in `cgbuild_rules.mint`'s module docstring.

Identity vs metadata, visible in the type: `key`, `job`, `sm`, `graph_digest`, `toolchain` and
`layout` are what the worker re-derives and refuses drift on; the rest (labels, facets, paths,
timeouts) only shape the run and the sealed coverage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from cgbuild.core.platform import device_of
from cgbuild.protocol.trace import BadJob, TraceJob

REQUEST_SCHEMA = "cgbuild.mint-request/1"


class BadRequest(ValueError):
    """A request that is not what this protocol says; the worker answers it `bad-request`."""


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
        out: dict[str, Any] = {"schema": REQUEST_SCHEMA}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "job":
                out["job"] = value.to_json()
            elif value is not None:
                out[f.name] = value
        return out

    @classmethod
    def from_json(cls, raw: Any) -> MintRequest:
        """Validate a request; BadRequest names what is wrong."""
        if not isinstance(raw, Mapping) or raw.get("schema") != REQUEST_SCHEMA:
            raise BadRequest(f"schema must be {REQUEST_SCHEMA!r}")
        required = ("id", "key", "job", "sm", "graph_digest", "toolchain", "out")
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
        if not isinstance(raw["toolchain"], Mapping):
            raise BadRequest("toolchain must be an object")
        device, platform = job.spec["device"], raw["toolchain"].get("platform")
        if not isinstance(raw["sm"], str) or device_of(raw["sm"]) != device or platform != device:
            raise BadRequest(
                f"sm {raw['sm']!r}, job device {device!r} and toolchain platform {platform!r} disagree"
            )
        return cls(**{**{k: raw[k] for k in raw if k in known}, "job": job})
