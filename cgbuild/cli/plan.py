"""`cgbuild plan [LABEL]`: a summary and the targets that need action (`--all`: every target)."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from cgbuild.cli.main import add_workspace_args, positive_int, workspace
from cgbuild.cli.render import STATUS_STYLE, console, progress_bar
from cgbuild.config.dims import Range
from cgbuild.config.labels import parse_selector
from cgbuild.core.codes import Code
from cgbuild.core.errors import UserError
from cgbuild.plan.reasons import Status

if TYPE_CHECKING:
    from cgbuild.plan.entries import PlanRow
    from cgbuild.plan.memo import PlanOutput


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("label", nargs="?", default="//...", help="label or selector (default: //...)")
    add_workspace_args(p)
    p.add_argument("--json", action="store_true", help="print the plan JSON (schema cgbuild.plan/1)")
    p.add_argument("-o", "--output", metavar="FILE", help="also write the plan JSON to FILE")
    p.add_argument("--all", action="store_true", help="list every target, not only those that need action")
    p.add_argument("--no-trace", action="store_true", help="never trace: unknown graphs stay 'trace'")
    p.add_argument(
        "--verify",
        action="store_true",
        help="read the ref of each key the shared store lists and count it fresh only when a trusted "
        "publisher signed it (one ref read per such key)",
    )
    p.add_argument(
        "-j", "--jobs", type=positive_int, help="trace workers (default: families in parallel, ≤ cores)"
    )
    p.add_argument(
        "--exit-code",
        action="store_true",
        help="exit 1 when anything must be minted, or is blocked by its declaration (not by this machine)",
    )


def compute(args: argparse.Namespace) -> PlanOutput:
    from cgbuild.plan.memo import plan_output

    ws = workspace(args)
    update, close = progress_bar("tracing")
    try:
        return plan_output(
            ws,
            parse_selector(args.label),
            run_traces=not args.no_trace,
            workers=args.jobs,
            progress=update,
            verify=args.verify,
        )
    finally:
        close()


def run(args: argparse.Namespace) -> int:
    out = compute(args)
    if args.output:
        try:
            with open(args.output, "w") as f:
                f.write(out.text)
        except (OSError, ValueError) as exc:  # ValueError: a NUL in the name
            raise UserError(
                f"cannot write the plan: {getattr(exc, 'strerror', None) or exc}", file=args.output
            ) from None
    if args.json:
        sys.stdout.write(out.text)
    else:
        show(out.summary(), every=args.all)
    return 1 if args.exit_code and gate(out.summary()) else 0


def gate(rows: Sequence[PlanRow]) -> list[str]:
    """Labels a CI gate fails on: each target to mint, and each blocked by its declaration or a
    failed trace. Blocked by this machine (a CPU-only torch, a card's sm floor) does not count: a
    CPU CI box blocks every GPU target so. `trace` targets do not count either: their graph cannot
    be known here (docs/plan.md)."""
    from cgbuild.plan.reasons import ENVIRONMENT_CODES

    return [
        t.label
        for t in rows
        if t.status is Status.MINT
        or (t.status is Status.BLOCKED and not any(r.code in ENVIRONMENT_CODES for r in t.roots))
    ]


ROW_LIMIT = 40
ORDER = {Status.MINT: 0, Status.TRACE: 1, Status.BLOCKED: 2, Status.FRESH: 3}


def show(targets: Sequence[PlanRow], *, every: bool) -> None:
    """Summary, root causes grouped per family (with early cutoffs), then the rows that need
    action (all rows with `--all`).

    Rows are plain text: a rich table of 10,000 rows takes seconds to lay out.
    """
    counts = Counter(t.status for t in targets)
    keys = {t.key for t in targets if t.key}
    out = console()
    summary = ", ".join(f"[{STATUS_STYLE[s]}]{counts[s]} {s}[/]" for s in ORDER if counts[s])
    out.print(f"{len(targets)} targets, {len(keys)} distinct keys: {summary or 'nothing selected'}")
    pending = sorted((t for t in targets if t.status is not Status.FRESH), key=lambda t: ORDER[t.status])
    for line in cause_lines(targets):
        out.print(line, highlight=False)
    if not pending and not every:
        if targets:
            out.print("[green]everything is fresh[/]")
        return
    rows = sorted(targets, key=lambda t: ORDER[t.status]) if every else pending[:ROW_LIMIT]
    width = max((len(t.label) for t in rows), default=0)
    lines = [
        f"{t.status:<8} {t.label:<{width}}  {(t.key or '-')[:12]:<12}  {_first_detail(t)}" + _pixel_frames(t)
        for t in rows
    ]
    sys.stdout.write("\n".join(lines) + ("\n" if lines else ""))
    if not every and len(pending) > ROW_LIMIT:
        print(
            f"... {len(pending) - ROW_LIMIT} more need action (--all lists every target, --json for machines)"
        )


def _first_detail(t: PlanRow) -> str:
    return t.roots[0].detail if t.roots else ""


def _pixel_frames(t: PlanRow) -> str:
    """The pipeline's frame count beside the label's (module) count, where the entry states it."""
    if t.pixel_frames is None:
        return ""
    declared = Range.from_json(t.pixel_frames)
    return f"  [pixel frames {declared.text if declared is not None else t.pixel_frames}]"


VERB = {Status.MINT: "re-mint", Status.TRACE: "wait for a trace", Status.BLOCKED: "blocked"}
NAMED_CAUSES = 3  # root causes named per group line; the rest are counted


def cause_lines(targets: Sequence[PlanRow]) -> list[str]:
    """Per family: how many targets need what, and why ("3 targets re-mint: toy_models.py
    changed"), and how many re-traced to an unchanged graph (early cutoff)."""
    from rich.markup import escape

    groups: dict[str, Counter[tuple[Status, tuple[tuple[str, str], ...]]]] = {}
    cutoffs: Counter[str] = Counter()
    for t in targets:
        family = t.family
        if any(r.code == Code.EARLY_CUTOFF for r in t.reasons):
            cutoffs[family] += 1
        if t.status is Status.FRESH:
            continue
        roots = tuple((r.code.value, r.detail) for r in t.roots)
        groups.setdefault(family, Counter())[(t.status, roots)] += 1
    lines = []
    for family in sorted(set(groups) | set(cutoffs)):
        lines.append(f"[bold]{escape(family)}[/]")
        causes = groups.get(family, Counter())
        for (status, roots), n in sorted(causes.items(), key=lambda kv: (ORDER[kv[0][0]], -kv[1], kv[0][1])):
            new = status is Status.MINT and all(code == Code.NEW_TARGET for code, _ in roots)
            verb = "mint" if new else VERB[status]
            named = "; ".join(detail for _, detail in roots[:NAMED_CAUSES]) + (
                f"; and {len(roots) - NAMED_CAUSES} more" if len(roots) > NAMED_CAUSES else ""
            )
            lines.append(
                f"  [{STATUS_STYLE[status]}]{n} target{'s' if n != 1 else ''} {verb}[/]: {escape(named)}"
            )
        if cutoffs[family]:
            n = cutoffs[family]
            plural = "s" if n != 1 else ""
            lines.append(f"  {n} target{plural} re-traced to an unchanged graph (early cutoff): key kept")
    return lines
