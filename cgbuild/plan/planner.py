"""The plan: every selected target's key, status and the reasons for it (plan JSON, docs/plan.md).

DAG per target: sources → trace (graph digest, cached by over-keyed inputs) → toolchain fold →
key → store lookup. Traces run only on a cache miss, in child interpreters; a re-trace that
yields the same graph digest stops there (early cutoff). `fresh` comes only from a ref in the
store, never from an earlier plan.

`make_plan` runs named stages over one `PlanContext`, each reading what the stages before it
filled in: select targets → resolve toolchains and inputs → group trace units → cached facts
(local, then shared) → trace what is left → per target: axes, key, status and reasons → record.

What moved is said against each target's reference in `<state>/last-plan.json` (`laststate`,
`moved`): the state it had when last seen fresh (or first seen). Only `plan` and `mint` write it
(`record=True`); a target that still needs a mint keeps its reference, so its root causes stay
until its key is fresh again, however often `plan` or `why` runs in between.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from cgbuild.config.cgfile import Cgfile
from cgbuild.config.labels import Selector
from cgbuild.config.targets import Target, expand, select
from cgbuild.core.canon import digest
from cgbuild.core.codes import Code
from cgbuild.core.errors import UserError
from cgbuild.identity import layout, quantrule, toolchain, topology
from cgbuild.identity.keys import Axis, graph_axis, key_of, sm_axis, toolchain_axis
from cgbuild.plan import environment, laststate
from cgbuild.plan.entries import Plan, PlanEntry, PlannedToolchain
from cgbuild.plan.inputs import FamilyInputs, SourceHasher
from cgbuild.plan.jobs import resolve_toolchains, trace_job
from cgbuild.plan.moved import Movement, Snapshots
from cgbuild.plan.reasons import TRUST_CODES, Reason, Status, trace_refused
from cgbuild.plan.tracecache import TraceCache, trace_inputs
from cgbuild.plan.workspace import Workspace
from cgbuild.protocol.trace import FACT_KEYS, TraceJob, request, target_lanes
from cgbuild.store.local import Store
from cgbuild.store.refs import RefState

if TYPE_CHECKING:
    from cgbuild.store.shared import SharedStore


@dataclass
class TraceUnit:
    inputs: str
    job: TraceJob
    targets: list[Target] = field(default_factory=list)


class Hold(Protocol):
    """Who traces some units instead of the trace rule (`cgbuild.exec.held.HeldTraces`)."""

    def trace(self, units: list[TraceUnit], on_result: Callable[[dict[str, Any]], None]) -> list[TraceUnit]:
        """Start tracing some of `units`, one result each through `on_result`; return the rest."""
        ...

    def wait(self) -> None:
        """Until every unit it took has its result."""
        ...


class _UnitShape(NamedTuple):
    """What a trace depends on besides the sm: targets of one unit differ only in sm."""

    family: str
    module: str
    graph_class: str
    layout: str
    device: str
    torch: str
    lanes: str


class _LayoutOf(NamedTuple):
    """One layout axis: per (layout, family, component) and trace unit (none when untraced)."""

    layout: str
    family: str
    component: str
    inputs: str


@dataclass
class PlanContext:
    """One plan's inputs and what its stages derive from them, filled in stage by stage.

    The shared values (axes, topologies, ref states) are computed once per plan and reused by
    every target that names them: a fleet of 10,000 targets has a few dozen distinct blocks."""

    ws: Workspace
    run_traces: bool = True
    workers: int | None = None
    progress: Callable[[int, int, str], None] | None = None
    verify: bool = False
    """`plan --verify`: a key fresh only by the remote's listing is fresh only once its ref's
    signature verifies against the workspace's trusted publishers."""
    hold: Hold | None = None
    """`cgbuild mint` on this machine: units traced by the workers that will mint them."""
    # select
    targets: list[Target] = field(default_factory=list)
    # resolve
    dists: dict[str, str] = field(default_factory=dict)
    env_digest: str = ""
    local_torch: dict[str, Any] | None = None
    toolchains: dict[str, Any] = field(default_factory=dict)
    tc_source: str = ""
    fam_inputs: dict[str, FamilyInputs] = field(default_factory=dict)
    now: Snapshots | None = None
    # units
    units: dict[str, TraceUnit] = field(default_factory=dict)
    unit_of: dict[str, str] = field(default_factory=dict)  # label → trace inputs
    floors: dict[str, Reason] = field(default_factory=dict)  # label → its layout's floor
    # facts (by trace inputs)
    facts: dict[str, dict[str, Any]] = field(default_factory=dict)
    blocked: dict[str, Reason] = field(default_factory=dict)
    unknown: dict[str, Reason] = field(default_factory=dict)
    shared: SharedStore | None = None
    # per target
    last: dict[str, Any] = field(default_factory=dict)
    movement: Movement | None = None
    store: Store | SharedStore | None = None
    sm_axes: dict[str, Axis] = field(default_factory=dict)
    toolchain_axes: dict[str, Axis] = field(default_factory=dict)  # by platform
    graph_axes: dict[str, Axis] = field(default_factory=dict)  # by trace inputs
    layout_axes: dict[_LayoutOf, tuple[Axis | None, str | None]] = field(default_factory=dict)
    references: dict[tuple[str, str], tuple[Any, str]] = field(default_factory=dict)
    ref_states: dict[str, RefState | Code] = field(default_factory=dict)
    refusals: dict[str, str] = field(default_factory=dict)  # key → why its remote ref is untrusted

    @property
    def cg(self) -> Cgfile:
        return self.ws.cg

    @property
    def cache_dir(self) -> Path:
        return self.ws.state.cache


