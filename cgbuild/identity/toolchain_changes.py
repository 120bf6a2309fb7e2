"""What moved between two toolchains, and each component in one phrase: the words `plan`, `why`,
`diff` and the mint's `toolchain-drift` use for a toolchain, from one place."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cgbuild.core.canon import canonical_json, digest


def summary(name: str, comp: Any) -> str:
    """One short phrase for a component: "3.6.0", "gcc 12.2.0", "x86-64-v3", "absent"."""
    if comp is None:
        return "none"
    if not isinstance(comp, dict):
        return canonical_json(comp)
    if comp.get("absent") is True:
        return "absent"
    if name == "cxx" and "family" in comp:
        return f"{comp['family']} {comp.get('version', '?')}"
    if name == "isa" and "level" in comp:
        return str(comp["level"])
    if name == "ptxas" and isinstance(comp.get("bundled"), dict):
        versions = sorted(
            {str(b.get("version") if isinstance(b, dict) else b) for b in comp["bundled"].values()}
        )
        text = ", ".join(versions) or "none bundled"
        return text + (" + override" if comp.get("override") else "")
    if "version" in comp:
        return str(comp["version"])
    if "scheme" in comp:
        return str(comp["scheme"])
    return digest(comp)[:12]


def _leaves(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_leaves(v, f"{prefix}.{k}" if prefix else k))
        return out
    return {prefix: value}


def _show(value: Any) -> str:
    if value is ...:
        return "∅"
    return value if isinstance(value, str) else canonical_json(value)


def _leaf_diff(old: dict[str, Any], new: dict[str, Any]) -> tuple[str, str]:
    """The changed leaves of two blocks, at most three, as "key=value"; a changed list of names
    (e.g. the scrubbed environment) as what was added and removed."""
    a, b = _leaves(old), _leaves(new)
    changed = sorted(k for k in a.keys() | b.keys() if a.get(k, ...) != b.get(k, ...))
    shown, more = changed[:3], len(changed) - 3
    olds, news = [], []
    for k in shown:
        va, vb = a.get(k, ...), b.get(k, ...)
        if isinstance(va, list) and isinstance(vb, list):
            added = [_show(x) for x in vb if x not in va]
            removed = [_show(x) for x in va if x not in vb]
            olds.append(k)
            news.append(" ".join([k, *(f"+{x}" for x in added), *(f"-{x}" for x in removed)]))
            continue
        olds.append(f"{k}={_show(va)}")
        news.append(f"{k}={_show(vb)}")
    tail = f" (+{more} more)" if more > 0 else ""
    return ", ".join(olds) + tail, ", ".join(news) + tail


def component_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """[(component, old summary, new summary)] for every component that differs, sorted by name.

    Equal summaries are made to differ by what moved: "(files changed)" for a rebuilt wheel of
    the same version, the banner for a compiler of the same version, the changed keys otherwise.
    """
    changes = []
    for name in sorted(old.keys() | new.keys()):
        a, b = old.get(name), new.get(name)
        if a == b:
            continue
        sa, sb = summary(name, a), summary(name, b)
        if sa == sb and isinstance(a, dict) and isinstance(b, dict):
            if "digest" in a and "digest" in b and "dist" in a:
                sb = f"{sb} (files changed)"
            elif name == "cxx" and a.get("banner") != b.get("banner"):
                sa, sb = str(a.get("banner")), str(b.get("banner"))
            else:
                sa, sb = _leaf_diff(a, b)
        changes.append((name, sa, sb))
    return changes


def format_change(change: tuple[str, str, str]) -> str:
    """One line for `diff`/`why`: e.g. "triton 3.6.0 → 3.7.0", "cxx gcc 12.2.0 → 13.3.0"."""
    name, old, new = change
    if new == f"{old} (files changed)":
        return f"{name} {new}"
    head_a, _, tail_a = old.partition(" ")
    head_b, _, tail_b = new.partition(" ")
    if head_a == head_b and tail_a and tail_b:
        return f"{name} {head_a} {tail_a} → {tail_b}"
    return f"{name} {old} → {new}"
