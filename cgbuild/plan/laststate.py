"""The shape of `last-plan.json`, checked before the planner reads it back.

The planner keeps what each plan saw (per label: key, axes, trace inputs; the environment and
toolchains) to say what moved next time. It reads every field without guarding, so a document
of another shape is refused here as a whole (and set aside by the caller) rather than crashing a
plan halfway through its reasons.
"""

from __future__ import annotations

from typing import Any

from cgbuild.core.canon import NotCanonical, canonical_json
from cgbuild.core.statefile import is_str_map
from cgbuild.identity.keys import IDENTITY_FIELDS


def _axes(value: Any) -> bool:
    if not isinstance(value, dict):
        return False
    for name, block in value.items():
        if block is None:
            continue
        if not isinstance(block, dict) or not all(f in block for f in IDENTITY_FIELDS.get(name, ())):
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