def _torch_of(block: dict[str, Any]) -> str | None:
    try:
        return toolchain.torch_version(block)
    except toolchain.ToolchainError:
        return None


def make_plan(
    ws: Workspace,
    selector: Selector,
    *,
    run_traces: bool = True,
    progress: Callable[[int, int, str], None] | None = None,
    record: bool = False,
    verify: bool = False,
    hold: Hold | None = None,
) -> Plan:
    """Plan the selected targets; traces what is not cached (unless `run_traces` is False).

    `record` advances the workspace's recorded references (`plan` and `mint` only: a read-only
    command such as `why` must not consume the explanation it shows); `verify`, `hold`: see
    PlanContext."""
    ctx = PlanContext(ws, run_traces=run_traces, progress=progress, verify=verify, hold=hold)
    return plan_in_full(ctx, selector, record=record)


def plan_in_full(ctx: PlanContext, selector: Selector, *, record: bool) -> Plan:
    """Every stage over `ctx` (left filled in: the memo reads the ref states it found)."""
    ws = ctx.ws
    ctx.targets = select(ws.cg, expand(ws.cg), selector)
    _resolve_inputs(ctx)
    _group_units(ctx)
    _cached_facts(ctx)
    _trace_missing(ctx)
    _references(ctx)
    plan = _plan_document(ctx, [_plan_target(ctx, t) for t in ctx.targets])
    if record:
        assert ctx.now is not None
        laststate.record(ws.state.last_plan, plan, ctx.last, ctx.now)
    return plan


def record_minted(ws: Workspace, keys: set[str]) -> None:
    """A minted key is fresh: its targets' references become what they were planned as."""
    laststate.record_minted(ws.state.last_plan, keys)


