"""`cgbuild fetch LABEL`: bring the selection's shared artifacts into the local cache, verified.

Every selected key the remote holds and the cache lacks is pulled: its signature is checked
against the workspace's trusted publishers, its bytes against the signed sha256 (a corrupt
object is retried once, then quarantined remotely), and only then admitted locally.
Exit codes: 0 everything selected and shared is local; 1 some key was refused; 2 bad input.
"""

from __future__ import annotations

import argparse
from typing import Any

from cgbuild.cli.main import add_workspace_args, workspace
from cgbuild.cli.render import console, key_line, print_json, progress_bar
from cgbuild.config.labels import parse_selector
from cgbuild.plan.reasons import Status


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("label", nargs="?", default="//...", help="label or selector (default: //...)")
    add_workspace_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON summary (schema cgbuild.fetch/1)")


def run(args: argparse.Namespace) -> int:
    from cgbuild.plan.planner import make_plan
    from cgbuild.store.errors import StoreError
    from cgbuild.store.s3 import RemoteError

    ws = workspace(args)
    shared = ws.require_shared("this workspace declares no shared store: nothing to fetch from")
    ws.writable_store()  # what is pulled is admitted into it
    update, close = progress_bar("tracing")
    try:
        plan = make_plan(ws, parse_selector(args.label), progress=update)
    finally:
        close()
    labels: dict[str, list[str]] = {}
    for key, label in ((t.key, t.label) for t in plan.entries if t.status is Status.FRESH):
        if key:
            labels.setdefault(key, []).append(label)
    todo = [k for k in sorted(labels) if shared.local.ref_state(k) != "fresh"]
    pulled: list[dict[str, Any]] = []
    refused: list[dict[str, Any]] = []
    update, close = progress_bar("fetching")
    try:
        for i, key in enumerate(todo):
            update(i, len(todo), labels[key][0])
            try:
                got = shared.pull(key)
            except (StoreError, RemoteError) as e:  # one key's failure is reported, the rest go on
                refused.append({"key": key, "labels": labels[key], "code": e.code, "detail": e.detail})
                continue
            pulled.append({"key": key, "labels": labels[key], "size": got.ref.size, "signer": got.signer})
        update(len(todo), len(todo), "")
    finally:
        close()
    summary = {
        "schema": "cgbuild.fetch/1",
        "remote": shared.remote.url,
        "pulled": pulled,
        "refused": refused,
        "local": len(labels) - len(todo),
        "unavailable": sorted(t.label for t in plan.entries if t.status is not Status.FRESH),
    }
    if args.json:
        print_json(summary)
    else:
        _show(summary)
    return 1 if refused else 0


def _show(summary: dict[str, Any]) -> None:
    out = console()
    out.print(
        f"{len(summary['pulled'])} pulled from {summary['remote']}, {summary['local']} already local, "
        f"{len(summary['refused'])} refused, {len(summary['unavailable'])} not built anywhere yet"
    )
    for p in summary["pulled"]:
        out.print(key_line("[green]pulled[/]", p, f" (signed by {p['signer']})"))
    for r in summary["refused"]:
        out.print(key_line("[red]refused[/]", r, f": {r['code']}: {r['detail']}"))
