"""`cgbuild gc`: remove store objects that no ref reaches (refs are the roots), and stale temps.

It also removes what killed mints left in the state folder's `build/` (work folders, sealed
archives never admitted, temps) once older than `--grace` seconds and no live mint's.
"""

from __future__ import annotations

import argparse

from cgbuild.cli.main import add_workspace_args, workspace
from cgbuild.cli.render import print_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workspace_args(p)
    p.add_argument("--dry-run", action="store_true", help="report what would be removed")
    p.add_argument(
        "--grace",
        type=grace_seconds,
        default=3600,
        metavar="SECONDS",
        help="leave build leftovers younger than this alone (default: 3600)",
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
    from cgbuild.exec.mint import sweep_build
    from cgbuild.store.local import Store

    ws = workspace(args)
    report = Store(ws.cg.store_dir).gc(dry_run=args.dry_run)
    build = sweep_build(ws.state, args.grace, dry_run=args.dry_run)
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
            print(f"{verb} {len(build)} leftover(s) of killed mints in {ws.state / 'build'}")
        for key in report.refs_quarantined:
            print(f"bad ref of {key[:12]} {'would be ' if report.dry_run else ''}quarantined")
    return 0
