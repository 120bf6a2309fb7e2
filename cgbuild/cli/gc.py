"""`cgbuild gc`: remove store objects that no ref reaches (refs are the roots), and stale temps."""

from __future__ import annotations

import argparse

from cgbuild.cli.main import add_workspace_args, workspace
from cgbuild.cli.render import print_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workspace_args(p)
    p.add_argument("--dry-run", action="store_true", help="report what would be removed")
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from cgbuild.store.local import Store

    report = Store(workspace(args).cg.store_dir).gc(dry_run=args.dry_run)
    doc = {
        "dry_run": report.dry_run,
        "objects_removed": report.objects_removed,
        "refs_dropped": report.refs_dropped,
        "refs_quarantined": report.refs_quarantined,
        "bytes_freed": report.bytes_freed,
        "temps_removed": report.temps_removed,
        "objects_kept": report.objects_kept,
        "evidence_removed": report.evidence_removed,
    }
    if args.json:
        print_json(doc)
    else:
        verb = "would remove" if report.dry_run else "removed"
        print(
            f"{verb} {len(report.objects_removed)} unreachable object(s), {report.bytes_freed} bytes; "
            f"kept {report.objects_kept}"
        )
        for key in report.refs_quarantined:
            print(f"malformed ref of {key[:12]} {'would be ' if report.dry_run else ''}quarantined")
    return 0
