"""The plan: every selected target's key, status and the reasons for it (plan JSON, docs/plan.md).

DAG per target: sources → trace (graph digest, cached by over-keyed inputs) → toolchain fold →
key → store lookup. Traces run only on a cache miss, in child interpreters; a re-trace that
yields the same graph digest stops there (early cutoff). `fresh` comes only from a ref in the
store, never from an earlier plan.

What moved is said against each target's reference in `<state>/last-plan.json`: the state it had
when last seen fresh (or first seen). Only `plan` and `mint` write it (`record=True`); a target
that still needs a mint keeps its reference, so its root causes stay until its key is fresh
again, however often `plan` or `why` runs in between.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cgbuild.config.cgfile import Cgfile
from cgbuild.config.labels import Selector
from cgbuild.config.targets import Target, expand, select
from cgbuild.core import statefile
from cgbuild.core.canon import digest
from cgbuild.core.errors import UserError
from cgbuild.identity import layout, toolchain
from cgbuild.identity.keys import AXES, IDENTITY_FIELDS, Axis, graph_axis, key_of, sm_axis, toolchain_axis
from cgbuild.plan import environment, laststate
from cgbuild.plan import reasons as why
from cgbuild.plan.inputs import SourceHasher
from cgbuild.plan.reasons import REASON_CODES, Reason
from cgbuild.plan.tracecache import TRACE_RULE_VERSION, TraceCache, trace_inputs
from cgbuild.protocol.trace import TraceJob, job_for, request, target_lanes
from cgbuild.store.local import Store

if TYPE_CHECKING:
    from cgbuild.store.s3 import Remote
    from cgbuild.store.shared import SharedStore

PLAN_SCHEMA = "cgbuild.plan/1"
LAST_PLAN_SCHEMA = "cgbuild.last-plan/2"


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
    doc = statefile.read_json(path, lambda d: laststate.valid(d, LAST_PLAN_SCHEMA), "last plan")
    return doc or {}


def _save_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, sort_keys=True, default=str))  # a TOML date in a config
    os.replace(tmp, path)


def make_plan(
    ws: Workspace,
    selector: Selector,
    *,
    run_traces: bool = True,
    workers: int | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    record: bool = False,
) -> dict[str, Any]:
    """Plan the selected targets; traces what is not cached (unless `run_traces` is False).

    `record` advances the workspace's recorded references (`plan` and `mint` only: a read-only
    command such as `why` must not consume the explanation it shows)."""
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
    now = Snapshots.of(cg, fam_inputs, dists, env_digest)

    units: dict[str, TraceUnit] = {}
    unit_of: dict[str, str] = {}
    jobs: dict[str, TraceJob] = {}
    by_unit: dict[tuple[str, ...], str] = {}  # targets of one trace unit differ only in sm
    floors: dict[str, Reason] = {}
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
            floors[t.label] = floor  # never minted, so never traced for its sake
            continue
        units.setdefault(inputs, TraceUnit(inputs, jobs[inputs].with_id(inputs))).targets.append(t)

    cache = TraceCache(ws.state / "traces.sqlite")
    facts = cache.get_many(list(units))
    shared = ws.shared()
    if shared is not None:  # a trace another machine published costs a listing, not a trace
        for inputs, fact in shared.pull_facts([i for i in units if i not in facts]).items():
            cache.put(inputs, fact)
            facts[inputs] = fact
    blocked: dict[str, Reason] = {}
    graph_unknown: dict[str, Reason] = {}
    todo: list[TraceUnit] = []
    local_version = local_torch["version"] if local_torch else None
    for inputs, unit in units.items():
        if inputs in facts:
            continue
        device = unit.job.spec["device"]
        tc_torch = _torch_of(toolchains[device])
        if local_torch is None:
            graph_unknown[inputs] = Reason(
                "graph-unknown", "torch is not installed here: cannot trace", root=True
            )
        elif tc_torch != local_version:
            graph_unknown[inputs] = Reason(
                "graph-unknown",
                f"toolchain torch {tc_torch} differs from the tracing torch {local_version}; "
                "no trace under that torch is cached",
                True,
                component="torch",
                old=local_version,
                new=tc_torch,
            )
        elif device == "cuda" and not local_torch["cuda"]:
            blocked[inputs] = Reason(
                "no-cuda-torch",
                f"torch {local_version} is a CPU-only build: CUDA graphs "
                "trace only with a CUDA build of torch (no GPU needed)",
                root=True,
            )
        elif not run_traces:
            graph_unknown[inputs] = Reason("graph-unknown", "not traced yet (tracing disabled)", root=True)
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
    memo: dict[tuple[str, ...], Any] = {("dists",): dists}
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
            now,
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
    if record:
        _record(ws, plan, last, now)
    return plan


def _run_traces(
    todo: list[TraceUnit],
    cache: TraceCache,
    facts: dict[str, Any],
    blocked: dict[str, Reason],
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
            blocked[unit.inputs] = Reason(code, result.get("detail", "trace failed"), root=True)
        if progress:
            progress(done, total, unit.targets[0].label)

    requests = [(request([u.job for u in units]), [u.inputs for u in units]) for units in groups.values()]
    run_groups(
        "trace", requests, workers=workers or min(len(requests), os.cpu_count() or 1), on_result=on_result
    )


@functools.cache
def _floor(quant: str, sm: str, torch: str | None) -> Reason | None:
    """The floor reason of a quant rule on an sm under a toolchain torch (docs/layouts.md), or None."""
    refusal = layout.floor_refusal(layout.QUANT_RULES[quant], sm, torch)
    return None if refusal is None else Reason(refusal[0], refusal[1], root=True)


def _plan_target(
    ws: Workspace,
    t: Target,
    inputs: str,
    fact: dict[str, Any] | None,
    blocked: Reason | None,
    unknown: Reason | None,
    floor: Reason | None,
    toolchains: dict[str, Any],
    tc_source: str,
    last: dict[str, Any] | None,
    last_plan: dict[str, Any],
    now: Snapshots,
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

    reasons: list[Reason] = []
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
            Reason(
                "layout-topology-mismatch",
                f"reference checkpoint of '{t.module.component}' and the traced module disagree: {mismatch}",
                root=True,
            )
        )
    elif fact is None:
        status = "trace"
        reasons.append(unknown or Reason("graph-unknown", "graph not traced", root=True))
    else:
        key = key_of({name: axis for name, axis in axes.items() if axis is not None})
        state = ref_states.get(key) or store.ref_state(key)
        ref_states[key] = state
        status = "fresh" if state == "fresh" else "mint"
        if state == "quarantined":
            reasons.append(
                Reason(
                    "quarantined",
                    "the stored artifact failed verification and was "
                    "quarantined; a new verified mint repairs it",
                    root=True,
                )
            )
        elif state == "malformed":
            reasons.append(
                Reason(
                    "malformed-ref",
                    "the store's ref for this key is not a ref; the next command that writes "
                    "the store (mint, verify, gc, fetch) quarantines it",
                    root=True,
                )
            )
        elif state != "fresh":
            reasons.append(
                Reason(
                    "missing-from-store",
                    "no verified ref for this key in the store",
                    root=last is not None and not last.get("new") and last.get("key") == key,
                )
            )
    moved = _moved(t, key, axes, inputs, last, last_plan, now, toolchains, memo)
    if status == "fresh":
        reasons = [r.propagated() for r in reasons + moved]
    elif status in ("blocked", "trace"):  # its one root cause is what stops it, moved or not
        reasons += [r.propagated() for r in moved]
    else:
        reasons += moved
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
        "reasons": [r.to_json() for r in reasons],
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
            topo = layout.topology_from_reference(lay.reference, component, lay.reading(component))
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
    now: Snapshots,
    toolchains: dict[str, Any],
    memo: dict[tuple[str, ...], Any],
) -> list[Reason]:
    """What moved since the target's recorded reference, as reasons (root causes first)."""
    if last is None:
        return [why.Reason("new-target", "new target: not in this workspace's recorded plans", True)]
    out: list[Reason] = []
    if last.get("new"):  # never fresh since first seen
        out.append(why.Reason("new-target", "new target: not minted since it first appeared in a plan", True))
    trace_moved = last.get("trace_inputs") != inputs
    if not trace_moved and key is not None and last.get("key") == key:
        return out  # the warm path: nothing this target depends on moved
    last_axes = last.get("axes", {})
    new_graph, old_graph = axes.get("graph"), last_axes.get("graph")
    cutoff = trace_moved and new_graph is not None and old_graph is not None
    cutoff = cutoff and _identity_of("graph", old_graph) == new_graph.identity  # type: ignore[union-attr]
    if trace_moved:
        new_torch = new_graph.readable.get("traced_with") if new_graph is not None else None
        out.extend(_inputs_moved(t, last, last_plan, now, new_torch, memo, root=not cutoff))
    for name in AXES:
        new = axes.get(name)
        old = last_axes.get(name)
        if new is None or old is None:
            continue
        if _identity_of(name, old) == new.identity:
            continue
        if name == "toolchain":
            old_comp = last_plan.get("toolchains", {}).get(old.get("fold"), {})
            new_comp = toolchains[t.device]["components"]
            changes = toolchain.component_changes(old_comp, new_comp)
            for comp, before, after in changes or [("fold", old.get("fold"), new.identity["fold"])]:
                out.append(why.axis_moved(name, str(before), str(after), root=True, component=comp))
        else:
            # the graph, and a topology read from the trace, move because the trace inputs did
            traced = name == "graph" or new.readable.get("topology_source") == "trace"
            root = not (trace_moved and traced)
            out.append(why.axis_moved(name, _short(name, old), _short(name, new.readable), root=root))
    if cutoff:
        out.append(why.early_cutoff())
    return out


