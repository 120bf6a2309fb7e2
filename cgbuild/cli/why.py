"""`cgbuild why LABEL`: how one target's key is derived and the root cause of its status.

Root causes (what a person changed: a component, a source, a new resolution) are shown apart
from what merely propagated from them (an axis moved, so the key moved, so the store misses).
"""

from __future__ import annotations

import argparse
from typing import Any

from cgbuild.cli.main import add_workspace_args, workspace
from cgbuild.cli.render import STATUS_STYLE, component_summary, console, print_json
from cgbuild.config.labels import parse_label, parse_selector
from cgbuild.core.errors import UserError
from cgbuild.core.platform import device_of
from cgbuild.identity.keys import AXES, KEY_SCHEME, strides_text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("label", help="a canonical label //family/module/graph-class@layout:sm")
    add_workspace_args(p)
    p.add_argument("--json", action="store_true", help="print the target's plan entry and its toolchain")
    p.add_argument("--no-trace", action="store_true", help="never trace: an unknown graph stays unknown")


def explain(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    from cgbuild.plan.planner import make_plan

    tid = parse_label(args.label)
    plan = make_plan(workspace(args), parse_selector(tid.label), run_traces=not args.no_trace)
    entry = next((t for t in plan["targets"] if t["label"] == tid.label), None)
    if entry is None:
        raise UserError(f"no target {tid.label} in the Cgfile", field="label")
    return entry, plan["toolchains"][device_of(entry["sm"])]


def run(args: argparse.Namespace) -> int:
    from rich.markup import escape

    entry, tc = explain(args)
    if args.json:
        print_json({"target": entry, "toolchain": tc, "key_scheme": KEY_SCHEME})
        return 0
    out = console()
    out.print(f"[bold]{entry['label']}[/]  [{STATUS_STYLE[entry['status']]}]{entry['status']}[/]")
    out.print(f"  key        {entry['key'] or 'unknown (graph not traced)'}")
    out.print(f"             = sha256 of {KEY_SCHEME} over the identity blocks of {', '.join(AXES)}")
    axes = entry["axes"]
    for name in AXES:
        block = axes.get(name)
        out.print(f"  {name:<10} {_describe(name, block, tc)}")
    out.print(f"  stamp      {entry['stamp']}")
    out.print(f"  covers     {entry['envelope']} (coverage, not a key axis)")
    out.print(f"  serves     SKUs {', '.join(entry['skus'])}")
    roots = [r for r in entry["reasons"] if r.get("root")]
    rest = [r for r in entry["reasons"] if not r.get("root")]
    out.print("  root cause" + ("" if len(roots) == 1 else "s") + ":")
    for r in roots or [{"code": "-", "detail": "nothing moved"}]:
        out.print(f"    - {escape('[' + r['code'] + ']')} {escape(r['detail'])}")
    if rest:
        out.print("  propagated / informational:")
        for r in rest:
            out.print(f"    - {escape('[' + r['code'] + ']')} {escape(r['detail'])}")
    return 0


def _describe(name: str, block: dict[str, Any] | None, tc: dict[str, Any]) -> str:
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
        comps = "; ".join(f"{n} {component_summary(n, c)}" for n, c in sorted(tc["components"].items()))
        return f"{block['platform']} fold {block['fold'][:16]} (source {block['source']}): {comps}"
    return (
        f"topology {block['topology'][:16]} (from {block['topology_source']}), "
        f"quant {block['quant'][:16]} ({block['quant_rule']})"
    )
