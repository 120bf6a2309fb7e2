"""The plan: every selected target's key, status and the reasons for it (plan JSON, docs/plan.md).

DAG per target: sources → trace (graph digest, cached by over-keyed inputs) → toolchain fold →
key → store lookup. Traces run only on a cache miss, in child interpreters; a re-trace that
yields the same graph digest stops there (early cutoff). `fresh` comes only from a ref in the
store, never from an earlier plan; the last plan is kept to say what moved since.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cgbuild.config.cgfile import Cgfile
from cgbuild.config.labels import Selector
from cgbuild.config.targets import Target, expand, select
from cgbuild.core.canon import digest
from cgbuild.core.errors import UserError
from cgbuild.core.fs import set_aside
from cgbuild.identity import layout, toolchain
from cgbuild.identity.keys import AXES, IDENTITY_FIELDS, Axis, graph_axis, key_of, sm_axis, toolchain_axis
from cgbuild.plan import environment
from cgbuild.plan.inputs import SourceHasher
from cgbuild.plan.tracecache import TraceCache, trace_inputs
from cgbuild.protocol.trace import TraceJob, job_for, request, target_lanes
from cgbuild.store.local import Store

if TYPE_CHECKING:
    from cgbuild.store.s3 import Remote
    from cgbuild.store.shared import SharedStore

PLAN_SCHEMA = "cgbuild.plan/1"
LAST_PLAN_SCHEMA = "cgbuild.last-plan/1"

# Stable reason codes (documented in docs/plan.md).
REASON_CODES = (
    "new-target",
    "axis-moved",
    "missing-from-store",
    "malformed-ref",
    "quarantined",
    "trace-input-moved",
    "early-cutoff",
    "graph-unknown",
    "no-cuda-torch",
    "trace-failed",
    "entry-error",
    "literal-hidden",
    "worker-crashed",
    "worker-killed",
    "worker-signal",
    "oom",
    "timeout",
    "layout-below-sm-floor",
    "layout-toolchain-unsupported",
    "layout-topology-mismatch",
)


def reason(code: str, detail: str, *, root: bool, **extra: Any) -> dict[str, Any]:
    assert code in REASON_CODES, code
    return {"code": code, "detail": detail, "root": root, **{k: v for k, v in extra.items() if v is not None}}


@dataclass
class Workspace:
    cg: Cgfile
    toolchain_lock: str | None = None

    @property
    def state(self) -> Path:
        return self.cg.state_dir

    def store(self) -> Store:
        return Store(self.cg.store_dir)

    @functools.cached_property
    def remote(self) -> Remote | None:
        """The declared shared store's S3 side (one client per workspace), or None."""
        if not self.cg.remote:
            return None
        from cgbuild.store.s3 import Remote

        return Remote(self.cg.remote)

    def shared(self, local: Store | None = None) -> SharedStore | None:
        """The local store (`local`, or the workspace's) as a cache in front of the declared
        remote, with the workspace's trusted keys; None when no remote is declared, so a
        workspace without one never imports boto3 or cryptography."""
        if self.remote is None:
            return None
        from cgbuild.core.platform import host_name
        from cgbuild.store.shared import SharedStore

        return SharedStore(local or self.store(), self.remote, self.cg.trusted, host_name())


@dataclass
class TraceUnit:
    inputs: str
    job: TraceJob
    targets: list[Target] = field(default_factory=list)


def resolve_toolchains(ws: Workspace, cache_dir: Path) -> tuple[dict[str, Any], str]:
    """Toolchains per platform by precedence --toolchain > the Cgfile's lock > probing here."""
    cg = ws.cg
    try:
        return toolchain.resolve(
            ws.toolchain_lock,
            str(cg.toolchain_lock) if cg.toolchain_lock else None,
            lambda: toolchain.probe(cg.cxx, cache_path=str(cache_dir / "toolchain.json")),
        )
    except toolchain.ToolchainError as exc:
        raise UserError(exc.message, file=exc.path, line=exc.line, field=exc.field) from None


def _torch_of(block: dict[str, Any]) -> str | None:
    try:
        return toolchain.torch_version(block)
    except toolchain.ToolchainError:
        return None


