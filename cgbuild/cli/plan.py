"""`cgbuild plan [LABEL]`: a summary and the targets that need action (`--all`: every target)."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from typing import Any

from cgbuild.cli.main import add_workspace_args, workspace
from cgbuild.cli.render import STATUS_STYLE, console, print_json, progress_bar
from cgbuild.config.labels import parse_selector


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("label", nargs="?", default="//...", help="label or selector (default: //...)")
    add_workspace_args(p)
    p.add_argument("--json", action="store_true", help="print the plan JSON (schema cgbuild.plan/1)")
    p.add_argument("-o", "--output", metavar="FILE", help="also write the plan JSON to FILE")
    p.add_argument("--all", action="store_true", help="list every target, not only those that need action")
    p.add_argument("--no-trace", action="store_true", help="never trace: unknown graphs stay 'trace'")
    p.add_argument("-j", "--jobs", type=int, help="trace workers (default: families in parallel, ≤ cores)")


def compute(args: argparse.Namespace) -> dict[str, Any]:
    from cgbuild.plan.planner import make_plan

    ws = workspace(args)
    update, close = progress_bar("tracing")
    try:
        return make_plan(
            ws,
            parse_selector(args.label),
            run_traces=not args.no_trace,
            workers=args.jobs,
            progress=update,
            record=True,
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


ROW_LIMIT = 40
ORDER = {"mint": 0, "trace": 1, "blocked": 2, "fresh": 3}


def show(plan: dict[str, Any], *, every: bool) -> None:
    """Summary, causes grouped, then the rows that need action (all rows with `--all`).

    Rows are plain text: a rich table of 10,000 rows takes seconds to lay out.
    """
    targets = plan["targets"]
    counts = Counter(t["status"] for t in targets)
    keys = {t["key"] for t in targets if t["key"]}
    out = console()
    summary = ", ".join(
        f"[{STATUS_STYLE[s]}]{counts[s]} {s}[/]" for s in ("mint", "trace", "blocked", "fresh") if counts[s]
    )
    out.print(f"{len(targets)} targets, {len(keys)} distinct keys: {summary or 'nothing selected'}")
    pending = sorted((t for t in targets if t["status"] != "fresh"), key=lambda t: ORDER[t["status"]])
    if not pending and not every:
        if targets:
            out.print("[green]everything is fresh[/]")
        return
    causes: Counter[tuple[str, str]] = Counter()
    example: dict[tuple[str, str], str] = {}
    for t in pending:
        cause = (t["status"], _root(t)["code"])
        causes[cause] += 1
        example.setdefault(cause, _root(t)["detail"])
    for (status, code), n in sorted(causes.items(), key=lambda kv: (ORDER[kv[0][0]], -kv[1])):
        out.print(
            f"  [{STATUS_STYLE[status]}]{n:>6} {status}[/] {code}: {example[(status, code)]}", highlight=False
        )
    rows = sorted(targets, key=lambda t: ORDER[t["status"]]) if every else pending[:ROW_LIMIT]
    width = max((len(t["label"]) for t in rows), default=0)
    lines = [
        f"{t['status']:<8} {t['label']:<{width}}  {(t['key'] or '-')[:12]:<12}  {_root(t)['detail']}"
        for t in rows
    ]
    sys.stdout.write("\n".join(lines) + ("\n" if lines else ""))
    if not every and len(pending) > ROW_LIMIT:
        print(
            f"... {len(pending) - ROW_LIMIT} more need action (--all lists every target, --json for machines)"
        )


def _root(t: dict[str, Any]) -> dict[str, Any]:
    return (
        next((r for r in t["reasons"] if r.get("root")), None)
        or (t["reasons"] or [{"code": "-", "detail": ""}])[0]
    )
