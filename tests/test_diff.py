"""Rendering a plan diff: what each tag tells a reviewer."""

from __future__ import annotations

from typing import Any

from cgbuild.plan.diff import diff_plans, render


def _target(label: str, key: str) -> dict[str, Any]:
    axes = {"graph": {"digest": key}, "sm": {"sm": "cpu"}, "toolchain": {"fold": "f"}, "layout": None}
    return {"label": label, "family": "toy", "sm": "cpu", "key": key, "axes": axes}


def test_brand_new_targets_are_tagged_mint_and_moved_ones_re_mint() -> None:
    base = {"schema": "cgbuild.plan/1", "targets": [_target("//toy/a", "1" * 64)]}
    head = {
        "schema": "cgbuild.plan/1",
        "targets": [_target("//toy/a", "2" * 64), _target("//toy/b", "3" * 64)],
    }
    text = render(diff_plans(base, head), "text")
    assert "  moved    //toy/a [re-mint]: graph: " in text
    assert "  added    //toy/b [mint]: new target" in text
    markdown = render(diff_plans(base, head), "markdown")
    assert "| added (mint) | `//toy/b` |" in markdown and "| moved (re-mint) | `//toy/a` |" in markdown