def _inputs_moved(
    t: Target,
    last: dict[str, Any],
    last_plan: dict[str, Any],
    now: Snapshots,
    new_torch: str | None,
    memo: dict[tuple[str, ...], Any],
    *,
    root: bool,
) -> list[Reason]:
    """The trace inputs that moved, each by name; computed once per (old, new) snapshot pair,
    not per target (a family's thousand targets share them)."""
    fam = t.id.family
    old_fam, old_env = last.get("fam"), last.get("env")
    old_torch = (last.get("axes", {}).get("graph") or {}).get("traced_with")
    memo_key = ("moved", fam, str(old_fam), str(old_env), str(old_torch), str(new_torch), str(root))
    if memo_key in memo:
        return memo[memo_key]  # type: ignore[no-any-return]
    out: list[Reason] = []
    before = last_plan.get("families", {}).get(old_fam)
    after = now.families[now.fam_ids[fam]]
    if before is not None and old_fam != now.fam_ids[fam]:
        out.extend(_family_moved(fam, before, after, root=root))
    env_before = last_plan.get("environments", {}).get(old_env)
    if env_before is not None and old_env != now.env_id:
        for name in ("rule", "python"):
            if env_before.get(name) != now.env[name]:
                label = "trace-rule" if name == "rule" else "python"
                out.append(why.version_moved(label, str(env_before.get(name)), str(now.env[name]), root=root))
        dists = _changed_dists(env_before.get("dists", {}), now.env["dists"])
        out.extend(why.version_moved(n, a, b, root=root) for n, a, b in dists[:MAX_NAMED])
        if len(dists) > MAX_NAMED:
            out.append(why.more_moved(len(dists) - MAX_NAMED, "distributions", root=root))
    if old_torch and new_torch and old_torch != new_torch:
        out.append(why.version_moved("torch (tracing)", old_torch, new_torch, root=root))
    memo[memo_key] = out or [why.unnamed_inputs_moved(root=root)]
    return memo[memo_key]  # type: ignore[no-any-return]


