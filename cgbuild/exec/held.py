"""One trace per mint: a cold `cgbuild mint` traces each unit in the worker that will compile it.

Without this, a mint of a target whose trace is not cached pays for two torch processes that
each import the model's code, build its module and export it: the plan's trace, for the graph
digest its key needs, and the compile stage's, for the program it compiles (26 s and 30 s of a
klein-4B mint on the H200, docs/benchmarks.md). Here the plan's trace of such a unit is a
`MintHold`: a mint worker starts, its compile stage traces the job where it will compile it and
reports the same graph facts the trace rule would (the cache keeps them), and the worker waits.
Once the plan has keyed the unit's targets, the worker is handed the request of a key to mint
(one of that unit, for this machine's sm) and goes on from the program it holds; a held worker
no key needs (its key is fresh: early cutoff) is told so and ends without compiling.

Holds are bounded by the local executor's slots (`limit`); the other units go to the trace rule.
Only the local executor holds (a fleet's keys mint on other machines), and never `mint --check`
(a fresh sandbox per key).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cgbuild.core.codes import Code
from cgbuild.protocol.mint import MintFailed, MintHold, MintOutcome, Phase, run_worker
from cgbuild.protocol.spawn import Channel, kill_group
from cgbuild.protocol.stage import BadMessage, Traced

if TYPE_CHECKING:
    from cgbuild.config.targets import Target
    from cgbuild.plan.planner import TraceUnit
    from cgbuild.plan.workspace import Workspace


class Held:
    """One held worker: the unit it traced, then the key it was handed (if any)."""

    def __init__(self, unit: TraceUnit, out: Path, log: Path, cxx: str | None) -> None:
        self.unit = unit
        self.labels = {t.label for t in unit.targets}
        self.request = MintHold(id=unit.inputs, job=unit.job, out=str(out), cxx=cxx).to_json()
        self.log = self._started_log = log
        self.channel = Channel()
        self.traced = threading.Event()
        self.sm: str | None = None
        self.ok = False
        self.claimed = False
        self.final: MintOutcome | None = None
        self.on_progress: Callable[[str], None] | None = None
        self._on_trace: Callable[[dict[str, Any]], None] | None = None
        self.pid: int | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self, on_trace: Callable[[dict[str, Any]], None]) -> None:
        self._on_trace = on_trace
        self.thread.start()

    def _trace(self, result: dict[str, Any]) -> None:
        """The unit's one trace result (later ones are ignored): the worker's trace line (a
        `Traced`, or the trace's failure), or, when it ended without one, its result line or
        typed end. A line that says ok but is no `Traced` is a trace failure naming its field."""
        if self.traced.is_set():
            return
        if result.get("ok") is True:
            try:
                result = Traced.from_json(result).facts()
            except BadMessage as e:
                result = {"ok": False, "code": Code.TRACE_FAILED, "detail": f"the worker's trace line: {e}"}
        self.ok = result.get("ok") is True
        self.sm = result.get("sm") if self.ok else None
        if self._on_trace is not None:  # None: the plan stopped listening (it was interrupted)
            self._on_trace({**result, "id": self.unit.inputs})
        self.traced.set()

    def _progress(self, phase: str) -> None:
        if self.on_progress is not None:
            self.on_progress(phase)

    def _run(self) -> None:
        try:
            self.final = run_worker(
                self.request,
                self.log,
                self._progress,
                on_traced=self._trace,
                channel=self.channel,
                started=self._started,
            )
        except BaseException as e:  # spawn refused to start (cgbuild is stopping)
            self.final = MintFailed(Code.WORKER_KILLED, Phase.WORKER, f"mint worker did not start: {e}")
        self._trace(self.final.to_json())  # ended before its trace (a refusal, a death): the trace's

    def _started(self, pid: int) -> None:
        self.pid = pid

    def serves(self, target: Target) -> bool:
        """Whether this worker can mint `target`'s key: it traced its unit, on its sm."""
        return self.ok and target.label in self.labels and self.sm == target.id.sm

    def complete(self, request: dict[str, Any], on_progress: Callable[[str], None] | None) -> MintOutcome:
        """Hand the worker its key's request; its result line, or its typed end."""
        self.on_progress = on_progress
        self.channel.send(request)
        self.thread.join()
        final = self.final
        assert final is not None  # the thread always ends with one
        if isinstance(final, MintFailed) and self.log != self._started_log:  # named where the log is now
            return replace(final, detail=final.detail.replace(str(self._started_log), str(self.log)))
        return final

    def stop(self) -> None:
        """No key for it: its input ends, it stops its stages and exits without a result; one
        still tracing (the plan was interrupted) is killed with its stages."""
        self._on_trace = None
        self.channel.close()
        if not self.traced.is_set() and self.pid is not None:
            kill_group(self.pid)


class HeldTraces:
    """The plan's tracer for `cgbuild mint` on this machine (the planner's `hold`)."""

    def __init__(self, ws: Workspace, limit: int) -> None:
        self.out = ws.state.build
        self.logs = ws.state.mints
        self.cxx = ws.cg.cxx
        self.limit = max(1, limit)
        self.held: list[Held] = []
        self._lock = threading.Lock()

    def trace(self, units: list[TraceUnit], on_result: Callable[[dict[str, Any]], None]) -> list[TraceUnit]:
        """Start a held worker for each of the first units (within the limit); the rest are the
        trace rule's. Each held unit gets exactly one result through `on_result`."""
        room = self.limit - len(self.held)
        mine, rest = units[:room], units[room:]
        for unit in mine:
            held = Held(unit, self.out, self.logs / f"held-{unit.inputs[:16]}.log", self.cxx)
            self.held.append(held)
            held.start(on_result)
        return rest

    def wait(self) -> None:
        """Until every held unit has its trace result (the plan then stops listening)."""
        for held in self.held:
            held.traced.wait()
            held._on_trace = None

    def keep(self, targets: list[Target]) -> None:
        """Stop, now, every held worker the keys of none of `targets` (one per key) can use."""
        for held in self.held:
            if not held.claimed and not any(held.serves(t) for t in targets):
                held.stop()

    def _free(self, target: Target) -> Held | None:
        return next((h for h in self.held if not h.claimed and h.serves(target)), None)

    def holds(self, target: Target) -> bool:
        return self._free(target) is not None

    def claim(self, target: Target, log: Path) -> Held | None:
        """The held worker that will mint `target`'s key (its log moved to `log`), or None."""
        with self._lock:
            held = self._free(target)
            if held is None:
                return None
            held.claimed = True
        log.parent.mkdir(parents=True, exist_ok=True)
        os.replace(held.log, log)  # the worker goes on writing to the same file
        held.log = log
        return held

    def close(self) -> None:
        """Stop every worker still waiting (unclaimed, or claimed by a mint that failed before
        handing it its request) and wait for each to end (it removes its folder)."""
        for held in self.held:
            if held.thread.is_alive():
                held.stop()
        deadline = time.monotonic() + 60
        for held in self.held:
            held.thread.join(max(0.0, deadline - time.monotonic()))
            if not held.claimed and held.ok:  # its trace is in the plan; a stopped worker's log is noise
                held.log.unlink(missing_ok=True)
