"""What a plan says: a frozen `Plan` of `PlanEntry` values (DESIGN §3b, docs/plan.md).

The planner builds these; `plan`, `why`, `mint`, `fetch`, `verify`, `manifest` and `diff` read
their attributes. JSON exists only at the edges: `to_json` for `plan --json`, `-o` and the memo,
`Plan.from_json` for a plan file handed back (`diff`, `mint --plan`, `gc --keep-plan`), which is
hostile until every field it holds has passed. A `PlanRow` is the part of an entry the human
summary and the CI gate read, so a memoised plan of 10,000 targets answers them without parsing
the whole document.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cgbuild.config.labels import parse_label
from cgbuild.core.errors import UserError
from cgbuild.identity import toolchain
from cgbuild.plan.reasons import Reason, Status

PLAN_SCHEMA = "cgbuild.plan/1"

Fail = Callable[[str, str], UserError]
"""`fail(field, message)`: the error naming the plan file and the field."""

_KEY = re.compile(r"[0-9a-f]{64}")


def _text(doc: Mapping[str, Any], name: str, where: str, fail: Fail) -> str:
    value = doc.get(name)
    if not isinstance(value, str):
        raise fail(f"{where}.{name}", "missing or not a string")
    return value


def _reasons(raw: Any, where: str, fail: Fail) -> tuple[Reason, ...]:
    if not isinstance(raw, list):
        raise fail(where, "expected an array of reasons")
    return tuple(Reason.from_json(r, f"{where}[{i}]", fail) for i, r in enumerate(raw))


def _status(raw: Any, where: str, fail: Fail) -> Status:
    if not isinstance(raw, str):
        raise fail(where, "expected a string")
    try:
        return Status(raw)
    except ValueError:
        raise fail(where, f"not a status ({', '.join(s.value for s in Status)}): {raw!r}") from None


def _key(raw: Any, where: str, fail: Fail) -> str | None:
    if raw is not None and not (isinstance(raw, str) and _KEY.fullmatch(raw)):
        raise fail(where, "expected null or a key (64 hex digits)")
    return raw


@dataclass(frozen=True)
class PlanRow:
    """What the summary and the CI gate read of one target."""

    label: str
    family: str
    status: Status
    key: str | None
    reasons: tuple[Reason, ...]
    pixel_frames: Any = None
    """A video module's pipeline frame count, where its entry states one (the one envelope
    field the summary shows)."""

    @property
    def roots(self) -> tuple[Reason, ...]:
        """Its root causes, or its first reason when none is marked root."""
        return tuple(r for r in self.reasons if r.root) or self.reasons[:1]

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "label": self.label,
            "family": self.family,
            "status": self.status,
            "key": self.key,
            "reasons": [{"code": r.code, "detail": r.detail, "root": r.root} for r in self.reasons],
        }
        if self.pixel_frames is not None:
            doc["envelope"] = {"pixel_frames": self.pixel_frames}
        return doc

    @classmethod
    def from_json(cls, doc: Any, where: str, fail: Fail) -> PlanRow:
        if not isinstance(doc, dict):
            raise fail(where, "a target is an object")
        envelope = doc.get("envelope") or {}
        return cls(
            _text(doc, "label", where, fail),
            _text(doc, "family", where, fail),
            _status(doc.get("status"), f"{where}.status", fail),
            _key(doc.get("key"), f"{where}.key", fail),
            _reasons(doc.get("reasons"), f"{where}.reasons", fail),
            envelope.get("pixel_frames") if isinstance(envelope, dict) else None,
        )


@dataclass(frozen=True)
class PlanEntry:
    """One target: its key, status and axes, and the reasons that decided them."""

    label: str
    family: str
    module: str
    graph_class: str
    layout: str
    stamp: str
    sm: str
    skus: tuple[str, ...]
    envelope: Mapping[str, Any]
    key: str | None
    status: Status
    axes: Mapping[str, Mapping[str, Any] | None]
    """Each axis's readable block (`cgbuild.identity.keys`), None while unknown."""
    reasons: tuple[Reason, ...]
    trace_inputs: str

    @property
    def roots(self) -> tuple[Reason, ...]:
        return self.row.roots

    @property
    def row(self) -> PlanRow:
        pixel = self.envelope.get("pixel_frames")
        return PlanRow(self.label, self.family, self.status, self.key, self.reasons, pixel)

    def axis(self, name: str) -> Mapping[str, Any]:
        """A known axis's readable block (a `mint` or `fresh` entry knows all four)."""
        block = self.axes.get(name)
        if block is None:
            raise ValueError(f"{self.label}: its {name} axis is not known")
        return block

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "family": self.family,
            "module": self.module,
            "graph_class": self.graph_class,
            "layout": self.layout,
            "stamp": self.stamp,
            "sm": self.sm,
            "skus": list(self.skus),
            "envelope": dict(self.envelope),
            "key": self.key,
            "status": self.status,
            "axes": {name: (dict(block) if block is not None else None) for name, block in self.axes.items()},
            "reasons": [r.to_json() for r in self.reasons],
            "trace_inputs": self.trace_inputs,
        }

    @classmethod
    def from_json(cls, doc: Any, where: str, fail: Fail) -> PlanEntry:
        if not isinstance(doc, dict):
            raise fail(where, "a target is an object")
        label = _text(doc, "label", where, fail)
        try:
            tid = parse_label(label)
        except UserError as exc:
            raise fail(f"{where}.label", exc.message) from None
        for name, value in (("family", tid.family), ("sm", tid.sm)):
            if doc.get(name) != value:
                raise fail(f"{where}.{name}", f"expected '{value}' (from the label), got {doc.get(name)!r}")
        if "key" not in doc:
            raise fail(f"{where}.key", "expected null or a key (64 hex digits)")
        status = _status(doc.get("status"), f"{where}.status", fail)
        axes = doc.get("axes")
        if not isinstance(axes, dict):
            raise fail(f"{where}.axes", "expected an object")
        for name, block in axes.items():
            if block is not None and not isinstance(block, dict):
                raise fail(f"{where}.axes.{name}", "expected an object or null")
        skus, envelope = doc.get("skus"), doc.get("envelope")
        if not isinstance(skus, list) or not all(isinstance(s, str) for s in skus):
            raise fail(f"{where}.skus", "expected an array of SKU names")
        if not isinstance(envelope, dict):
            raise fail(f"{where}.envelope", "expected an object")
        return cls(
            label,
            tid.family,
            _text(doc, "module", where, fail),
            _text(doc, "graph_class", where, fail),
            _text(doc, "layout", where, fail),
            _text(doc, "stamp", where, fail),
            tid.sm,
            tuple(skus),
            envelope,
            _key(doc["key"], f"{where}.key", fail),
            status,
            axes,
            _reasons(doc.get("reasons"), f"{where}.reasons", fail),
            _text(doc, "trace_inputs", where, fail),
        )