def _resolve_inputs(ctx: PlanContext) -> None:
    """Installed distributions, the local torch, toolchains, and each selected family's inputs."""
    cg, cache_dir = ctx.cg, ctx.cache_dir
    ctx.dists = environment.installed(cache_dir / "dists.json")
    ctx.env_digest = digest(sorted(ctx.dists.items()))
    ctx.local_torch = environment.torch_build()
    ctx.toolchains, ctx.tc_source = resolve_toolchains(ctx.ws)
    selected = {t.id.family for t in ctx.targets}
    hasher = SourceHasher(cache_dir / "sources.json")
    ctx.fam_inputs = {
        name: hasher.family_inputs(cg, fam) for name, fam in cg.families.items() if name in selected
    }
    hasher.save()
    ctx.now = Snapshots.of(ctx.fam_inputs, ctx.dists, ctx.env_digest)


def _group_units(ctx: PlanContext) -> None:
    """Each target's trace inputs, and the trace units of those that may be minted: a target
    below its layout's floor is never minted, so never traced for its sake."""
    by_shape: dict[_UnitShape, str] = {}
    jobs: dict[str, TraceJob] = {}
    for t in ctx.targets:
        tc_block = ctx.toolchains[t.device]
        tc_torch = _torch_of(tc_block) or "absent"
        # lanes buildable on one sm may not be on another of the same device type (min_sm)
        program = target_lanes(t, ctx.cg.layouts[t.id.layout].quant, tc_block.get("components"))
        lanes = json.dumps(program, sort_keys=True)
        shape = _UnitShape(t.id.family, t.id.module, t.id.graph_class, t.id.layout, t.device, tc_torch, lanes)
        inputs = by_shape.get(shape, "")
        if not inputs:
            job = trace_job(ctx.ws, t, ctx.toolchains)
            inputs = trace_inputs(
                family_inputs=ctx.fam_inputs[t.id.family].digest,
                module=t.id.module,
                spec=dict(job.spec),
                quant=job.quant,
                torch=tc_torch,
                environment=ctx.env_digest,
            )
            by_shape[shape] = inputs
            jobs[inputs] = job
        ctx.unit_of[t.label] = inputs
        floor = _floor(ctx.cg.layouts[t.id.layout].quant, t.id.sm, None if tc_torch == "absent" else tc_torch)
        if floor is not None:
            ctx.floors[t.label] = floor
            continue
        ctx.units.setdefault(inputs, TraceUnit(inputs, jobs[inputs].with_id(inputs))).targets.append(t)


def _cached_facts(ctx: PlanContext) -> None:
    """Trace facts from the local cache, then from the shared store (a trace another machine
    published costs a listing, not a trace)."""
    with _trace_cache(ctx) as cache:
        ctx.facts = cache.get_many(list(ctx.units))
        ctx.shared = ctx.ws.shared()
        if ctx.shared is not None:
            for inputs, fact in ctx.shared.pull_facts([i for i in ctx.units if i not in ctx.facts]).items():
                cache.put(inputs, fact)
                ctx.facts[inputs] = fact


def _trace_missing(ctx: PlanContext) -> None:
    """Trace the units without facts that this machine can trace; say why of the others."""
    todo = [unit for unit in ctx.units.values() if unit.inputs not in ctx.facts and _traceable(ctx, unit)]
    if not todo:
        return
    with _trace_cache(ctx) as cache:
        _run_traces(
            todo, cache, ctx.facts, ctx.blocked, workers=ctx.workers, progress=ctx.progress, hold=ctx.hold
        )
    if ctx.shared is not None:
        ctx.shared.push_facts({u.inputs: ctx.facts[u.inputs] for u in todo if u.inputs in ctx.facts})
    _placed(ctx, todo)


def _placed(ctx: PlanContext, units: list[TraceUnit]) -> None:
    """A trace's refusal of a Cgfile field (`dimension-mismatch`: the entry ignores a declared
    dimension) names the file and line of that field, as a refusal of the Cgfile itself does."""
    for unit in units:
        reason = ctx.blocked.get(unit.inputs)
        if reason is None or reason.code != Code.DIMENSION_MISMATCH or not reason.component:
            continue
        t = unit.targets[0]
        key = reason.component.rsplit(".", 1)[-1]
        line = ctx.cg.lines.line("family", t.family.name, "module", t.module.name, key)
        at = f"{ctx.cg.path.name}:{line}" if line else ctx.cg.path.name
        ctx.blocked[unit.inputs] = replace(reason, detail=f"{at}: {reason.detail}")


