"""The rule graph of a selection, as a networkx DiGraph (sources → trace → key → mint → seal).

Structural only: it reads the Cgfile, never traces. Targets that share a trace unit share its
node, so sharing is visible; the toolchain of each platform feeds every key of that platform.
"""

from __future__ import annotations

from typing import Any

import networkx as nx

from cgbuild.config.cgfile import Cgfile
from cgbuild.config.targets import Target


def rule_graph(cg: Cgfile, targets: list[Target]) -> nx.DiGraph:
    g = nx.DiGraph()
    for t in targets:
        src = f"sources://{t.id.family}"
        trace = f"trace://{t.id.family}/{t.id.module}/{t.id.graph_class}@{t.id.layout}:{t.device}"
        tc = f"toolchain://{t.device}"
        key = f"key:{t.label}"
        g.add_node(src, kind="sources", entry=t.family.entry)
        g.add_node(trace, kind="trace")
        g.add_node(tc, kind="toolchain")
        g.add_node(key, kind="key", label=t.label, skus=list(t.skus))
        g.add_node(f"mint:{t.label}", kind="mint")
        g.add_node(f"seal:{t.label}", kind="seal")
        g.add_edges_from(
            [
                (src, trace),
                (trace, key),
                (tc, key),
                (key, f"mint:{t.label}"),
                (f"mint:{t.label}", f"seal:{t.label}"),
            ]
        )
    return g


def to_dot(g: nx.DiGraph) -> str:
    """Graphviz text (written here: networkx's DOT writers need pydot or pygraphviz)."""
    shapes = {
        "sources": "folder",
        "trace": "box",
        "toolchain": "component",
        "key": "ellipse",
        "mint": "box3d",
        "seal": "note",
    }

    def q(s: str) -> str:
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'

    lines = ["digraph cgbuild {", "  rankdir=LR;"]
    for node, data in g.nodes(data=True):
        lines.append(f"  {q(node)} [shape={shapes.get(data.get('kind', ''), 'box')}];")
    for a, b in g.edges():
        lines.append(f"  {q(a)} -> {q(b)};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def to_json(g: nx.DiGraph, targets: list[Target]) -> dict[str, Any]:
    return {
        "schema": "cgbuild.query/1",
        "targets": [{"label": t.label, "skus": list(t.skus), "envelope": t.facet} for t in targets],
        "graph": nx.node_link_data(g, edges="edges"),
    }
