"""Property: whatever Cgfile, plan file, lock or command line arrives, cgbuild exits 0 or 2 with
one error line, never a traceback (generators in hostile.py; a longer run is
benchmarks/soak_inputs.py)."""

from __future__ import annotations

import pytest
from hostile import Input, Workspace, argvs, cgfiles, locks, plans
from hypothesis import HealthCheck, given, settings

SETTINGS = settings(
    max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    return Workspace(tmp_path_factory.mktemp("hostile"))


def check(ws: Workspace, item: Input) -> None:
    outcome = ws.run(item)
    assert outcome.problem() is None, (item.category, item.raw[:400], outcome.problem())


@SETTINGS
@given(item=cgfiles())
def test_generated_cgfiles(ws: Workspace, item: Input) -> None:
    check(ws, item)


@SETTINGS
@given(item=plans())
def test_generated_plan_files(ws: Workspace, item: Input) -> None:
    check(ws, item)


@SETTINGS
@given(item=locks())
def test_generated_locks(ws: Workspace, item: Input) -> None:
    check(ws, item)


@SETTINGS
@given(item=argvs())
def test_generated_command_lines(ws: Workspace, item: Input) -> None:
    check(ws, item)


def test_the_valid_bases_succeed(ws: Workspace) -> None:
    """The generators mutate working documents: each base must pass, or every example is refused."""
    import json

    import tomli_w
    from hostile import CGFILE, LOCK, PLAN

    assert ws.run(Input("cgfile", "valid", tomli_w.dumps(CGFILE).encode())).code == 0
    assert ws.run(Input("lock", "valid", json.dumps(LOCK).encode())).code == 0
    assert ws.run(Input("plan", "valid", json.dumps(PLAN).encode())).code == 0
    assert ws.run(Input("argv", "query", b'["query", "//toy"]')).code == 0