def _traceable(ctx: PlanContext, unit: TraceUnit) -> bool:
    """Whether this machine can trace `unit`; if not, its reason is recorded where it is decided."""
    device = unit.job.spec["device"]
    tc_torch = _torch_of(ctx.toolchains[device])
    local = ctx.local_torch
    local_version = local["version"] if local else None
    if local is None:
        ctx.unknown[unit.inputs] = Reason(
            Code.GRAPH_UNKNOWN, "torch is not installed here: cannot trace", root=True
        )
    elif tc_torch != local_version:
        ctx.unknown[unit.inputs] = Reason(
            Code.GRAPH_UNKNOWN,
            f"toolchain torch {tc_torch} differs from the tracing torch {local_version}; "
            "no trace under that torch is cached",
            True,
            component="torch",
            old=local_version,
            new=tc_torch,
        )
    elif device == "cuda" and not local["cuda"]:
        ctx.blocked[unit.inputs] = Reason(
            Code.NO_CUDA_TORCH,
            f"torch {local_version} is a CPU-only build: CUDA graphs "
            "trace only with a CUDA build of torch (no GPU needed)",
            root=True,
        )
    elif not ctx.run_traces:
        ctx.unknown[unit.inputs] = Reason(Code.GRAPH_UNKNOWN, "not traced yet (tracing disabled)", root=True)
    else:
        return True
    return False


def _trace_cache(ctx: PlanContext) -> contextlib.closing[TraceCache]:
    """The workspace's trace cache, open for one stage and closed after it."""
    return contextlib.closing(TraceCache(ctx.ws.state.traces))


def _plan_document(ctx: PlanContext, entries: list[PlanEntry]) -> Plan:
    return Plan(
        {"cgfile": str(ctx.cg.path), "store": str(ctx.cg.store_dir)},
        {p: PlannedToolchain(b["fold"], ctx.tc_source, b["components"]) for p, b in ctx.toolchains.items()},
        tuple(entries),
    )


def _references(ctx: PlanContext) -> None:
    """The last plan's references, and the store the keys are looked up in."""
    assert ctx.now is not None
    ctx.last = laststate.load(ctx.ws.state.last_plan)
    ctx.movement = Movement(ctx.last, ctx.now, ctx.toolchains)
    ctx.store = ctx.shared or ctx.ws.store()


def _plan_target(ctx: PlanContext, t: Target) -> PlanEntry:
    """One target's plan entry: its axes, then its status and key with the reason that decided
    them, then what moved since its reference."""
    inputs = ctx.unit_of[t.label]
    fact = ctx.facts.get(inputs)
    axes, mismatch = _axes_of(ctx, t, inputs, fact)
    status, key, reasons = _status_of(ctx, t, inputs, fact, axes, mismatch)
    last = ctx.last.get("targets", {}).get(t.label)
    assert ctx.movement is not None
    moved = ctx.movement.since(t, key, axes, inputs, last)
    if status is Status.FRESH:
        reasons = [r.propagated() for r in reasons + moved]
    elif status in (Status.BLOCKED, Status.TRACE):  # its one root cause is what stops it, moved or not
        reasons += [r.propagated() for r in moved]
    else:
        reasons += moved
    return PlanEntry(
        label=t.label,
        family=t.id.family,
        module=t.id.module,
        graph_class=t.id.graph_class,
        layout=t.id.layout,
        stamp=_stamp(ctx, t, axes["layout"]),
        sm=t.id.sm,
        skus=tuple(t.skus),
        envelope=t.facet,
        key=key,
        status=status,
        axes={name: (axis.readable if axis else None) for name, axis in axes.items()},
        reasons=tuple(reasons),
        trace_inputs=inputs,
    )


