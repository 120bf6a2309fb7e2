"""Reasons: why a target has its status, as frozen typed values (DESIGN §3b, docs/plan.md).

The planner builds a `Reason` at the line that decides a status or notices a move; rendering
(the plan JSON's dict, the human `plan` and `why`) only reads it. Each names what moved: the file
relative to the Cgfile, the config key path, the distribution with both versions, the rule
version, the axis and toolchain component, so no reader has to guess from a digest.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from typing import Any

from cgbuild.core.codes import Code
from cgbuild.core.errors import UserError


class Status(StrEnum):
    """A target's plan status: what the next `mint` does with it."""

    FRESH = "fresh"
    MINT = "mint"
    TRACE = "trace"
    """its graph is not known yet: a trace decides its key"""
    BLOCKED = "blocked"


# The codes a plan reason may carry (documented in docs/plan.md).
REASON_CODES = frozenset(
    {
        Code.NEW_TARGET,
        Code.AXIS_MOVED,
        Code.MISSING_FROM_STORE,
        Code.MALFORMED_REF,
        Code.QUARANTINED,
        Code.TRACE_INPUT_MOVED,
        Code.EARLY_CUTOFF,
        Code.GRAPH_UNKNOWN,
        Code.NO_CUDA_TORCH,
        Code.TRACE_FAILED,
        Code.ENTRY_ERROR,
        Code.LITERAL_HIDDEN,
        Code.DIMENSION_MISMATCH,
        Code.WRONG_HOST,
        Code.WRONG_DEVICE,
        Code.MINT_ERROR,
        Code.WORKER_CRASHED,
        Code.WORKER_KILLED,
        Code.WORKER_SIGNAL,
        Code.OOM,
        Code.TIMEOUT,
        Code.LAYOUT_BELOW_SM_FLOOR,
        Code.LAYOUT_TOOLCHAIN_UNSUPPORTED,
        Code.LAYOUT_TOPOLOGY_MISMATCH,
        Code.UNSIGNED,
        Code.UNKNOWN_SIGNER,
        Code.BAD_SIGNATURE,
    }
)

# `plan --verify`: a key the shared store lists whose ref's signature fails (cgbuild/store/trust.py).
TRUST_CODES = frozenset({Code.UNSIGNED, Code.UNKNOWN_SIGNER, Code.BAD_SIGNATURE})

# Blocked because of this machine, not the declaration: a CPU CI box blocks every GPU target
# this way, so `plan --exit-code` does not count them.
ENVIRONMENT_CODES = frozenset({Code.NO_CUDA_TORCH, Code.LAYOUT_BELOW_SM_FLOOR})


@dataclass(frozen=True)
class Reason:
    """One reason. `root`: a root cause (what a person changed), else what propagated from one.

    `component` names the moved thing within its kind: a toolchain component, a file relative to
    the Cgfile, a config key path (`family.toy.config.hidden`), a distribution, `trace-rule`."""

    code: Code
    detail: str
    root: bool
    axis: str | None = None
    component: str | None = None
    old: str | None = None
    new: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.code, Code) or self.code not in REASON_CODES:
            raise ValueError(f"not a plan reason code: {self.code!r}")

    def propagated(self) -> Reason:
        return self if not self.root else replace(self, root=False)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, doc: Any, where: str, fail: Callable[[str, str], UserError]) -> Reason:
        """A reason as a plan file holds it: a documented code, a detail, whether it is a root
        cause, and the optional names of what moved, each a string."""
        if not isinstance(doc, dict):
            raise fail(where, "a reason is an object")
        code = doc.get("code")
        if code not in REASON_CODES:
            raise fail(f"{where}.code", f"not a plan reason code: {code!r}")
        if not isinstance(doc.get("detail"), str) or not isinstance(doc.get("root"), bool):
            raise fail(where, "a reason has a string 'detail' and a boolean 'root'")
        named = {k: doc.get(k) for k in ("axis", "component", "old", "new")}
        for k, v in named.items():
            if v is not None and not isinstance(v, str):
                raise fail(f"{where}.{k}", "expected a string")
        return cls(Code(code), doc["detail"], doc["root"], **named)


def _value(v: Any) -> str:
    text = v if isinstance(v, str) else json.dumps(v, sort_keys=True, separators=(",", ":"), default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def file_moved(path: str, old: str | None, new: str | None, *, root: bool) -> Reason:
    what = "added" if old is None else "removed" if new is None else "changed"
    return Reason(
        Code.TRACE_INPUT_MOVED,
        f"{path} {what}",
        root,
        component=path,
        old=old[:12] if old else None,
        new=new[:12] if new else None,
    )


def setting_moved(path: str, old: Any, new: Any, *, root: bool) -> Reason:
    """A Cgfile value a trace reads (a config key, the entry, the lanes) moved."""
    before = "absent" if old is None else _value(old)
    after = "absent" if new is None else _value(new)
    return Reason(
        Code.TRACE_INPUT_MOVED,
        f"{path} changed ({before} → {after})",
        root,
        component=path,
        old=before,
        new=after,
    )


def version_moved(name: str, old: str | None, new: str | None, *, root: bool) -> Reason:
    """A distribution, the tracing torch, Python or the trace rule moved from one version to another."""
    before, after = old or "absent", new or "absent"
    return Reason(
        Code.TRACE_INPUT_MOVED, f"{name} {before} → {after}", root, component=name, old=before, new=after
    )


def more_moved(n: int, kind: str, *, root: bool) -> Reason:
    return Reason(Code.TRACE_INPUT_MOVED, f"and {n} more {kind} moved", root)


def unnamed_inputs_moved(*, root: bool) -> Reason:
    return Reason(
        Code.TRACE_INPUT_MOVED,
        "trace inputs moved, none of them recorded by name (the module's spec or the quant rule's facts)",
        root,
    )


def axis_moved(axis: str, old: str, new: str, *, root: bool, component: str | None = None) -> Reason:
    what = f"{component} " if component else ""
    return Reason(
        Code.AXIS_MOVED,
        f"{axis}: {what}{old} → {new}",
        root,
        axis=axis,
        component=component,
        old=old,
        new=new,
    )


def early_cutoff() -> Reason:
    return Reason(
        Code.EARLY_CUTOFF, "re-traced: the graph digest did not move (early cutoff)", False, axis="graph"
    )


def trace_refused(result: dict[str, Any]) -> Reason:
    """A failed trace's result line as the target's blocking reason, keeping the code its worker
    typed (a held worker's `wrong-host` stays `wrong-host`); only a code no plan reason has is
    read as `trace-failed`, its own code kept in the detail. A refusal of a Cgfile field
    (`dimension-mismatch`) names it as the reason's component."""
    raw = str(result.get("code") or Code.TRACE_FAILED)
    detail = str(result.get("detail") or "trace failed")
    if raw not in REASON_CODES:
        return Reason(Code.TRACE_FAILED, f"{raw}: {detail}", root=True)
    field = result.get("field")
    if isinstance(field, str) and field:
        return Reason(Code(raw), detail, root=True, component=field)
    return Reason(Code(raw), detail, root=True)
