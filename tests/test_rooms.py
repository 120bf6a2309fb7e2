"""Rooms a newcomer can find: no file in the engine, the rules or the benchmarks over 600 lines, no
function over 80 lines or taking more than 7 parameters (Triton kernels, whose parameters are the
kernel's launch contract, excepted)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_PARAMETERS = 7


def _sources() -> list[Path]:
    return sorted(p for tree in ("cgbuild", "rules", "benchmarks") for p in ROOT.glob(f"{tree}/**/*.py"))


def _is_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in node.decorator_list)


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = node.args
    names = [*a.posonlyargs, *a.args, *a.kwonlyargs]
    n = len(names) + (a.vararg is not None) + (a.kwarg is not None)
    return n - (bool(names) and names[0].arg in ("self", "cls"))


def test_no_file_is_a_catch_all() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in _sources()
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert long == {}


def test_no_function_is_too_long_or_takes_too_much() -> None:
    found = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or _is_kernel(node):
                continue
            lines = node.end_lineno - node.lineno + 1 if node.end_lineno else 0
            if lines > MAX_FUNCTION_LINES or _parameters(node) > MAX_PARAMETERS:
                where = f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
                found.append(f"{where}: {lines} lines, {_parameters(node)} parameters")
    assert found == []


def test_the_checks_see_the_code() -> None:
    """A kernel is seen and excepted; the scan reads all three trees."""
    kernels = [
        n.name
        for p in _sources()
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.FunctionDef) and _is_kernel(n)
    ]
    seen = {p.relative_to(ROOT).parts[0] for p in _sources()}
    assert kernels and any(p.parts[-2] == "mint" for p in _sources())
    assert seen == {"cgbuild", "rules", "benchmarks"}
