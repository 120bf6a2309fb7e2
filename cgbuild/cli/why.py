"""`cgbuild why LABEL`: how one target's key is derived and the root cause of its status.

Root causes (what a person changed: a component, a source, a new resolution) are shown apart
from what merely propagated from them (an axis moved, so the key moved, so the store misses).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from cgbuild.cli.main import add_workspace_args, workspace
from cgbuild.cli.render import STATUS_STYLE, component_summary, console, print_json
from cgbuild.config.labels import parse_label, parse_selector
from cgbuild.core.errors import UserError
from cgbuild.core.platform import device_of
from cgbuild.identity.keys import AXES, KEY_SCHEME, strides_text

if TYPE_CHECKING:
    from cgbuild.plan.entries import PlanEntry, PlannedToolchain


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("label", help="a canonical label //family/module/graph-class@layout:sm")
    add_workspace_args(p)
    p.add_argument("--json", action="store_true", help="print the target's plan entry and its toolchain")
    p.add_argument("--no-trace", action="store_true", help="never trace: an unknown graph stays unknown")


def explain(args: argparse.Namespace) -> tuple[PlanEntry, PlannedToolchain]:
    from cgbuild.plan.planner import make_plan

    tid = parse_label(args.label)
    plan = make_plan(workspace(args), parse_selector(tid.label), run_traces=not args.no_trace)
    entry = plan.entry(tid.label)
    if entry is None:
        raise UserError(f"no target {tid.label} in the Cgfile", field="label")
    return entry, plan.toolchains[device_of(entry.sm)]


def run(args: argparse.Namespace) -> int:
    from rich.markup import escape

    entry, tc = explain(args)
    if args.json:
        print_json({"target": entry.to_json(), "toolchain": tc.to_json(), "key_scheme": KEY_SCHEME})
        return 0
    out = console()
    out.print(f"[bold]{entry.label}[/]  [{STATUS_STYLE[entry.status]}]{entry.status}[/]")
    out.print(f"  key        {entry.key or 'unknown (graph not traced)'}")
    out.print(f"             = sha256 of {KEY_SCHEME} over the identity blocks of {', '.join(AXES)}")
    for name in AXES:
        out.print(f"  {name:<10} {_describe(name, entry.axes.get(name), tc)}")
    out.print(f"  stamp      {entry.stamp}")
    out.print(f"  covers     {dict(entry.envelope)} (coverage, not a key axis)")
    out.print(f"  serves     SKUs {', '.join(entry.skus)}")
    roots = [(r.code.value, r.detail) for r in entry.reasons if r.root]
    rest = [(r.code.value, r.detail) for r in entry.reasons if not r.root]
    out.print("  root cause" + ("" if len(roots) == 1 else "s") + ":")
    for code, detail in roots or [("-", "nothing moved")]:
        out.print(f"    - {escape('[' + code + ']')} {escape(detail)}")
    if rest:
        out.print("  propagated / informational:")
        for code, detail in rest:
            out.print(f"    - {escape('[' + code + ']')} {escape(detail)}")
    return 0


def _describe(name: str, block: Mapping[str, Any] | None, tc: PlannedToolchain) -> str:
    if block is None:
        return "unknown"
    if name == "graph":
        return (
            f"digest {block['digest']}  (traced with torch {block.get('traced_with')}, "
            f"{block.get('nodes')} nodes; canonical pre-decomposition program + call contract; "
            f"inputs {strides_text(block.get('strides'))})"
        )
    if name == "sm":
        return str(block["sm"])
    if name == "toolchain":
        comps = "; ".join(f"{n} {component_summary(n, c)}" for n, c in sorted(tc.components.items()))
        return f"{block['platform']} fold {block['fold'][:16]} (source {block['source']}): {comps}"
    return (
        f"topology {block['topology'][:16]} (from {block['topology_source']}), "
        f"quant {block['quant'][:16]} ({block['quant_rule']})"
    )