MAX_NAMED = 6  # moved distributions (or files) named per target; the rest are counted


def _family_moved(fam: str, before: dict[str, Any], after: dict[str, Any], *, root: bool) -> list[Reason]:
    out: list[Reason] = []
    if before.get("entry") != after["entry"]:
        out.append(why.setting_moved(f"family.{fam}.entry", before.get("entry"), after["entry"], root=root))
    old_cfg = dict(_flatten(before.get("config") or {}, f"family.{fam}.config"))
    new_cfg = dict(_flatten(after["config"], f"family.{fam}.config"))
    for path in sorted(set(old_cfg) | set(new_cfg)):
        if old_cfg.get(path, _ABSENT) != new_cfg.get(path, _ABSENT):
            out.append(why.setting_moved(path, old_cfg.get(path), new_cfg.get(path), root=root))
    if before.get("lanes") != after["lanes"]:
        out.append(why.setting_moved(f"family.{fam}.lanes", before.get("lanes"), after["lanes"], root=root))
    old_files, new_files = before.get("files") or {}, after["files"]
    files = [p for p in sorted(set(old_files) | set(new_files)) if old_files.get(p) != new_files.get(p)]
    out.extend(why.file_moved(p, old_files.get(p), new_files.get(p), root=root) for p in files[:MAX_NAMED])
    if len(files) > MAX_NAMED:
        out.append(why.more_moved(len(files) - MAX_NAMED, "files", root=root))
    return out


_ABSENT = object()


def _flatten(value: Any, prefix: str) -> list[tuple[str, Any]]:
    """Config as (key path, leaf value) pairs: `family.toy.config.unet.attention_head_dim`."""
    if isinstance(value, dict) and value:
        return [pair for k, v in value.items() for pair in _flatten(v, f"{prefix}.{k}")]
    return [(prefix, value)]


def _identity_of(name: str, readable: dict[str, Any]) -> dict[str, Any]:
    return {f: readable.get(f) for f in IDENTITY_FIELDS[name]}


def _short(name: str, readable: dict[str, Any]) -> str:
    if name == "sm":
        return str(readable["sm"])
    if name == "layout":
        return f"{readable.get('stamp')} ({str(readable['topology'])[:12]}/{str(readable['quant'])[:12]})"
    return str(readable.get("digest") or readable.get("fold"))[:16]