@dataclass(frozen=True)
class PlannedToolchain:
    """One platform's toolchain as the plan keyed it."""

    fold: str
    source: str
    components: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"fold": self.fold, "source": self.source, "components": dict(self.components)}


@dataclass(frozen=True)
class Plan:
    """Every selected target's entry, the workspace and the toolchains they were keyed with."""

    workspace: Mapping[str, str]
    toolchains: Mapping[str, PlannedToolchain]
    entries: tuple[PlanEntry, ...]

    def entry(self, label: str) -> PlanEntry | None:
        return next((e for e in self.entries if e.label == label), None)

    def keys(self, status: Status) -> dict[str, str]:
        """label → key of every entry with this status and a key."""
        return {e.label: e.key for e in self.entries if e.status is status and e.key}

    @property
    def rows(self) -> tuple[PlanRow, ...]:
        return tuple(e.row for e in self.entries)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": PLAN_SCHEMA,
            "workspace": dict(self.workspace),
            "toolchains": {p: t.to_json() for p, t in self.toolchains.items()},
            "targets": [e.to_json() for e in self.entries],
        }

    @classmethod
    def from_json(cls, doc: Any, name: str) -> Plan:
        """A plan file's plan; a field that does not hold what `plan --json` writes is a
        UserError naming `name` and the field."""

        def fail(field: str, message: str) -> UserError:
            return UserError(message, file=name, field=field)

        if not isinstance(doc, dict) or doc.get("schema") != PLAN_SCHEMA:
            raise fail("schema", f"not a cgbuild plan (expected schema '{PLAN_SCHEMA}')")
        targets = doc.get("targets")
        if not isinstance(targets, list):
            raise fail("targets", "plan has no 'targets' array")
        entries, seen = [], set()
        for i, raw in enumerate(targets):
            entry = PlanEntry.from_json(raw, f"targets[{i}]", fail)
            if entry.label in seen:
                raise fail(f"targets[{i}].label", f"duplicate target '{entry.label}'")
            seen.add(entry.label)
            entries.append(entry)
        workspace = doc.get("workspace")
        if not isinstance(workspace, dict) or not all(isinstance(v, str) for v in workspace.values()):
            raise fail("workspace", "expected an object of strings")
        return cls(workspace, _toolchains(doc.get("toolchains"), fail), tuple(entries))


def _toolchains(raw: Any, fail: Fail) -> dict[str, PlannedToolchain]:
    if not isinstance(raw, dict):
        raise fail("toolchains", "expected an object of platform → toolchain")
    out = {}
    for platform, block in raw.items():
        where = f"toolchains.{platform}"
        if not isinstance(block, dict):
            raise fail(where, "expected an object with 'fold', 'source' and 'components'")
        toolchain.check_components(fail, f"{where}.components", block.get("components"))
        out[platform] = PlannedToolchain(
            _text(block, "fold", where, fail), _text(block, "source", where, fail), block["components"]
        )
    return out
