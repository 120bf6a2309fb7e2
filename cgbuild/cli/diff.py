"""`cgbuild diff BASE.json HEAD.json`: what a change would re-mint, per family and per target."""

from __future__ import annotations

import argparse
import sys

from cgbuild.cli.render import print_json
from cgbuild.plan.diff import diff_plans, load_plan, render


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("base", help="plan JSON of the base (e.g. main)")
    p.add_argument("head", help="plan JSON of the head (e.g. the toolchain bump)")
    p.add_argument("--format", choices=("text", "markdown", "json"), default="text")
    p.add_argument("--exit-code", action="store_true", help="exit 1 when anything must be re-minted")


def run(args: argparse.Namespace) -> int:
    d = diff_plans(load_plan(args.base), load_plan(args.head))
    if args.format == "json":
        print_json(d)
    else:
        sys.stdout.write(render(d, args.format))
    return 1 if args.exit_code and d["remint"] else 0