def _stamp(ctx: PlanContext, t: Target, layout_axis: Axis | None) -> str:
    """`<family>.<component>@N+<quant>@N`, from the layout axis when it is known."""
    if layout_axis is not None:
        return str(layout_axis.readable["stamp"])
    quant = quantrule.QUANT_RULES[ctx.cg.layouts[t.id.layout].quant]
    return layout.layout_stamp(t.id.family, t.module.component, quant)


def _axes_of(
    ctx: PlanContext, t: Target, inputs: str, fact: dict[str, Any] | None
) -> tuple[dict[str, Axis | None], str | None]:
    """The target's four axes (graph and layout None while unknown) and any reference-vs-trace
    mismatch; each axis object is shared by every target naming it, so it renders once."""
    sm = ctx.sm_axes.get(t.id.sm)
    if sm is None:
        sm = ctx.sm_axes[t.id.sm] = sm_axis(t.id.sm)
    platform = t.device
    tc = ctx.toolchain_axes.get(platform)
    if tc is None:
        tc = ctx.toolchain_axes[platform] = toolchain_axis(
            platform, ctx.toolchains[platform]["fold"], ctx.tc_source
        )
    graph: Axis | None = None
    if fact is not None:
        graph = ctx.graph_axes.get(inputs)
        if graph is None:
            strides = (fact.get("contract") or {}).get("strides")
            graph = graph_axis(
                fact["graph_digest"], torch=fact["torch"], nodes=fact.get("nodes"), strides=strides
            )
            ctx.graph_axes[inputs] = graph
    lay, mismatch = _layout_of(ctx, t, inputs, fact)
    return {"graph": graph, "sm": sm, "toolchain": tc, "layout": lay}, mismatch


def _layout_of(
    ctx: PlanContext, t: Target, inputs: str, fact: dict[str, Any] | None
) -> tuple[Axis | None, str | None]:
    """The layout axis and any reference-vs-trace mismatch, once per (layout, component, trace unit):
    targets of one unit differ only in sm, and topologies of real models have hundreds of rows."""
    lay = ctx.cg.layouts[t.id.layout]
    component = t.module.component
    memo_key = _LayoutOf(lay.name, t.id.family, component, inputs if fact is not None else "")
    if memo_key in ctx.layout_axes:
        return ctx.layout_axes[memo_key]
    quant = quantrule.QUANT_RULES[lay.quant]
    axis: Axis | None = None
    mismatch: str | None = None
    if lay.reference is not None:
        ref_key = (lay.name, component)
        if ref_key not in ctx.references:
            try:
                topo = topology.topology_from_reference(lay.reference, component, lay.reading(component))
            except UserError as exc:  # the checkpoint the layout's `reference` names is refused
                raise ctx.cg.error_in(exc, "layout", lay.name, "reference") from None
            ctx.references[ref_key] = (topo, topology.topology_digest(topo))
        topo, topo_digest = ctx.references[ref_key]
        axis = layout.layout_axis(t.id.family, component, quant, topo_digest, "reference")
        if fact is not None:
            mismatch = topology.topology_mismatch(topo, topology.from_trace(fact["topology"]))
    elif fact is not None:
        topo_digest = topology.topology_digest(topology.from_trace(fact["topology"]))
        axis = layout.layout_axis(t.id.family, component, quant, topo_digest, "trace")
    ctx.layout_axes[memo_key] = (axis, mismatch)
    return axis, mismatch


