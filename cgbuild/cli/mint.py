"""`cgbuild mint LABEL`: compile, verify, seal and admit every key the label selects that must be minted.

`--plan PLAN.json` mints exactly the keys a recorded plan approved (a key that moved since is
refused, not minted under the new identity). `--check` re-mints stored keys in a fresh sandbox
and compares the bytes member by member. `--executor ray[://HOST:PORT]` sends each key to a node
of a Ray cluster that advertises its sm (docs/fleet.md); the summary and records are the same.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cgbuild.cli.main import add_workspace_args, positive_int, workspace
from cgbuild.cli.render import console, key_line, phase_times, print_json, progress_bar
from cgbuild.config.labels import Selector, parse_selector
from cgbuild.core.errors import UserError
from cgbuild.plan.reasons import Status
from cgbuild.protocol.mint import PHASES, Minted, MintFailed

if TYPE_CHECKING:
    from cgbuild.exec.fleet import ExecutorChoice
    from cgbuild.exec.held import HeldTraces
    from cgbuild.exec.mint import MintKey
    from cgbuild.plan.entries import Plan
    from cgbuild.plan.workspace import Workspace


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("label", nargs="?", help="label or selector (required unless --plan)")
    add_workspace_args(p)
    p.add_argument("--plan", metavar="PLAN.json", help="mint exactly the keys this recorded plan approved")
    p.add_argument(
        "--check", action="store_true", help="re-mint stored keys in a fresh sandbox; compare bytes"
    )
    p.add_argument(
        "-j",
        "--jobs",
        type=positive_int,
        help="keys minted at once by the local executor (default: by cores and memory)",
    )
    p.add_argument(
        "--executor",
        default="local",
        metavar="local|ray[://HOST:PORT]",
        help="where keys are minted: this machine (default) or the Ray cluster at HOST:PORT (docs/fleet.md)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON summary")


def run(args: argparse.Namespace) -> int:
    from cgbuild.exec import fleet, mint
    from cgbuild.exec.held import HeldTraces
    from cgbuild.plan.jobs import check_compiler

    if not args.label and not args.plan:
        raise UserError("name a label (e.g. //toy:cpu) or --plan PLAN.json", field="label")
    where = fleet.parse_executor(args.executor)
    if where.kind == "ray":
        if args.check:
            raise UserError(
                "--check compares bytes on this machine: run it without --executor", field="--check"
            )
        fleet.connect(where)  # before planning: an unreachable cluster fails at once
    selector = parse_selector(args.label or "//...")
    recorded = mint.recorded_plan_keys(args.plan) if args.plan else None  # bad input fails before a trace
    ws = workspace(args)
    if where.kind == "local":  # the Cgfile's compiler and store, refused before a trace
        check_compiler(ws)
        ws.writable_store()
    jobs = args.jobs or mint.default_jobs()
    held = HeldTraces(ws, jobs) if where.kind == "local" and not args.check else None
    try:
        return _mint(args, ws, where, selector, recorded, jobs, held)
    finally:
        if held is not None:
            held.close()


def _mint(
    args: argparse.Namespace,
    ws: Workspace,
    where: ExecutorChoice,
    selector: Selector,
    recorded: dict[str, str] | None,
    jobs: int,
    held: HeldTraces | None,
) -> int:
    from cgbuild.exec import fleet
    from cgbuild.exec.executor import Local, build
    from cgbuild.plan.approval import approve
    from cgbuild.plan.planner import make_plan

    update, close = progress_bar("tracing")
    try:
        plan = make_plan(ws, selector, progress=update, record=True, hold=held)
    finally:
        close()
    plan, refused = approve(plan, recorded)
    if args.check:
        return _check(args, ws, plan, refused)
    executor = fleet.Fleet() if where.kind == "ray" else Local(jobs, held)
    summary = build(ws, plan, executor, refused, _events)
    if args.json:
        print_json(summary)
    else:
        _show(summary, ws)
    unpublished = [p for p in summary["published"] if p["publish"] in ("failed", "conflict")]
    return 1 if summary["failed"] or summary["refused"] or unpublished else 0


STEPS = (*PHASES, "admitting", "done")


class PhaseClock:
    """Each key's phases in the order they happened, with the seconds each took."""

    def __init__(self) -> None:
        self._current: dict[str, tuple[str, float]] = {}
        self.history: dict[str, list[tuple[str, float]]] = {}

    def enter(self, key: str, phase: str) -> tuple[str, float] | None:
        """Start `phase` for `key`; returns the phase it ends and its seconds, if any."""
        now = time.monotonic()
        ended = None
        if key in self._current:
            last, since = self._current[key]
            ended = (last, now - since)
            self.history.setdefault(key, []).append(ended)
        self._current[key] = (phase, now)
        return ended

    def line(self, key: str, phase: str) -> str:
        done = " → ".join(f"{p} {s:.1f}s" for p, s in self.history.get(key, [])[-4:])
        return f"{done} → {phase}" if done else phase


