"""What moved since a target's reference (its state when last fresh, or first seen), as reasons.

One walk per target compares its recorded reference with what it is now: the trace inputs by
name (family files, config, entry, lanes, distributions, trace rule, Python, the tracing torch),
then each key axis by its identity fields (a toolchain by component). The snapshots a plan
compares against are built once per family and once for the environment (`Snapshots`), and the
moved trace inputs once per (old, new) snapshot pair (`Movement`), not per target.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from cgbuild.config.targets import Target
from cgbuild.core.canon import digest
from cgbuild.core.codes import Code
from cgbuild.identity import toolchain_changes
from cgbuild.identity.keys import AXES, GRAPH, KINDS, Axis
from cgbuild.plan import reasons as why
from cgbuild.plan.inputs import FamilyInputs
from cgbuild.plan.reasons import Reason
from cgbuild.plan.tracecache import TRACE_RULE_VERSION

MAX_NAMED = 6  # moved distributions (or files) named per target; the rest are counted


@dataclass(frozen=True)
class Snapshots:
    """What this plan's trace inputs are made of, by name, once per family and once for the
    environment: the record keeps one copy of each, so reasons can name what moved."""

    env_id: str
    env: dict[str, Any]
    fam_ids: dict[str, str]
    families: dict[str, dict[str, Any]]

    @classmethod
    def of(cls, fam_inputs: dict[str, FamilyInputs], dists: dict[str, str], env: str) -> Snapshots:
        python = f"{sys.version_info.major}.{sys.version_info.minor}"
        env_block = {"dists": dists, "rule": TRACE_RULE_VERSION, "python": python}
        fam_ids = {name: inputs.id for name, inputs in fam_inputs.items()}
        families = {inputs.id: inputs.snapshot for inputs in fam_inputs.values()}
        return cls(digest([env, TRACE_RULE_VERSION, python])[:16], env_block, fam_ids, families)


class _InputsSeen(NamedTuple):
    """One (old, new) pair of a family's trace-input snapshots: the moved inputs it names are the
    same for every target of the family that recorded that pair."""

    family: str
    old_fam: str | None
    old_env: str | None
    old_torch: str | None
    new_torch: str | None
    root: bool


@dataclass
class Movement:
    """The last plan's record against this plan's snapshots and toolchains."""

    last_plan: dict[str, Any]
    now: Snapshots
    toolchains: dict[str, Any]
    _inputs: dict[_InputsSeen, list[Reason]] = field(default_factory=dict)

    def since(
        self,
        t: Target,
        key: str | None,
        axes: dict[str, Axis | None],
        inputs: str,
        last: dict[str, Any] | None,
    ) -> list[Reason]:
        """What moved since the target's recorded reference `last`, root causes first."""
        if last is None:
            return [Reason(Code.NEW_TARGET, "new target: not in this workspace's recorded plans", True)]
        out: list[Reason] = []
        if last.get("new"):  # never fresh since first seen
            out.append(
                Reason(Code.NEW_TARGET, "new target: not minted since it first appeared in a plan", True)
            )
        trace_moved = last.get("trace_inputs") != inputs
        if not trace_moved and key is not None and last.get("key") == key:
            return out  # the warm path: nothing this target depends on moved
        last_axes = last.get("axes", {})
        new_graph, old_graph = axes.get("graph"), last_axes.get("graph")
        cutoff = trace_moved and new_graph is not None and old_graph is not None
        cutoff = cutoff and GRAPH.identity(old_graph) == new_graph.identity  # type: ignore[union-attr]
        if trace_moved:
            new_torch = new_graph.readable.get("traced_with") if new_graph is not None else None
            out.extend(self._inputs_moved(t.id.family, last, new_torch, root=not cutoff))
        for name in AXES:
            new, old = axes.get(name), last_axes.get(name)
            if new is not None and old is not None and KINDS[name].identity(old) != new.identity:
                out.extend(self._axis_moved(t, name, old, new, trace_moved=trace_moved))
        if cutoff:
            out.append(why.early_cutoff())
        return out

    def _axis_moved(
        self, t: Target, name: str, old: dict[str, Any], new: Axis, *, trace_moved: bool
    ) -> list[Reason]:
        if name == "toolchain":
            old_comp = self.last_plan.get("toolchains", {}).get(old.get("fold"), {})
            new_comp = self.toolchains[t.device]["components"]
            changes = toolchain_changes.component_changes(old_comp, new_comp)
            return [
                why.axis_moved(name, str(before), str(after), root=True, component=comp)
                for comp, before, after in changes or [("fold", str(old.get("fold")), new.identity["fold"])]
            ]
        # the graph, and a topology read from the trace, move because the trace inputs did
        traced = name == "graph" or new.readable.get("topology_source") == "trace"
        root = not (trace_moved and traced)
        before, after = KINDS[name].move_text(old, new.readable)
        return [why.axis_moved(name, before, after, root=root)]

    def _inputs_moved(
        self, fam: str, last: dict[str, Any], new_torch: str | None, *, root: bool
    ) -> list[Reason]:
        """The trace inputs that moved, each by name; once per (old, new) snapshot pair, not per
        target (a family's thousand targets share them)."""
        old_torch = (last.get("axes", {}).get("graph") or {}).get("traced_with")
        seen = _InputsSeen(fam, last.get("fam"), last.get("env"), old_torch, new_torch, root)
        if seen not in self._inputs:
            self._inputs[seen] = self._name_inputs(seen) or [why.unnamed_inputs_moved(root=root)]
        return self._inputs[seen]

    def _name_inputs(self, seen: _InputsSeen) -> list[Reason]:
        now, root = self.now, seen.root
        out: list[Reason] = []
        before = self.last_plan.get("families", {}).get(seen.old_fam)
        new_fam = now.fam_ids[seen.family]
        if before is not None and seen.old_fam != new_fam:
            out.extend(_family_moved(seen.family, before, now.families[new_fam], root=root))
        env_before = self.last_plan.get("environments", {}).get(seen.old_env)
        if env_before is not None and seen.old_env != now.env_id:
            for name in ("rule", "python"):
                if env_before.get(name) != now.env[name]:
                    label = "trace-rule" if name == "rule" else "python"
                    out.append(
                        why.version_moved(label, str(env_before.get(name)), str(now.env[name]), root=root)
                    )
            dists = _changed_dists(env_before.get("dists", {}), now.env["dists"])
            out.extend(why.version_moved(n, a, b, root=root) for n, a, b in dists[:MAX_NAMED])
            if len(dists) > MAX_NAMED:
                out.append(why.more_moved(len(dists) - MAX_NAMED, "distributions", root=root))
        if seen.old_torch and seen.new_torch and seen.old_torch != seen.new_torch:
            out.append(why.version_moved("torch (tracing)", seen.old_torch, seen.new_torch, root=root))
        return out


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


def _changed_dists(old: dict[str, str], new: dict[str, str]) -> list[tuple[str, str | None, str | None]]:
    return [(n, old.get(n), new.get(n)) for n in sorted(set(old) | set(new)) if old.get(n) != new.get(n)]
