"""`cgbuild toolchain show|lock`: the compiler stack per platform, as the keys see it."""

from __future__ import annotations

import argparse
import sys

from cgbuild.cli.main import add_workspace_args, workspace
from cgbuild.cli.render import component_summary, console, print_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("show", "lock"), help="show the components, or print a lock file")
    add_workspace_args(p)
    p.add_argument("--json", action="store_true", help="show: print JSON")


def run(args: argparse.Namespace) -> int:
    from cgbuild.identity import toolchain
    from cgbuild.plan.jobs import resolve_toolchains

    ws = workspace(args)
    toolchains, source = resolve_toolchains(ws)
    if args.action == "lock":
        sys.stdout.write(toolchain.lock_text(toolchain.lock_document(toolchains)))
        return 0
    if args.json:
        print_json({"source": source, "platforms": toolchains})
        return 0
    out = console()
    out.print(f"toolchain source: {source}")
    for platform, block in toolchains.items():
        out.print(f"[bold]{platform}[/]  fold {block['fold']}")
        for name, comp in sorted(block["components"].items()):
            out.print(f"  {name:<28} {component_summary(name, comp)}")
    return 0
