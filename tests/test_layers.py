"""The engine's layers, read from the imports (AST): no cycle, nothing imports a higher layer.

docs/architecture.md states the order. Imports under `if TYPE_CHECKING:` count too: a type
annotation that needs a higher layer is a design smell, not an exemption. `rules` (installed as
`cgbuild_rules`) may import the engine's lower layers only, never plan, exec or cli.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. A module's layer is its package under cgbuild/ (or the module itself).
LAYERS = ("core", "identity", "lanes", "config", "protocol", "store", "plan", "exec", "cli")
RULES_MAY_IMPORT = {"core", "identity", "lanes", "config", "protocol", "store"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "rules":
        parts[0] = "cgbuild_rules"
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str) -> set[str]:
    """Every cgbuild/cgbuild_rules module `path` (the module `module`) imports, as absolute names."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m.split(".")[0] in ("cgbuild", "cgbuild_rules")}


def _graph() -> nx.DiGraph:
    files = [*ROOT.glob("cgbuild/**/*.py"), *ROOT.glob("rules/**/*.py")]
    modules = {_module_name(f): f for f in files}
    g = nx.DiGraph()
    for name, path in modules.items():
        g.add_node(name)
        for target in _imports(path, name):
            # `from cgbuild.x import y` names a module when y is one, else the module x.
            if target in modules and target != name:
                g.add_edge(name, target)
    return g


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "cgbuild" or len(parts) < 2:
        return None
    return parts[1]


def test_every_engine_module_sits_in_a_declared_layer() -> None:
    stray = sorted(m for m in _graph() if m.startswith("cgbuild.") and _layer(m) not in LAYERS)
    assert stray == []


def test_no_import_cycle() -> None:
    g = _graph()
    # A package's __init__ re-exporting its own modules is not a cycle between layers.
    g.remove_edges_from([(a, b) for a, b in list(g.edges) if b.startswith(a + ".")])
    assert list(nx.simple_cycles(g)) == []


def test_no_engine_module_imports_a_higher_layer() -> None:
    against = [
        (a, b)
        for a, b in _graph().edges
        if _layer(a) and _layer(b) and LAYERS.index(_layer(b)) > LAYERS.index(_layer(a))  # type: ignore[arg-type]
    ]
    assert against == []


def test_rules_import_only_the_engines_lower_layers() -> None:
    against = [
        (a, b)
        for a, b in _graph().edges
        if a.startswith("cgbuild_rules") and _layer(b) and _layer(b) not in RULES_MAY_IMPORT
    ]
    assert against == []


def test_the_check_sees_a_violation(tmp_path: Path) -> None:
    """The reader resolves relative and absolute imports, so a planted upward import is found."""
    probe = tmp_path / "probe.py"
    probe.write_text("from cgbuild.cli.main import main\nimport cgbuild.exec.mint\nfrom ..plan import diff\n")
    found = _imports(probe, "cgbuild.store.probe")
    assert {"cgbuild.cli.main", "cgbuild.exec.mint", "cgbuild.plan.diff"} <= found
