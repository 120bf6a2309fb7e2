"""Tests share code through `support` (tests/support/), never by importing a test module or a
conftest: such an import resolves only through the folders pytest's default import mode puts on
`sys.path`, and a test function it brings in is collected again in the importer. Read from the
imports (AST), as test_layers.py reads the engine's.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _is_test_module(name: str) -> bool:
    top = name.split(".")[0]
    return top == "conftest" or top.startswith("test_")


def imported_test_modules(path: Path) -> list[str]:
    """Every test module or conftest the file at `path` imports, absolute or relative, at any depth
    (inside functions too)."""
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if _is_test_module(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if node.module:
                found += [node.module] if _is_test_module(node.module) else []
            else:  # `from . import test_x`
                found += [a.name for a in node.names if _is_test_module(a.name)]
    return found


def test_no_module_under_tests_imports_a_test_module_or_conftest() -> None:
    against = {
        str(p.relative_to(TESTS)): names
        for p in sorted(TESTS.rglob("*.py"))
        if (names := imported_test_modules(p))
    }
    assert against == {}


def test_the_check_sees_each_form_of_import(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import test_a\nfrom test_b import x\nfrom conftest import y\nfrom . import test_c\n"
        "def f():\n    from .test_d import z\n"
        "import support.cli\nfrom hostile import w\nfrom support.minted import test_like_name\n"
    )
    assert imported_test_modules(probe) == ["test_a", "test_b", "conftest", "test_c", "test_d"]