def _changed_dists(old: dict[str, str], new: dict[str, str]) -> list[tuple[str, str | None, str | None]]:
    return [(n, old.get(n), new.get(n)) for n in sorted(set(old) | set(new)) if old.get(n) != new.get(n)]


@dataclass(frozen=True)
class Snapshots:
    """What this plan's trace inputs are made of, by name, once per family and once for the
    environment: the record keeps one copy of each, so reasons can name what moved."""

    env_id: str
    env: dict[str, Any]
    fam_ids: dict[str, str]
    families: dict[str, dict[str, Any]]

    @classmethod
    def of(
        cls, cg: Cgfile, fam_inputs: dict[str, tuple[str, dict[str, str]]], dists: dict[str, str], env: str
    ) -> Snapshots:
        python = f"{sys.version_info.major}.{sys.version_info.minor}"
        env_block = {"dists": dists, "rule": TRACE_RULE_VERSION, "python": python}
        fam_ids: dict[str, str] = {}
        families: dict[str, dict[str, Any]] = {}
        for name, (fam_digest, files) in fam_inputs.items():
            fam = cg.families[name]
            snap = {
                "entry": fam.entry,
                "config": fam.config,
                "lanes": [[axis, list(values)] for axis, values in fam.lanes],
                "files": files,
            }
            fam_ids[name] = digest([fam_digest, snap["lanes"]])[:16]
            families[fam_ids[name]] = snap
        return cls(digest([env, TRACE_RULE_VERSION, python])[:16], env_block, fam_ids, families)


def _record(ws: Workspace, plan: dict[str, Any], last: dict[str, Any], snaps: Snapshots) -> None:
    """Advance each planned target's reference: a fresh target's becomes what it is now; one that
    still needs a mint keeps its own (its root causes stand until it is fresh), with what it is
    now kept apart (`pending`) so a mint of that key can advance it (`record_minted`)."""
    refs: dict[str, Any] = dict(last.get("targets", {}))
    pending: dict[str, Any] = dict(last.get("pending", {}))
    for entry in plan["targets"]:
        label = entry["label"]
        now = {
            "key": entry["key"],
            "axes": entry["axes"],
            "trace_inputs": entry["trace_inputs"],
            "env": snaps.env_id,
            "fam": snaps.fam_ids[entry["family"]],
        }
        ref = refs.get(label)
        pending.pop(label, None)
        if entry["status"] == "fresh":
            refs[label] = now
            continue
        if ref is None:
            refs[label] = {**now, "new": True}
        elif entry["key"] is None:
            # An unknown graph says nothing new about the key: keep the last known one, but note
            # the inputs seen, or every later plan would report them as moved again.
            refs[label] = {**ref, **{k: now[k] for k in ("trace_inputs", "env", "fam")}}
        if entry["key"] is not None:
            pending[label] = now
    _save_last(
        ws,
        refs,
        pending,
        {
            "environments": {**last.get("environments", {}), snaps.env_id: snaps.env},
            "families": {**last.get("families", {}), **snaps.families},
            "toolchains": {
                **last.get("toolchains", {}),
                **{b["fold"]: b["components"] for b in plan["toolchains"].values()},
            },
        },
    )


def record_minted(ws: Workspace, keys: set[str]) -> None:
    """A minted key is fresh: its targets' references become what they were planned as."""
    last = _load_last(ws.state / "last-plan.json")
    refs: dict[str, Any] = dict(last.get("targets", {}))
    pending: dict[str, Any] = dict(last.get("pending", {}))
    for label, now in list(pending.items()):
        if now["key"] in keys:
            refs[label] = now
            del pending[label]
    _save_last(ws, refs, pending, {k: last.get(k, {}) for k in ("environments", "families", "toolchains")})


def _save_last(
    ws: Workspace, refs: dict[str, Any], pending: dict[str, Any], snapshots: dict[str, dict[str, Any]]
) -> None:
    """Write the references with only the snapshots they still name: one copy of each
    environment, family and toolchain, however many targets name it."""
    rows = [*refs.values(), *pending.values()]
    named = {
        "environments": {r.get("env") for r in rows},
        "families": {r.get("fam") for r in rows},
        "toolchains": {((r.get("axes") or {}).get("toolchain") or {}).get("fold") for r in rows},
    }
    _save_json(
        ws.state / "last-plan.json",
        {
            "schema": LAST_PLAN_SCHEMA,
            "targets": refs,
            "pending": pending,
            **{kind: {k: v for k, v in snapshots[kind].items() if k in named[kind]} for kind in named},
        },
    )
