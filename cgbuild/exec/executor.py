"""Where a plan's keys are minted: one interface for this machine's pool and the Ray fleet, and
the build steps every mint runs around it.

`cgbuild mint` plans, then hands the approved keys to `build`, which runs the same steps
whichever executor mints them: the shared store proven before anything compiles, the fresh keys
only this machine's cache holds published, the keys the executor can take minted (it refuses
the others by label), the keys published here remembered, the minted keys recorded as the last
state. The CLI only renders what `build` returns (`cgbuild.mint-summary/1`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from cgbuild.exec import mint
from cgbuild.exec.mint import MintKey
from cgbuild.plan.reasons import Status
from cgbuild.protocol.mint import Minted, MintFailed

if TYPE_CHECKING:
    from cgbuild.exec.held import HeldTraces
    from cgbuild.plan.entries import Plan
    from cgbuild.plan.workspace import Workspace

OnEvent = Callable[[MintKey, str], None]


class MintExecutor(Protocol):
    """Mints keys somewhere and fills each key's `result` (`Minted | MintFailed`)."""

    def take(self, keys: list[MintKey]) -> tuple[list[MintKey], list[dict[str, Any]]]:
        """The keys it can mint now, and a `refused` row (`label`, `code`, `detail`) per label
        of the others; what it holds for none of them is let go."""
        ...

    def mint_keys(self, ws: Workspace, keys: list[MintKey], on_event: OnEvent | None = None) -> list[MintKey]:
        """Mint, admit and record each key, announcing each phase to `on_event`."""
        ...


@dataclass
class Local:
    """This machine's pool: `jobs` keys at once, each in its own mint worker, the workers the
    plan held for its traces first (`cgbuild.exec.held`)."""

    jobs: int
    held: HeldTraces | None = None

    def take(self, keys: list[MintKey]) -> tuple[list[MintKey], list[dict[str, Any]]]:
        if self.held is not None:
            self.held.keep([mk.target for mk in keys])
        return keys, []

    def mint_keys(self, ws: Workspace, keys: list[MintKey], on_event: OnEvent | None = None) -> list[MintKey]:
        return mint.mint_keys(ws, keys, jobs=self.jobs, on_event=on_event, held=self.held)


def build(
    ws: Workspace,
    plan: Plan,
    executor: MintExecutor,
    refused: list[dict[str, Any]],
    events: Callable[[int], OnEvent],
) -> dict[str, Any]:
    """Mint what `plan` approved with `executor`; the `cgbuild.mint-summary/1` document.
    `refused` are the plan's own refusals (`mint --plan`); `events(n)` the progress of n keys."""
    from cgbuild.plan.planner import record_minted

    keys = mint.approved(plan, ws)
    fresh = sum(1 for t in plan.entries if t.status is Status.FRESH)
    mint.prove_shared_store(ws, keys, plan)  # a store without atomic create-only writes: exit 2
    started = time.perf_counter()
    published = mint.publish_unpublished(ws, plan)
    keys, blocked = executor.take(keys)
    results = executor.mint_keys(ws, keys, events(len(keys)))
    shared = ws.shared()
    if shared is not None:
        shared.save_seen()  # the keys published here: the next plan need not list them
    record_minted(ws, {mk.key for mk in results if mk.minted})
    return _summary(results, [*refused, *blocked], published, fresh, time.perf_counter() - started)


def _summary(
    results: list[MintKey],
    refused: list[dict[str, Any]],
    published: list[dict[str, Any]],
    fresh: int,
    seconds: float,
) -> dict[str, Any]:
    """The `cgbuild.mint-summary/1` document of one mint."""
    return {
        "schema": "cgbuild.mint-summary/1",
        "minted": _rows(results, Minted, ("admission", "phases", "device")),
        "failed": _rows(results, MintFailed, ("code", "retryable", "phase", "detail")),
        "refused": refused,
        "published": published,
        "fresh": fresh,
        "seconds": round(seconds, 3),
    }


def _rows(results: list[MintKey], kind: type, names: tuple[str, ...]) -> list[dict[str, Any]]:
    """One summary row per key whose outcome is of `kind`: its key, labels and these fields."""
    return [
        {"key": mk.key, "labels": mk.labels, **{n: getattr(mk.result, n) for n in names}}
        for mk in results
        if isinstance(mk.result, kind)
    ]
