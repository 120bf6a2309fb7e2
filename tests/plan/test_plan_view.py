"""The human plan view: causes grouped once, rows capped so a 10,000-target plan stays readable."""

from __future__ import annotations

from typing import Any

import pytest

from cgbuild.cli.plan import ROW_LIMIT, show


def _plan(pending: int, fresh: int) -> dict[str, Any]:
    def target(i: int, status: str) -> dict[str, Any]:
        reasons = (
            []
            if status == "fresh"
            else [{"code": "missing-from-store", "detail": "not in the store", "root": True}]
        )
        return {
            "label": f"//fam/m/{i}x{i}-b1@fp32:cpu",
            "family": "fam",
            "status": status,
            "key": f"{i:064x}",
            "reasons": reasons,
        }

    return {
        "targets": [target(i, "mint") for i in range(pending)]
        + [target(10_000 + i, "fresh") for i in range(fresh)]
    }


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

    def target(family: str, i: int, reasons: list[dict[str, Any]]) -> dict[str, Any]:
        return {"label": f"//{family}/m/{i}", "family": family, "status": "mint", "reasons": reasons}

    moved = {"code": "trace-input-moved", "detail": "family.a.config.x changed (1 → 2)", "root": True}
    new = {"code": "new-target", "detail": "new target", "root": True}
    lines = cause_lines(
        [target("a", 1, [moved]), target("a", 2, [moved]), target("b", 3, [new]), target("a", 4, [new])]
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

    def target(label: str, status: str, code: str) -> dict[str, Any]:
        return {"label": label, "status": status, "reasons": [{"code": code, "detail": "", "root": True}]}

    plan = {
        "targets": [
            target("fresh", "fresh", "-"),
            target("gpu", "blocked", "no-cuda-torch"),
            target("floor", "blocked", "layout-below-sm-floor"),
            target("unknown", "trace", "graph-unknown"),
        ]
    }
    assert gate(plan) == []
    plan["targets"] += [
        target("mint", "mint", "missing-from-store"),
        target("mismatch", "blocked", "layout-topology-mismatch"),
        target("failed", "blocked", "trace-failed"),
    ]
    assert gate(plan) == ["mint", "mismatch", "failed"]
