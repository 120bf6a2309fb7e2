"""`cgbuild query LABEL`: the targets a label selects and their rule graph (text, json, dot)."""

from __future__ import annotations

import argparse
import sys

from cgbuild.cli.main import add_workspace_args, workspace
from cgbuild.cli.render import print_json
from cgbuild.config.labels import parse_selector
from cgbuild.config.targets import expand, select


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("label", nargs="?", default="//...")
    add_workspace_args(p)
    p.add_argument("--output", choices=("text", "json", "dot"), default="text")
    p.add_argument("--deps", action="store_true", help="text output: also list each target's rule chain")


def run(args: argparse.Namespace) -> int:
    from cgbuild.plan.query import rule_graph, to_dot, to_json

    ws = workspace(args, writes_state=False)  # reads the Cgfile only
    targets = select(ws.cg, expand(ws.cg), parse_selector(args.label))
    g = rule_graph(ws.cg, targets)
    if args.output == "json":
        print_json(to_json(g, targets))
    elif args.output == "dot":
        sys.stdout.write(to_dot(g))
    else:
        for t in targets:
            print(t.label)
            if args.deps:
                import networkx as nx

                for dep in sorted(nx.ancestors(g, f"key:{t.label}")):
                    print(f"  <- {dep}")
    return 0
