"""Diffing two plans: the blast radius of a change before anything compiles.

Targets match by label. A moved key names its axes and, for the toolchain, the components
(`toolchain: triton 3.6.0 → 3.7.0`). A target whose head graph is unknown but whose toolchain fold
moved is already a certain re-mint. A head key that some base target already had needs no mint.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from cgbuild.core import jsonfile
from cgbuild.core.errors import printable
from cgbuild.core.platform import device_of
from cgbuild.identity import toolchain_changes
from cgbuild.identity.keys import AXES, KINDS
from cgbuild.plan.entries import Plan, PlanEntry


def load_plan(path: str) -> Plan:
    """Read a plan JSON file (from `plan --json` or `-o`); bad input is a UserError naming the file."""
    return Plan.from_json(jsonfile.load(path, "plan file"), path)


def _moved_axes(base: PlanEntry, head: PlanEntry) -> list[str]:
    moved = []
    for axis in AXES:
        a, b = base.axes.get(axis), head.axes.get(axis)
        if a is None or b is None:
            continue
        if KINDS[axis].moved(a, b):
            moved.append(axis)
    return moved


def diff_plans(base: Plan, head: Plan) -> dict[str, Any]:
    """Each target that was added, removed, moved or became unknown between two plans, with
    per-family counts and how many need a (re-)mint: the `cgbuild.diff/1` document."""
    base_t = {t.label: t for t in base.entries}
    head_t = {t.label: t for t in head.entries}
    base_keys = {t.key for t in base.entries if t.key}
    comp_changes = {
        p: toolchain_changes.component_changes(_components(base, p), _components(head, p))
        for p in ("cpu", "cuda")
    }
    entries: list[dict[str, Any]] = []
    for label in sorted(set(base_t) | set(head_t)):
        b, h = base_t.get(label), head_t.get(label)
        if b is None:
            assert h is not None
            entries.append(_added(label, h, base_keys))
        elif h is None:
            entries.append(_removed(label, b))
        elif h.key is None:
            entries.append(_unknown(label, b, h, comp_changes))
        elif b.key != h.key:
            entries.append(_moved(label, b, h, base_keys, comp_changes))
    families: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for e in entries:
        families[e["family"]][e["change"]] += 1
        families[e["family"]]["remint"] += int(bool(e["remint"]))
    return {
        "schema": "cgbuild.diff/1",
        "entries": entries,
        "families": {f: dict(c) for f, c in sorted(families.items())},
        "remint": sum(1 for e in entries if e["remint"]),
        "toolchain_changes": {p: [f"{n} {a} → {b}" for n, a, b in c] for p, c in comp_changes.items() if c},
    }


def _components(plan: Plan, platform: str) -> dict[str, Any]:
    tc = plan.toolchains.get(platform)
    return dict(tc.components) if tc is not None else {}


Changes = dict[str, list[tuple[str, str, str]]]  # platform → toolchain component changes


def _added(label: str, h: PlanEntry, base_keys: set[str]) -> dict[str, Any]:
    remint = h.key is None or h.key not in base_keys
    return {
        "label": label,
        "family": h.family,
        "change": "added",
        "key": h.key,
        "remint": remint,
        "detail": "new target",
    }


def _removed(label: str, b: PlanEntry) -> dict[str, Any]:
    return {
        "label": label,
        "family": b.family,
        "change": "removed",
        "key": b.key,
        "remint": False,
        "detail": "target removed",
    }


def _unknown(label: str, b: PlanEntry, h: PlanEntry, comp_changes: Changes) -> dict[str, Any]:
    """A head graph not known yet: a re-mint is already certain when the toolchain fold moved."""
    tc_b = b.axes.get("toolchain") or {}
    tc_h = h.axes.get("toolchain") or {}
    certain = tc_b.get("fold") != tc_h.get("fold")
    detail = _toolchain_detail(comp_changes[device_of(h.sm)]) if certain else "graph not yet known"
    return {
        "label": label,
        "family": h.family,
        "change": "unknown",
        "key": None,
        "remint": certain,
        "certain": certain,
        "base_key": b.key,
        "detail": ("re-mint certain: " + detail) if certain else detail,
    }


def _moved(
    label: str, b: PlanEntry, h: PlanEntry, base_keys: set[str], comp_changes: Changes
) -> dict[str, Any]:
    """A key that moved, by axis; a head key some base target already had needs no mint."""
    axes = _moved_axes(b, h)
    details = []
    for axis in axes:
        if axis == "toolchain":
            details.append(_toolchain_detail(comp_changes[device_of(h.sm)]))
        else:
            old, new = KINDS[axis].move_text(b.axis(axis), h.axis(axis))
            details.append(f"{axis}: {old} → {new}")
    return {
        "label": label,
        "family": h.family,
        "change": "moved",
        "axes": axes,
        "base_key": b.key,
        "key": h.key,
        "remint": h.key not in base_keys,
        "detail": "; ".join(details) or "key moved",
    }


def _toolchain_detail(changes: list[tuple[str, str, str]]) -> str:
    if not changes:
        return "toolchain: fold moved"
    return "; ".join(f"toolchain: {name} {old} → {new}" for name, old, new in changes)


def render(d: dict[str, Any], fmt: str) -> str:
    """The diff as text or markdown; every string from the plans is printed with control
    characters escaped (a plan file is hostile input)."""
    lines: list[str] = []
    if fmt == "markdown":
        lines.append(f"### cgbuild plan diff: {d['remint']} re-mint(s)")
        lines.append("")
        for fam, c in d["families"].items():
            lines.append(f"- **{fam}**: {_family_line(c)}")
        if d["entries"]:
            lines += ["", "| change | target | detail |", "|---|---|---|"]
            for e in d["entries"]:
                lines.append(f"| {e['change']}{_tag(e, '({})')} | `{e['label']}` | {e['detail']} |")
        return "\n".join(printable(line) for line in lines) + "\n"
    for fam, c in d["families"].items():
        lines.append(f"{fam}: {_family_line(c)}")
    for e in d["entries"]:
        lines.append(f"  {e['change']:<8} {e['label']}{_tag(e, '[{}]')}: {e['detail']}")
    lines.append(f"{d['remint']} re-mint(s)" if d["entries"] else "no target moved")
    return "\n".join(printable(line) for line in lines) + "\n"


def _tag(e: dict[str, Any], form: str) -> str:
    """` [re-mint]` for a target whose key moved, ` [mint]` for a brand-new one: it was never
    minted, so nothing is minted again."""
    if not e["remint"]:
        return ""
    return " " + form.format("mint" if e["change"] == "added" else "re-mint")


def _family_line(c: dict[str, int]) -> str:
    parts = [f"{c[k]} {k}" for k in ("moved", "unknown", "added", "removed") if c.get(k)]
    return ", ".join(parts) + f" → {c.get('remint', 0)} re-mint(s)"