def _status_of(
    ctx: PlanContext,
    t: Target,
    inputs: str,
    fact: dict[str, Any] | None,
    axes: dict[str, Axis | None],
    mismatch: str | None,
) -> tuple[Status, str | None, list[Reason]]:
    """(status, key, reasons): the first thing that stops the target decides, with its reason."""
    stop = ctx.floors.get(t.label) or ctx.blocked.get(inputs)
    if stop is not None:
        return Status.BLOCKED, None, [stop]
    if mismatch is not None:
        detail = f"reference checkpoint of '{t.module.component}' and the traced module disagree: {mismatch}"
        return Status.BLOCKED, None, [Reason(Code.LAYOUT_TOPOLOGY_MISMATCH, detail, root=True)]
    if fact is None:
        return (
            Status.TRACE,
            None,
            [ctx.unknown.get(inputs) or Reason(Code.GRAPH_UNKNOWN, "graph not traced", root=True)],
        )
    key = key_of({name: axis for name, axis in axes.items() if axis is not None})
    state = ctx.ref_states.get(key)
    if state is None:
        assert ctx.store is not None
        if ctx.verify and ctx.shared is not None:
            state, refusal = ctx.shared.verified_state(key)
            if refusal is not None:
                ctx.refusals[key] = refusal
        else:
            state = ctx.store.ref_state(key)
        ctx.ref_states[key] = state
    if state == "fresh":
        return Status.FRESH, key, []
    if state in TRUST_CODES:
        detail = f"the shared store's ref is not trusted: {ctx.refusals[key]}"
        return Status.MINT, key, [Reason(Code(state), detail, root=True)]
    last = ctx.last.get("targets", {}).get(t.label)
    return Status.MINT, key, [_store_reason(state, key, last)]


def _store_reason(state: str, key: str, last: dict[str, Any] | None) -> Reason:
    """Why a known key must be minted, by what the store holds for it."""
    if state == "quarantined":
        return Reason(
            Code.QUARANTINED,
            "the stored artifact failed verification and was quarantined; a new verified mint repairs it",
            root=True,
        )
    if state == "malformed":
        return Reason(
            Code.MALFORMED_REF,
            "the store's ref for this key is not a ref; the next command that writes "
            "the store (mint, verify, gc, fetch) quarantines it",
            root=True,
        )
    return Reason(
        Code.MISSING_FROM_STORE,
        "no verified ref for this key in the store",
        root=last is not None and not last.get("new") and last.get("key") == key,
    )


def _run_traces(
    todo: list[TraceUnit],
    cache: TraceCache,
    facts: dict[str, Any],
    blocked: dict[str, Reason],
    *,
    workers: int | None,
    progress: Callable[[int, int, str], None] | None,
    hold: Hold | None = None,
) -> None:
    from cgbuild.protocol.spawn import run_groups

    done = 0
    total = len(todo)
    by_id = {u.inputs: u for u in todo}

    lock = threading.Lock()

    def on_result(result: dict[str, Any]) -> None:
        with lock:
            _take(result)

    def _take(result: dict[str, Any]) -> None:
        nonlocal done
        done += 1
        unit = by_id[result["id"]]
        if result.get("ok"):
            fact = {k: result[k] for k in FACT_KEYS}
            facts[unit.inputs] = fact
            cache.put(unit.inputs, fact)
        else:
            blocked[unit.inputs] = trace_refused(result)
        if progress:
            progress(done, total, unit.targets[0].label)

    groups: dict[tuple[str, str], list[TraceUnit]] = {}
    for unit in todo if hold is None else hold.trace(todo, on_result):
        groups.setdefault((unit.job.root, unit.job.entry), []).append(unit)
    requests = [(request([u.job for u in units]), [u.inputs for u in units]) for units in groups.values()]
    if requests:
        run_groups(
            "trace", requests, workers=workers or min(len(requests), os.cpu_count() or 1), on_result=on_result
        )
    if hold is not None:
        hold.wait()


@functools.cache
def _floor(quant: str, sm: str, torch: str | None) -> Reason | None:
    """The floor reason of a quant rule on an sm under a toolchain torch (docs/layouts.md), or None."""
    refusal = quantrule.floor_refusal(quantrule.QUANT_RULES[quant], sm, torch)
    return None if refusal is None else Reason(refusal[0], refusal[1], root=True)
