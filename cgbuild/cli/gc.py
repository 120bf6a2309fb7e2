"""`cgbuild gc`: remove store objects that no ref reaches (refs are the roots), and stale temps.

It also removes what killed mints left in the state folder's `build/` (work folders, sealed
archives never admitted, temps) once older than `--grace` seconds and no live mint's.
`gc --remote` sweeps the shared store instead (cgbuild/store/remote_gc.py, docs/store.md).
"""

from __future__ import annotations

import argparse

from cgbuild.cli.main import add_workspace_args, workspace
from cgbuild.cli.render import print_json
from cgbuild.core.errors import UserError

LOCAL_GRACE_S = 3600


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workspace_args(p)
    p.add_argument("--dry-run", action="store_true", help="report what would be removed")
    p.add_argument(
        "--grace",
        type=grace_seconds,
        metavar="SECONDS",
        help="leave build leftovers (with --remote: unreferenced shared objects) younger than this "
        f"alone (default: {LOCAL_GRACE_S}; with --remote 86400)",
    )
    p.add_argument(
        "--remote",
        action="store_true",
        help="sweep the shared store's objects no ref names and its stale incomplete uploads, "
        "not the local store",
    )
    p.add_argument(
        "--root",
        action="append",
        default=[],
        metavar="PLAN.json",
        help="with --remote: a plan whose keys are pinned as roots (repeatable)",
    )
    p.add_argument("--json", action="store_true")


def grace_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds, 0 up to ten years."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 <= value <= 10 * 365 * 86400:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected 0 to 315360000 seconds, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    if args.remote:
        return run_remote(args)
    if args.root:
        raise UserError("--root pins plans for the shared store's gc: it needs --remote", field="--root")
    from cgbuild.exec.mint import sweep_build
    from cgbuild.store.errors import StoreError

    ws = workspace(args)
    try:
        report = ws.writable_store().gc(dry_run=args.dry_run)
    except StoreError as e:  # a store gc cannot lock or lay out: named, with what to do
        raise UserError(f"{e.code}: {e.detail}") from None
    build = sweep_build(ws.state, LOCAL_GRACE_S if args.grace is None else args.grace, dry_run=args.dry_run)
    doc = {
        "dry_run": report.dry_run,
        "objects_removed": report.objects_removed,
        "refs_dropped": report.refs_dropped,
        "refs_quarantined": report.refs_quarantined,
        "bytes_freed": report.bytes_freed,
        "temps_removed": report.temps_removed,
        "objects_kept": report.objects_kept,
        "evidence_removed": report.evidence_removed,
        "build_removed": build,
    }
    if args.json:
        print_json(doc)
    else:
        verb = "would remove" if report.dry_run else "removed"
        print(
            f"{verb} {len(report.objects_removed)} unreachable object(s), {report.bytes_freed} bytes; "
            f"kept {report.objects_kept}"
        )
        if build:
            print(f"{verb} {len(build)} leftover(s) of killed mints in {ws.state.build}")
        for key in report.refs_quarantined:
            print(f"bad ref of {key[:12]} {'would be ' if report.dry_run else ''}quarantined")
    return 0


def pinned_keys(paths: list[str]) -> set[str]:
    """The keys the plan files name (each validated as a plan: exit 2 naming the file)."""
    from cgbuild.plan.diff import load_plan

    return {t.key for path in paths for t in load_plan(path).entries if t.key}


def run_remote(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from cgbuild.store.remote_gc import DEFAULT_GRACE_S, collect

    roots = pinned_keys(args.root)
    ws = workspace(args)
    shared = ws.require_shared("gc --remote sweeps a shared store, and this workspace declares no remote")
    grace = DEFAULT_GRACE_S if args.grace is None else args.grace
    report = collect(shared, grace_s=grace, roots=roots, dry_run=args.dry_run)
    if args.json:
        print_json(asdict(report))
        return 0
    verb = "would remove" if report.dry_run else "removed"
    print(
        f"{shared.remote.url}: {verb} {len(report.removed)} unreferenced object(s); kept "
        f"{report.objects_kept} named by {report.refs} ref(s), {report.kept_young} younger than "
        f"{grace:g} s, {len(report.kept_rescued)} a racing publish claimed"
    )
    if report.uploads_aborted or report.uploads_kept_young:
        verb = "would abort" if report.dry_run else "aborted"
        print(
            f"{verb} {len(report.uploads_aborted)} incomplete upload(s); kept "
            f"{report.uploads_kept_young} younger than {grace:g} s"
        )
    for key in report.quarantined:
        print(f"ref of {key[:12]} quarantined: written while its object was collected (republish it)")
    for key in report.pinned_missing:
        print(f"pinned key {key[:12]} has no ref in the shared store")
    return 0
