"""Diffing two plans: the blast radius of a change before anything compiles.

Targets match by label. A moved key names its axes and, for the toolchain, the components
(`toolchain: triton 3.6.0 → 3.7.0`). A target whose head graph is unknown but whose toolchain fold
moved is already a certain re-mint. A head key that some base target already had needs no mint.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from cgbuild.core.errors import UserError
from cgbuild.identity import toolchain
from cgbuild.identity.keys import AXES, IDENTITY_FIELDS


def load_plan(path: str) -> dict[str, Any]:
    """Read a plan JSON file (from `plan --json` or `-o`); bad input is a UserError naming the file."""
    try:
        with open(path) as f:
            return check_plan(json.load(f), path)
    except FileNotFoundError:
        raise UserError("no such plan file", file=path) from None
    except json.JSONDecodeError as exc:
        raise UserError(f"not JSON: {exc.msg}", file=path, line=exc.lineno) from None


def check_plan(plan: Any, name: str) -> dict[str, Any]:
    if not isinstance(plan, dict) or plan.get("schema") != "cgbuild.plan/1":
        raise UserError("not a cgbuild plan (expected schema 'cgbuild.plan/1')", file=name, field="schema")
    if not isinstance(plan.get("targets"), list):
        raise UserError("plan has no 'targets' array", file=name, field="targets")
    return plan


def _moved_axes(base: dict[str, Any], head: dict[str, Any]) -> list[str]:
    moved = []
    for axis in AXES:
        a, b = (base.get("axes") or {}).get(axis), (head.get("axes") or {}).get(axis)
        if a is None or b is None:
            continue
        if any(a.get(f) != b.get(f) for f in IDENTITY_FIELDS[axis]):
            moved.append(axis)
    return moved


def _platform(target: dict[str, Any]) -> str:
    return "cpu" if target["sm"] == "cpu" else "cuda"


def diff_plans(base: dict[str, Any], head: dict[str, Any]) -> dict[str, Any]:
    base_t = {t["label"]: t for t in base["targets"]}
    head_t = {t["label"]: t for t in head["targets"]}
    base_keys = {t["key"] for t in base["targets"] if t["key"]}
    comp_changes = {
        p: toolchain.component_changes(
            base.get("toolchains", {}).get(p, {}).get("components", {}),
            head.get("toolchains", {}).get(p, {}).get("components", {}),
        )
        for p in ("cpu", "cuda")
    }
    entries: list[dict[str, Any]] = []
    for label in sorted(set(base_t) | set(head_t)):
        b, h = base_t.get(label), head_t.get(label)
        if b is None:
            assert h is not None
            remint = h["key"] is None or h["key"] not in base_keys
            entries.append(
                {
                    "label": label,
                    "family": h["family"],
                    "change": "added",
                    "key": h["key"],
                    "remint": remint,
                    "detail": "new target",
                }
            )
            continue
        if h is None:
            entries.append(
                {
                    "label": label,
                    "family": b["family"],
                    "change": "removed",
                    "key": b["key"],
                    "remint": False,
                    "detail": "target removed",
                }
            )
            continue
        if h["key"] is None:
            tc_b = (b.get("axes") or {}).get("toolchain") or {}
            tc_h = (h.get("axes") or {}).get("toolchain") or {}
            certain = tc_b.get("fold") != tc_h.get("fold")
            detail = _toolchain_detail(comp_changes[_platform(h)]) if certain else "graph not yet known"
            entries.append(
                {
                    "label": label,
                    "family": h["family"],
                    "change": "unknown",
                    "key": None,
                    "remint": certain,
                    "certain": certain,
                    "base_key": b["key"],
                    "detail": ("re-mint certain: " + detail) if certain else detail,
                }
            )
            continue
        if b["key"] == h["key"]:
            continue
        axes = _moved_axes(b, h)
        details = []
        for axis in axes:
            if axis == "toolchain":
                details.append(_toolchain_detail(comp_changes[_platform(h)]))
            else:
                old = b["axes"][axis]
                new = h["axes"][axis]
                field = IDENTITY_FIELDS[axis][0]
                details.append(f"{axis}: {str(old.get(field))[:12]} → {str(new.get(field))[:12]}")
        entries.append(
            {
                "label": label,
                "family": h["family"],
                "change": "moved",
                "axes": axes,
                "base_key": b["key"],
                "key": h["key"],
                "remint": h["key"] not in base_keys,
                "detail": "; ".join(details) or "key moved",
            }
        )
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


def _toolchain_detail(changes: list[tuple[str, str, str]]) -> str:
    if not changes:
        return "toolchain: fold moved"
    return "; ".join(f"toolchain: {name} {old} → {new}" for name, old, new in changes)


def render(d: dict[str, Any], fmt: str) -> str:
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
        return "\n".join(lines) + "\n"
    for fam, c in d["families"].items():
        lines.append(f"{fam}: {_family_line(c)}")
    for e in d["entries"]:
        lines.append(f"  {e['change']:<8} {e['label']}{_tag(e, '[{}]')}: {e['detail']}")
    lines.append(f"{d['remint']} re-mint(s)" if d["entries"] else "no target moved")
    return "\n".join(lines) + "\n"


def _tag(e: dict[str, Any], form: str) -> str:
    """` [re-mint]` for a target whose key moved, ` [mint]` for a brand-new one: it was never
    minted, so nothing is minted again."""
    if not e["remint"]:
        return ""
    return " " + form.format("mint" if e["change"] == "added" else "re-mint")


def _family_line(c: dict[str, int]) -> str:
    parts = [f"{c[k]} {k}" for k in ("moved", "unknown", "added", "removed") if c.get(k)]
    return ", ".join(parts) + f" → {c.get('remint', 0)} re-mint(s)"
