"""The human plan view: causes grouped once, rows capped so a 10,000-target plan stays readable."""

from __future__ import annotations

import pytest

from cgbuild.cli.plan import ROW_LIMIT, show
from cgbuild.core.codes import Code
from cgbuild.plan.entries import PlanRow
from cgbuild.plan.reasons import Reason, Status


def row(label: str, status: Status, *codes: Code, family: str = "fam", detail: str = "") -> PlanRow:
    reasons = tuple(Reason(code, detail, root=True) for code in codes)
    return PlanRow(label, family, status, None, reasons)


def _plan(pending: int, fresh: int) -> list[PlanRow]:
    def target(i: int, status: Status) -> PlanRow:
        codes = () if status is Status.FRESH else (Code.MISSING_FROM_STORE,)
        reasons = tuple(Reason(code, "not in the store", root=True) for code in codes)
        return PlanRow(f"//fam/m/{i}x{i}-b1@fp32:cpu", "fam", status, f"{i:064x}", reasons)

    return [target(i, Status.MINT) for i in range(pending)] + [
        target(10_000 + i, Status.FRESH) for i in range(fresh)
    ]


def _rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(("mint ", "fresh "))]


def test_rows_that_need_action_are_capped(capsys: pytest.CaptureFixture[str]) -> None:
    show(_plan(ROW_LIMIT + 60, 5), every=False)
    out = capsys.readouterr().out
    assert len(_rows(out)) == ROW_LIMIT
    assert "... 60 more need action" in out
    assert f"{ROW_LIMIT + 60} mint" in out  # the grouped cause still counts every target


def test_all_lists_every_target_uncapped(capsys: pytest.CaptureFixture[str]) -> None:
    show(_plan(ROW_LIMIT + 60, 5), every=True)
    out = capsys.readouterr().out
    assert len(_rows(out)) == ROW_LIMIT + 65
    assert "more need action" not in out


def test_no_cap_note_under_the_limit(capsys: pytest.CaptureFixture[str]) -> None:
    show(_plan(3, 0), every=False)
    out = capsys.readouterr().out
    assert len(_rows(out)) == 3
    assert "more need action" not in out


def test_causes_are_grouped_per_family_and_new_targets_say_mint() -> None:
    from cgbuild.cli.plan import cause_lines

    moved = {"detail": "family.a.config.x changed (1 → 2)"}
    lines = cause_lines(
        [
            row("//a/m/1", Status.MINT, Code.TRACE_INPUT_MOVED, family="a", **moved),
            row("//a/m/2", Status.MINT, Code.TRACE_INPUT_MOVED, family="a", **moved),
            row("//b/m/3", Status.MINT, Code.NEW_TARGET, family="b", detail="new target"),
            row("//a/m/4", Status.MINT, Code.NEW_TARGET, family="a", detail="new target"),
        ]
    )
    assert [line.replace("[bold]", "").split("[/]")[0] for line in lines] == [
        "a",
        "  [yellow]2 targets re-mint",
        "  [yellow]1 target mint",
        "b",
        "  [yellow]1 target mint",
    ]
    assert lines[1].endswith(": family.a.config.x changed (1 → 2)")


def test_exit_code_gate_counts_mints_and_declared_blocks_not_this_machine() -> None:
    from cgbuild.cli.plan import gate

    rows = [
        row("fresh", Status.FRESH),
        row("gpu", Status.BLOCKED, Code.NO_CUDA_TORCH),
        row("floor", Status.BLOCKED, Code.LAYOUT_BELOW_SM_FLOOR),
        row("unknown", Status.TRACE, Code.GRAPH_UNKNOWN),
    ]
    assert gate(rows) == []
    rows += [
        row("mint", Status.MINT, Code.MISSING_FROM_STORE),
        row("mismatch", Status.BLOCKED, Code.LAYOUT_TOPOLOGY_MISMATCH),
        row("failed", Status.BLOCKED, Code.TRACE_FAILED),
    ]
    assert gate(rows) == ["mint", "mismatch", "failed"]