def _load_last(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as e:
        set_aside(path, f"does not parse ({type(e).__name__})")
        return {}
    if not isinstance(data, dict) or data.get("schema") != LAST_PLAN_SCHEMA:
        set_aside(path, f"is no {LAST_PLAN_SCHEMA} document")
        return {}
    return data


def _save_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, sort_keys=True))
    os.replace(tmp, path)


def make_plan(
    ws: Workspace,
    selector: Selector,
    *,
    run_traces: bool = True,
    workers: int | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> dict[str, Any]:
    """Plan the selected targets; traces what is not cached (unless `run_traces` is False)."""
    cg = ws.cg
    targets = select(cg, expand(cg), selector)
    cache_dir = ws.state / "cache"
    dists = environment.installed(cache_dir / "dists.json")
    env_digest = digest(sorted(dists.items()))
    local_torch = environment.torch_build()
    toolchains, tc_source = resolve_toolchains(ws, cache_dir)
    selected_families = {t.id.family for t in targets}
    hasher = SourceHasher(cache_dir / "sources.json")
    fam_inputs = {
        name: hasher.family_inputs(cg, fam) for name, fam in cg.families.items() if name in selected_families
    }
    hasher.save()

    units: dict[str, TraceUnit] = {}
    unit_of: dict[str, str] = {}
    jobs: dict[str, TraceJob] = {}
    by_unit: dict[tuple[str, ...], str] = {}  # targets of one trace unit differ only in sm
    floors: dict[str, dict[str, Any]] = {}
    for t in targets:
        tc_block = toolchains[t.device]
        tc_torch = _torch_of(tc_block) or "absent"
        # lanes buildable on one sm may not be on another of the same device type (min_sm)
        lane_id = json.dumps(target_lanes(t, tc_block.get("components")), sort_keys=True)
        unit_id = (t.id.family, t.id.module, t.id.graph_class, t.id.layout, t.device, tc_torch, lane_id)
        inputs = by_unit.get(unit_id, "")
        if not inputs:
            job = job_for(ws.cg, t, tc_block.get("components"))
            inputs = trace_inputs(
                family_inputs=fam_inputs[t.id.family][0],
                module=t.id.module,
                spec=dict(job.spec),
                quant=job.quant,
                torch=tc_torch,
                environment=env_digest,
            )
            by_unit[unit_id] = inputs
            jobs[inputs] = job
        unit_of[t.label] = inputs
        floor = _floor(cg.layouts[t.id.layout].quant, t.id.sm, None if tc_torch == "absent" else tc_torch)
        if floor is not None:
            floors[t.label] = dict(floor)  # never minted, so never traced for its sake
            continue
        units.setdefault(inputs, TraceUnit(inputs, jobs[inputs].with_id(inputs))).targets.append(t)

    cache = TraceCache(ws.state / "traces.sqlite")
    facts = cache.get_many(list(units))
    shared = ws.shared()
    if shared is not None:  # a trace another machine published costs a listing, not a trace
        for inputs, fact in shared.pull_facts([i for i in units if i not in facts]).items():
            cache.put(inputs, fact)
            facts[inputs] = fact
    blocked: dict[str, dict[str, Any]] = {}
    graph_unknown: dict[str, dict[str, Any]] = {}
    todo: list[TraceUnit] = []
    local_version = local_torch["version"] if local_torch else None
    for inputs, unit in units.items():
        if inputs in facts:
            continue
        device = unit.job.spec["device"]
        tc_torch = _torch_of(toolchains[device])
        if local_torch is None:
            graph_unknown[inputs] = reason(
                "graph-unknown", "torch is not installed here: cannot trace", root=True
            )
        elif tc_torch != local_version:
            graph_unknown[inputs] = reason(
                "graph-unknown",
                f"toolchain torch {tc_torch} differs from the tracing torch {local_version}; "
                "no trace under that torch is cached",
                root=True,
                old=local_version,
                new=tc_torch,
            )
        elif device == "cuda" and not local_torch["cuda"]:
            blocked[inputs] = reason(
                "no-cuda-torch",
                f"torch {local_version} is a CPU-only build: CUDA graphs "
                "trace only with a CUDA build of torch (no GPU needed)",
                root=True,
            )
        elif not run_traces:
            graph_unknown[inputs] = reason("graph-unknown", "not traced yet (tracing disabled)", root=True)
        else:
            todo.append(unit)

    if todo:
        _run_traces(todo, cache, facts, blocked, workers=workers, progress=progress)
        if shared is not None:
            shared.push_facts({u.inputs: facts[u.inputs] for u in todo if u.inputs in facts})
    cache.close()

    last = _load_last(ws.state / "last-plan.json")
    last_targets: dict[str, Any] = last.get("targets", {})
    store = shared or ws.store()
    out_targets = []
    ref_states: dict[str, str] = {}
    memo: dict[tuple[str, ...], Any] = {}
    for t in targets:
        inputs = unit_of[t.label]
        entry = _plan_target(
            ws,
            t,
            inputs,
            facts.get(inputs),
            blocked.get(inputs),
            graph_unknown.get(inputs),
            floors.get(t.label),
            toolchains,
            tc_source,
            last_targets.get(t.label),
            last,
            dists,
            store,
            ref_states,
            memo,
        )
        out_targets.append(entry)

    plan = {
        "schema": PLAN_SCHEMA,
        "workspace": {"cgfile": str(cg.path), "store": str(cg.store_dir)},
        "toolchains": {
            p: {"fold": b["fold"], "source": tc_source, "components": b["components"]}
            for p, b in toolchains.items()
        },
        "targets": out_targets,
    }
    _record(ws, plan, dists, last)
    return plan


def _run_traces(
    todo: list[TraceUnit],
    cache: TraceCache,
    facts: dict[str, Any],
    blocked: dict[str, Any],
    *,
    workers: int | None,
    progress: Callable[[int, int, str], None] | None,
) -> None:
    from cgbuild.protocol.spawn import run_groups

    groups: dict[tuple[str, str], list[TraceUnit]] = {}
    for unit in todo:
        groups.setdefault((unit.job.root, unit.job.entry), []).append(unit)
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
            fact = {k: result[k] for k in ("graph_digest", "contract", "topology", "nodes", "torch")}
            facts[unit.inputs] = fact
            cache.put(unit.inputs, fact)
        else:
            code = result.get("code", "trace-failed")
            code = code if code in REASON_CODES else "trace-failed"
            blocked[unit.inputs] = reason(code, result.get("detail", "trace failed"), root=True)
        if progress:
            progress(done, total, unit.targets[0].label)

    requests = [(request([u.job for u in units]), [u.inputs for u in units]) for units in groups.values()]
    run_groups(
        "trace", requests, workers=workers or min(len(requests), os.cpu_count() or 1), on_result=on_result
    )


@functools.cache
def _floor(quant: str, sm: str, torch: str | None) -> dict[str, Any] | None:
    """The floor reason of a quant rule on an sm under a toolchain torch (docs/layouts.md), or None."""
    refusal = layout.floor_refusal(layout.QUANT_RULES[quant], sm, torch)
    return None if refusal is None else reason(refusal[0], refusal[1], root=True)


def _plan_target(
    ws: Workspace,
    t: Target,
    inputs: str,
    fact: dict[str, Any] | None,
    blocked: dict[str, Any] | None,
    unknown: dict[str, Any] | None,
    floor: dict[str, Any] | None,
    toolchains: dict[str, Any],
    tc_source: str,
    last: dict[str, Any] | None,
    last_plan: dict[str, Any],
    dists: dict[str, str],
    store: Store | SharedStore,
    ref_states: dict[str, str],
    memo: dict[tuple[str, ...], Any],
) -> dict[str, Any]:
    cg = ws.cg
    lay = cg.layouts[t.id.layout]
    quant = layout.QUANT_RULES[lay.quant]
    platform = t.device
    tc = toolchains[platform]
    # Axis objects are shared through `memo` so each renders its canonical block once per plan.
    sm_key, tc_key = ("sm", t.id.sm), ("toolchain", platform)
    if sm_key not in memo:
        memo[sm_key] = sm_axis(t.id.sm)
    if tc_key not in memo:
        memo[tc_key] = toolchain_axis(platform, tc["fold"], tc_source)
    axes: dict[str, Axis | None] = {
        "graph": None,
        "sm": memo[sm_key],
        "toolchain": memo[tc_key],
        "layout": None,
    }
    axes["layout"], mismatch = _layout_of(ws, t, inputs, fact, memo)
    if fact is not None:
        graph_key = ("graph", inputs)
        if graph_key not in memo:
            memo[graph_key] = graph_axis(fact["graph_digest"], torch=fact["torch"], nodes=fact.get("nodes"))
        axes["graph"] = memo[graph_key]
    stamp = (
        axes["layout"].readable["stamp"]
        if axes["layout"]
        else f"{t.id.family}.{t.module.component}@{layout.TOPOLOGY_SCHEME}+{quant.display}"
    )

    reasons: list[dict[str, Any]] = []
    key: str | None = None
    if floor is not None:
        status = "blocked"
        reasons.append(floor)
    elif blocked is not None:
        status = "blocked"
        reasons.append(blocked)
    elif mismatch is not None:
        status = "blocked"
        reasons.append(
            reason(
                "layout-topology-mismatch",
                f"reference checkpoint of '{t.module.component}' and the traced module disagree: {mismatch}",
                root=True,
            )
        )
    elif fact is None:
        status = "trace"
        reasons.append(unknown or reason("graph-unknown", "graph not traced", root=True))
    else:
        key = key_of({name: axis for name, axis in axes.items() if axis is not None})
        state = ref_states.get(key) or store.ref_state(key)
        ref_states[key] = state
        status = "fresh" if state == "fresh" else "mint"
        if state == "quarantined":
            reasons.append(
                reason(
                    "quarantined",
                    "the stored artifact failed verification and was "
                    "quarantined; a new verified mint repairs it",
                    root=True,
                )
            )
        elif state == "malformed":
            reasons.append(
                reason(
                    "malformed-ref",
                    "the store's ref for this key is not a ref; the next command that writes "
                    "the store (mint, verify, gc, fetch) quarantines it",
                    root=True,
                )
            )
        elif state != "fresh":
            reasons.append(
                reason(
                    "missing-from-store",
                    "no verified ref for this key in the store",
                    root=last is not None and last.get("key") == key,
                )
            )
    reasons.extend(_moved(t, key, axes, inputs, last, last_plan, toolchains, dists, memo))
    if status == "fresh":
        for r in reasons:
            r["root"] = False
    readable = {name: (axis.readable if axis else None) for name, axis in axes.items()}
    return {
        "label": t.label,
        "family": t.id.family,
        "module": t.id.module,
        "graph_class": t.id.graph_class,
        "layout": t.id.layout,
        "stamp": stamp,
        "sm": t.id.sm,
        "skus": list(t.skus),
        "envelope": t.facet,
        "key": key,
        "status": status,
        "axes": readable,
        "reasons": reasons,
        "trace_inputs": inputs,
    }


def _layout_of(
    ws: Workspace, t: Target, inputs: str, fact: dict[str, Any] | None, memo: dict[tuple[str, ...], Any]
) -> tuple[Axis | None, str | None]:
    """The layout axis and any reference-vs-trace mismatch, once per (layout, component, trace unit):
    targets of one unit differ only in sm, and topologies of real models have hundreds of rows."""
    lay = ws.cg.layouts[t.id.layout]
    component = t.module.component
    memo_key = ("layout", lay.name, t.id.family, component, inputs if fact is not None else "")
    if memo_key in memo:
        return memo[memo_key]  # type: ignore[no-any-return]
    quant = layout.QUANT_RULES[lay.quant]
    axis: Axis | None = None
    mismatch: str | None = None
    if lay.reference is not None:
        ref_key = ("reference", lay.name, component)
        if ref_key not in memo:
            topo = layout.topology_from_reference(lay.reference, component)
            memo[ref_key] = (topo, layout.topology_digest(topo))
        topo, topo_digest = memo[ref_key]
        axis = Axis(*layout.layout_axis(t.id.family, component, quant, topo_digest, "reference"))
        if fact is not None:
            mismatch = layout.topology_mismatch(topo, layout.from_trace(fact["topology"]))
    elif fact is not None:
        topo_digest = layout.topology_digest(layout.from_trace(fact["topology"]))
        axis = Axis(*layout.layout_axis(t.id.family, component, quant, topo_digest, "trace"))
    memo[memo_key] = (axis, mismatch)
    return axis, mismatch


def _moved(
    t: Target,
    key: str | None,
    axes: dict[str, Axis | None],
    inputs: str,
    last: dict[str, Any] | None,
    last_plan: dict[str, Any],
    toolchains: dict[str, Any],
    dists: dict[str, str],
    memo: dict[tuple[str, ...], Any],
) -> list[dict[str, Any]]:
    """What moved since the last recorded plan, as reasons (root causes first)."""
    if last is None:
        return [reason("new-target", "not in the last recorded plan of this workspace", root=True)]
    trace_moved = last.get("trace_inputs") != inputs
    if not trace_moved and key is not None and last.get("key") == key:
        return []  # the warm path: nothing this target depends on moved
    out: list[dict[str, Any]] = []
    if trace_moved:
        changes = _dist_changes(last_plan.get("environment", {}), dists, memo)
        detail = "trace inputs moved" + (
            f" ({'; '.join(changes[:4])})" if changes else " (family sources, entry config or rule version)"
        )
        out.append(reason("trace-input-moved", detail, root=True))
    last_axes = last.get("axes", {})
    for name in AXES:
        new = axes.get(name)
        old = last_axes.get(name)
        if new is None or old is None:
            continue
        if _identity_of(name, old) == new.identity:
            continue
        if name == "toolchain":
            old_comp = last_plan.get("toolchains", {}).get(old.get("platform"), {}).get("components", {})
            new_comp = toolchains[t.device]["components"]
            changes = toolchain.component_changes(old_comp, new_comp)
            for comp, before, after in changes or [("?", old.get("fold"), new.identity["fold"])]:
                out.append(
                    reason(
                        "axis-moved",
                        f"toolchain: {comp} {before} → {after}",
                        root=True,
                        axis=name,
                        component=comp,
                        old=before,
                        new=after,
                    )
                )
        else:
            out.append(
                reason(
                    "axis-moved",
                    f"{name}: {_short(name, old)} → {_short(name, new.readable)}",
                    root=not trace_moved or name != "graph",
                    axis=name,
                    old=_short(name, old),
                    new=_short(name, new.readable),
                )
            )
    if trace_moved and key is not None and last.get("key") == key:
        out.append(
            reason(
                "early-cutoff", "re-traced: the graph digest did not move, so neither did the key", root=False
            )
        )
    return out


def _identity_of(name: str, readable: dict[str, Any]) -> dict[str, Any]:
    return {f: readable.get(f) for f in IDENTITY_FIELDS[name]}


def _short(name: str, readable: dict[str, Any]) -> str:
    if name == "sm":
        return str(readable["sm"])
    if name == "layout":
        return f"{readable.get('stamp')} ({str(readable['topology'])[:12]}/{str(readable['quant'])[:12]})"
    return str(readable.get("digest") or readable.get("fold"))[:16]


def _dist_changes(old: dict[str, str], new: dict[str, str], memo: dict[tuple[str, ...], Any]) -> list[str]:
    """Installed distributions that changed since the last plan (once per plan, not per target)."""
    if ("dists",) in memo:
        return memo[("dists",)]  # type: ignore[no-any-return]
    memo[("dists",)] = _changed_dists(old, new)
    return memo[("dists",)]  # type: ignore[no-any-return]


def _changed_dists(old: dict[str, str], new: dict[str, str]) -> list[str]:
    out = []
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name), new.get(name)
        if a != b:
            out.append(f"{name} {a or 'absent'} → {b or 'absent'}")
    return out


def _record(ws: Workspace, plan: dict[str, Any], dists: dict[str, str], last: dict[str, Any]) -> None:
    """Keep what this plan saw, per label, so the next plan can say what moved."""
    last = {"schema": LAST_PLAN_SCHEMA, "targets": {}, **last}
    for entry in plan["targets"]:
        known = last["targets"].get(entry["label"])
        if entry["key"] is None and known is not None:
            # An unknown graph says nothing new about the key: keep the last known one, but note
            # the inputs seen, or every later plan would report them as moved again.
            known["trace_inputs"] = entry["trace_inputs"]
            continue
        last["targets"][entry["label"]] = {
            "key": entry["key"],
            "axes": entry["axes"],
            "trace_inputs": entry["trace_inputs"],
        }
    last["environment"] = dists
    last["toolchains"] = plan["toolchains"]
    _save_json(ws.state / "last-plan.json", last)
