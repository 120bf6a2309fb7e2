"""Which planned targets a mint may build: the plan-staleness policy of `mint --plan`.

A recorded plan (`mint --plan PLAN.json`, docs/ci.md) approved exact keys. A target whose key
moved since is refused `plan-stale`, never minted under its new identity, and only the targets
the recorded plan approved with the key planned now stay. Without a recorded plan every
selected target stays. Either way a `blocked` or `trace` target is refused with its first reason:
it cannot be minted from here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from cgbuild.core.codes import Code
from cgbuild.plan.entries import Plan
from cgbuild.plan.reasons import Status


def approve(plan: Plan, recorded: dict[str, str] | None) -> tuple[Plan, list[dict[str, Any]]]:
    """(the plan cut to what may be minted, the refusals as `{label, code, detail}`).

    `recorded`: label → key that a recorded plan approved, or None when minting what is planned."""
    refused: list[dict[str, Any]] = []
    if recorded is not None:
        for t in plan.entries:
            if t.label in recorded and t.key != recorded[t.label]:
                moved = f"{recorded[t.label][:12]} → {(t.key or 'unknown')[:12]}"
                refused.append(
                    {
                        "label": t.label,
                        "code": Code.PLAN_STALE.value,
                        "detail": f"key moved since the plan was approved ({moved})",
                    }
                )
        kept = tuple(t for t in plan.entries if recorded.get(t.label) == t.key)
        plan = dataclasses.replace(plan, entries=kept)
    for t in plan.entries:
        if t.status in (Status.BLOCKED, Status.TRACE):
            r = t.reasons[0]
            refused.append({"label": t.label, "code": r.code.value, "detail": r.detail})
    return plan, refused
