"""`cgbuild plan [LABEL]`: a summary and the targets that need action (`--all`: every target)."""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

from .cli import add_workspace_args, workspace
from .labels import parse_selector
from .output import STATUS_STYLE, console, print_json, progress_bar


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("label", nargs="?", default="//...", help="label or selector (default: //...)")
    add_workspace_args(p)
    p.add_argument("--json", action="store_true", help="print the plan JSON (schema cgbuild.plan/1)")
    p.add_argument("-o", "--output", metavar="FILE", help="also write the plan JSON to FILE")
    p.add_argument("--all", action="store_true", help="list every target, not only those that need action")
    p.add_argument("--no-trace", action="store_true", help="never trace: unknown graphs stay 'trace'")
    p.add_argument("-j", "--jobs", type=int, help="trace workers (default: families in parallel, ≤ cores)")


def compute(args: argparse.Namespace) -> dict[str, Any]:
    from .planner import make_plan

    ws = workspace(args)
    update, close = progress_bar("tracing")
    try:
        return make_plan(
            ws, parse_selector(args.label), run_traces=not args.no_trace, workers=args.jobs, progress=update
        )
    finally:
        close()


def run(args: argparse.Namespace) -> int:
    plan = compute(args)
    if args.output:
        with open(args.output, "w") as f:
            print_json(plan, f)
    if args.json:
        print_json(plan)
        return 0
    show(plan, every=args.all)
    return 0


def show(plan: dict[str, Any], *, every: bool) -> None:
    targets = plan["targets"]
    counts = Counter(t["status"] for t in targets)
    keys = {t["key"] for t in targets if t["key"]}
    out = console()
    summary = ", ".join(
        f"[{STATUS_STYLE[s]}]{counts[s]} {s}[/]" for s in ("mint", "trace", "blocked", "fresh") if counts[s]
    )
    out.print(f"{len(targets)} targets, {len(keys)} distinct keys: {summary or 'nothing selected'}")
    rows = targets if every else [t for t in targets if t["status"] != "fresh"]
    if not rows:
        if targets:
            out.print("[green]everything is fresh[/]")
        return
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for col in ("status", "label", "key", "why"):
        table.add_column(col)
    for t in rows:
        roots = [r for r in t["reasons"] if r.get("root")] or t["reasons"]
        why = "; ".join(r["detail"] for r in roots[:2])
        table.add_row(
            f"[{STATUS_STYLE[t['status']]}]{t['status']}[/]", t["label"], (t["key"] or "-")[:12], why
        )
    out.print(table)
