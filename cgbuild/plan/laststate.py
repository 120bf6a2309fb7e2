"""`last-plan.json`: each target's reference (what it was when last fresh), read, checked, advanced.

The planner keeps what each plan saw (per label: key, axes, trace inputs; the environment and
toolchains) to say what moved next time. It reads every field without guarding, so a document
of another shape is refused here as a whole (and set aside) rather than crashing a plan halfway
through its reasons. Only `plan` and `mint` advance it (`record`, `record_minted`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cgbuild.core import fs, statefile
from cgbuild.core.canon import NotCanonical, canonical_json
from cgbuild.core.statefile import is_str_map
from cgbuild.identity.keys import KINDS
from cgbuild.plan.reasons import Status

if TYPE_CHECKING:
    from cgbuild.plan.entries import Plan
    from cgbuild.plan.moved import Snapshots

SCHEMA = "cgbuild.last-plan/2"


def _axes(value: Any) -> bool:
    if not isinstance(value, dict):
        return False
    for name, block in value.items():
        if block is None:
            continue
        fields = KINDS[name].fields if name in KINDS else ()
        if not isinstance(block, dict) or not all(f in block for f in fields):
            return False
    return True


def _target(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and isinstance(value.get("key"), str | type(None))
        and isinstance(value.get("trace_inputs"), str | type(None))
        and isinstance(value.get("env"), str | type(None))
        and isinstance(value.get("fam"), str | type(None))
        and isinstance(value.get("new", False), bool)
        and _axes(value.get("axes") or {})
    )


def _targets(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and _target(v) for k, v in value.items())


def _environment(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and is_str_map(value.get("dists", {}))
        and isinstance(value.get("rule"), int)
        and isinstance(value.get("python"), str)
    )


def _family(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and isinstance(value.get("entry"), str)
        and isinstance(value.get("config", {}), dict)
        and isinstance(value.get("lanes", []), list)
        and is_str_map(value.get("files", {}))
    )


def _toolchains(value: Any) -> bool:
    if not isinstance(value, dict):
        return False
    for components in value.values():
        if not isinstance(components, dict):
            return False
        try:
            canonical_json(components)
        except NotCanonical:
            return False
    return True


def _snapshots(value: Any, ok: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and ok(v) for k, v in value.items())


def valid(doc: Any, schema: str) -> bool:
    """Whether `doc` is a last plan of `schema` that the planner can read every field of."""
    return (
        isinstance(doc, dict)
        and doc.get("schema") == schema
        and _targets(doc.get("targets", {}))
        and _targets(doc.get("pending", {}))
        and _snapshots(doc.get("environments", {}), _environment)
        and _snapshots(doc.get("families", {}), _family)
        and _toolchains(doc.get("toolchains", {}))
    )


def load(path: Path) -> dict[str, Any]:
    """The last plan at `path`, or {} (none yet, or one set aside as torn or foreign)."""
    doc = statefile.read_json(path, lambda d: valid(d, SCHEMA), "last plan")
    return doc or {}


def record(path: Path, plan: Plan, last: dict[str, Any], snaps: Snapshots) -> None:
    """Advance each planned target's reference: a fresh target's becomes what it is now; one that
    still needs a mint keeps its own (its root causes stand until it is fresh), with what it is
    now kept apart (`pending`) so a mint of that key can advance it (`record_minted`)."""
    refs: dict[str, Any] = dict(last.get("targets", {}))
    pending: dict[str, Any] = dict(last.get("pending", {}))
    for entry in plan.entries:
        label = entry.label
        now = {
            "key": entry.key,
            "axes": entry.to_json()["axes"],
            "trace_inputs": entry.trace_inputs,
            "env": snaps.env_id,
            "fam": snaps.fam_ids[entry.family],
        }
        ref = refs.get(label)
        pending.pop(label, None)
        if entry.status is Status.FRESH:
            refs[label] = now
            continue
        if ref is None:
            refs[label] = {**now, "new": True}
        elif entry.key is None:
            # An unknown graph says nothing new about the key: keep the last known one, but note
            # the inputs seen, or every later plan would report them as moved again.
            refs[label] = {**ref, **{k: now[k] for k in ("trace_inputs", "env", "fam")}}
        if entry.key is not None:
            pending[label] = now
    snapshots = {
        "environments": {**last.get("environments", {}), snaps.env_id: snaps.env},
        "families": {**last.get("families", {}), **snaps.families},
        "toolchains": {
            **last.get("toolchains", {}),
            **{t.fold: dict(t.components) for t in plan.toolchains.values()},
        },
    }
    _save(path, refs, pending, snapshots)


def record_minted(path: Path, keys: set[str]) -> None:
    """A minted key is fresh: its targets' references become what they were planned as."""
    last = load(path)
    refs: dict[str, Any] = dict(last.get("targets", {}))
    pending: dict[str, Any] = dict(last.get("pending", {}))
    for label, now in list(pending.items()):
        if now["key"] in keys:
            refs[label] = now
            del pending[label]
    _save(path, refs, pending, {k: last.get(k, {}) for k in ("environments", "families", "toolchains")})


def _save(
    path: Path, refs: dict[str, Any], pending: dict[str, Any], snapshots: dict[str, dict[str, Any]]
) -> None:
    """Write the references with only the snapshots they still name: one copy of each
    environment, family and toolchain, however many targets name it."""
    rows = [*refs.values(), *pending.values()]
    named = {
        "environments": {r.get("env") for r in rows},
        "families": {r.get("fam") for r in rows},
        "toolchains": {((r.get("axes") or {}).get("toolchain") or {}).get("fold") for r in rows},
    }
    doc = {
        "schema": SCHEMA,
        "targets": refs,
        "pending": pending,
        **{kind: {k: v for k, v in snapshots[kind].items() if k in named[kind]} for kind in named},
    }
    text = json.dumps(doc, sort_keys=True, default=str)  # default: a TOML date in a config
    try:
        if path.read_bytes() == text.encode():
            return  # unchanged: a no-op plan leaves the file (and its stamp) as it was
    except OSError:
        pass
    fs.write_atomic(path, text)