def _events(total: int) -> Callable[[MintKey, str], None]:
    """Per key: what it is doing, in execution order with each phase's seconds ("waiting for …"
    while it waits on a free slot or the compile sandbox's lock); an overall bar with ETA on a
    terminal, one line per event otherwise."""
    import sys

    if total == 0:
        return lambda mk, phase: None
    clock = PhaseClock()
    if not sys.stderr.isatty():

        def plain(mk: Any, phase: str) -> None:
            ended = clock.enter(mk.key, phase)
            took = f" ({ended[0]} took {ended[1]:.1f} s)" if ended else ""
            print(f"mint {mk.key[:12]} {mk.labels[0]}: {phase}{took}", file=sys.stderr, flush=True)

        return plain
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from cgbuild.cli.render import console

    board = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[phase]}"),
        console=console(stderr=True),
    )
    overall = board.add_task("all keys", total=total, phase="")
    rows: dict[str, Any] = {}
    board.start()

    def step(phase: str) -> int:
        name = phase.split(":")[0]
        return STEPS.index(name) + 1 if name in STEPS else 0

    def on_event(mk: Any, phase: str) -> None:
        clock.enter(mk.key, phase)
        if mk.key not in rows:
            more = f" +{len(mk.labels) - 1}" if len(mk.labels) > 1 else ""
            rows[mk.key] = board.add_task(f"{mk.labels[0]}{more}", total=len(STEPS), phase="")
        done = len(STEPS) if phase == "failed" else step(phase)
        board.update(rows[mk.key], completed=done, phase=clock.line(mk.key, phase))
        if phase in ("done", "failed"):
            board.advance(overall)
            if board.tasks[overall].finished:
                board.stop()

    return on_event


def _show(summary: dict[str, Any], ws: Any) -> None:
    out = console()
    n_min, n_fail, n_ref = len(summary["minted"]), len(summary["failed"]), len(summary["refused"])
    out.print(
        f"{n_min} minted, {summary['fresh']} already fresh, {n_fail} failed, {n_ref} refused "
        f"({summary['seconds']:.1f} s) into {ws.cg.store_dir}"
    )
    for m in summary["minted"]:
        phases = phase_times(m["phases"])
        out.print(key_line("[green]minted[/]", m, f" ({phases})"))
    for f in summary["failed"]:
        kind = "retryable" if f["retryable"] else "deterministic"
        out.print(key_line("[red]failed[/]", f, f": {f['code']} ({kind}, phase {f['phase']}): {f['detail']}"))
    for r in summary["refused"]:
        out.print(f"  [red]refused[/] {r['label']}: {r['code']}: {r['detail']}")
    for p in summary["published"]:
        if p["publish"] == "failed":
            out.print(f"  [red]not published[/] {p['key'][:12]}: {p['code']}: {p['detail']}")
        elif p["publish"] == "conflict":
            out.print(f"  [red]not published[/] {p['key'][:12]}: the shared store holds {p['standing']}")
        else:
            out.print(f"  [green]published[/] {p['key'][:12]} from this machine's cache")


def _check(args: argparse.Namespace, ws: Any, plan: Plan, refused: list[dict[str, Any]]) -> int:
    from cgbuild.exec import mint

    keys = mint.approved(plan, ws, statuses=(Status.FRESH,))
    if not keys:
        raise UserError(
            "nothing to check: no selected target has a stored artifact (mint it first)", field="label"
        )
    bad = 0
    reports: list[dict[str, Any]] = []
    for mk in keys:
        result = mint.remint_and_compare(ws, mk)
        same = result.reproducible
        bad += not same
        compared = (result.compared if isinstance(result, Minted) else None) or {}
        moved = compared.get("verdict_moved")
        if moved and isinstance(result, Minted):
            measured = (result.lane_evidence or {}).get("measured") or {}
            moved = {**moved, "measured_ns": {lane: run["median_ns"] for lane, run in measured.items()}}
        reports.append(
            {
                "key": mk.key,
                "labels": mk.labels,
                "reproducible": same,
                "differing": compared.get("differing"),
                "fields": compared.get("fields"),
                "verdict_moved": moved,
                "error": result.to_json() if isinstance(result, MintFailed) else None,
            }
        )
    if args.json:
        print_json({"schema": "cgbuild.mint-check/1", "checks": reports, "refused": refused})
    else:
        out = console()
        for r in reports:
            if r["reproducible"] and r["verdict_moved"]:
                rec, now = r["verdict_moved"]["recorded"] or {}, r["verdict_moved"]["now"] or {}
                timings = ", ".join(
                    f"{lane} {ns / 1000:.0f} µs" for lane, ns in r["verdict_moved"]["measured_ns"].items()
                )
                out.print(
                    f"[green]build byte-identical[/] {r['key'][:12]} {' '.join(r['labels'])}; "
                    f"[yellow]lane verdict moved[/]: recorded {rec.get('winner')} ({rec.get('binding')}), "
                    f"now {now.get('winner')} ({now.get('binding')}) on {timings or 'no measurement'}: "
                    "the lanes sit near the tie band's edge on this machine, so timing noise decides "
                    "(docs/lanes.md)"
                )
            elif r["reproducible"]:
                out.print(f"[green]byte-identical[/] {r['key'][:12]} {' '.join(r['labels'])}")
            elif r["error"]:
                out.print(
                    f"[red]re-mint failed[/] {r['key'][:12]}: {r['error'].get('code')}: "
                    f"{r['error'].get('detail')}"
                )
            else:
                fields = f"; metadata fields {', '.join(r['fields'])}" if r["fields"] else ""
                out.print(
                    f"[red]differs[/] {r['key'][:12]}: members {', '.join(r['differing'] or [])}{fields}"
                )
    return 1 if bad else 0
