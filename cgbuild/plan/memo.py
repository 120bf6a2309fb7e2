"""A no-op plan served from the last identical one: a memo keyed on the stat stamps of its inputs.

A plan is a function of its inputs: the Cgfile, the toolchain locks, the toolchain probe's own
inputs (the files it validates its cache with, the variables and host it keys on), the import
path's folders (installed distributions, the local torch), each selected family's entry and
source files (re-globbed: a new file matching a pattern is an input), reference checkpoints, the
trace cache, the last plan, the engine's own source files and the store's refs. The memo keeps,
per request (selector, locks, tracing on or off, interpreter, workspace paths), the plan's exact
JSON text and the stat stamp (mtime ns, size, inode) of each of those inputs, taken before the
plan was computed and again after it was recorded: it is written only when nothing moved in
between and recording changed nothing (so the plan it holds is the one this state gives).

`fresh` is never inferred from the memo alone. A hit re-checks every key the plan names, now:
a `fresh` key's ref must be the very file that was read (same stamp) and its object must exist
with the size that ref records (one stat each: the same check `Store.ref_state` makes); a `mint`
key's ref must still be absent and it must still not be quarantined. Anything else is a miss and
the plan is computed in full.

With a shared store, a key fresh only by the remote is fresh by the remembered listing (a local
file, stamped like the other inputs): a hit re-checks it as `SharedStore.seen_keys` would, the
listing younger than its TTL and the key in no quarantine record (one listing of `quarantine/`).
A plan with a key the remote lacks is never memoised there: only a listing of `refs/` re-checks
it, and that listing is the cost the memo exists to avoid.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cgbuild.core import fs
from cgbuild.core.errors import UserError
from cgbuild.plan.workspace import StateDir
from cgbuild.store import refs

if TYPE_CHECKING:
    from cgbuild.config.cgfile import Cgfile
    from cgbuild.config.labels import Selector
    from cgbuild.plan.entries import Plan, PlanRow
    from cgbuild.plan.workspace import Workspace

SCHEMA = "cgbuild.plan-memo/2"
ENGINE = Path(__file__).resolve().parents[1]  # the cgbuild package: its code is an input too
PROBE_ENV = ("PATH",)  # with the toolchain policy's recorded variables (see `request_of`)


@dataclass
class Request:
    """What a plan was asked: the memo holds one plan per request."""

    doc: dict[str, Any]

    @property
    def id(self) -> str:
        return hashlib.sha256(json.dumps(self.doc, sort_keys=True).encode()).hexdigest()[:24]


def request_of(cg: Cgfile, selector: str, toolchain_lock: str | None, run_traces: bool) -> Request:
    from cgbuild.identity.policy import PASS_RECORDED

    env = {v: os.environ.get(v) for v in (*PROBE_ENV, *PASS_RECORDED)}
    return Request(
        {
            "schema": SCHEMA,
            "selector": selector,
            "toolchain_lock": toolchain_lock and os.path.abspath(toolchain_lock),
            "run_traces": run_traces,
            "cgfile": str(cg.path),
            "store": str(cg.store_dir),
            "python": [sys.executable, sys.version, list(sys.path)],
            "host": [platform.node(), platform.machine()],
            "env": env,
        }
    )


def input_stamps(cg: Cgfile, toolchain_lock: str | None) -> dict[str, list[int] | None]:
    """path → stat stamp of every file the plan reads (see the module's docstring)."""
    from cgbuild.plan.inputs import family_files

    paths: list[str] = [str(cg.path)]
    paths += [str(p) for p in (cg.toolchain_lock, toolchain_lock) if p]
    paths += [entry or "." for entry in sys.path]
    state = StateDir(cg.state_dir)
    paths += [str(p) for p in state.planned_from()]
    paths += _probe_inputs(state.cache / "toolchain.json")
    for fam in cg.families.values():
        paths += [str(p) for p in family_files(cg, fam)]
    for lay in cg.layouts.values():
        if lay.reference is not None:
            paths += _tree(str(lay.reference))
    if cg.remote:
        from cgbuild.store.shared import seen_path

        paths.append(str(seen_path(cg.store_dir, cg.remote)))  # the shared store's remembered listing
    paths += _tree(str(ENGINE), suffix=".py")
    return {p: fs.stat_stamp(p) for p in sorted(set(paths))}


def _probe_inputs(cache: Path) -> list[str]:
    """The files the toolchain probe validates its cache with (its search folders, each RECORD
    it read, the compiler): a change to any of them is a change of toolchain."""
    try:
        doc = json.loads(cache.read_bytes())
        return [p or "." for entry in doc["entries"].values() for p in entry["stats"]] + [str(cache)]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return [str(cache)]


def _tree(root: str, suffix: str = "") -> list[str]:
    """`root` and, for a folder, every folder and file under it (ending in `suffix`)."""
    out = [root]
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        out += [os.path.join(folder, d) for d in dirs]
        out += [os.path.join(folder, f) for f in files if f.endswith(suffix)]
    return out


LISTED = "listed"  # a StoreCheck row's stamp for a key fresh by the shared store's remembered listing


@dataclass
class StoreCheck:
    """The store as the plan saw it, one row per key: `[key, ref stamp, object path, size]` for
    a key fresh here, `[key, None, None, None]` for a key the store lacks, and `[key, LISTED,
    None, None]` for one the shared store's remembered listing (taken at `listed_at`) vouched for."""

    rows: list[list[Any]] = field(default_factory=list)
    listed_at: float | None = None

    @classmethod
    def of(
        cls, store_root: Path, states: Mapping[str, str], remote: tuple[float | None, set[str]] | None = None
    ) -> StoreCheck | None:
        """The rows for `states` (key → ref state), or None when a key is neither fresh nor
        missing, or the store no longer reads as it did (then nothing is memoised).

        `remote` is given for a workspace with a shared store: the remembered listing's time and
        the keys it vouched for (`SharedStore.remembered`). There a `missing` key is never
        memoised (only a listing of `refs/` could re-check it), and a key fresh without a local
        ref must be one the remembered listing vouched for."""
        root = str(store_root)
        rows: list[list[Any]] = []
        for key, state in sorted(states.items()):
            ref = f"{root}/refs/{key[:2]}/{key}.json"
            stamp = fs.stat_stamp(ref)
            if state == "missing" and stamp is None and not os.path.exists(f"{root}/quarantine/{key}.json"):
                if remote is not None:
                    return None
                rows.append([key, None, None, None])
                continue
            if state != "fresh":
                return None
            row = _local_row(root, key, ref, stamp)
            if row is None and remote is not None and key in remote[1]:
                row = [key, LISTED, None, None]
            if row is None:
                return None
            rows.append(row)
        listed = any(row[1] == LISTED for row in rows)
        return cls(rows, remote[0] if listed and remote is not None else None)

    @property
    def listed(self) -> list[str]:
        """The keys only the remembered listing vouches for."""
        return [row[0] for row in self.rows if row[1] == LISTED]

    def holds(self, store_root: Path) -> bool:
        """Whether every key still reads as it did here: a fresh key's ref the same file and its
        object the recorded size; a missing key's ref still absent and not quarantined. (A
        listed key is the shared store's to re-check: `SharedStore.vouches`.)"""
        root = str(store_root)
        for key, stamp, obj, size in self.rows:
            ref = f"{root}/refs/{key[:2]}/{key}.json"
            if stamp == LISTED:
                continue
            if stamp is None:
                if os.path.lexists(ref) or os.path.lexists(f"{root}/quarantine/{key}.json"):
                    return False
                continue
            try:
                st = os.stat(ref)
                if [st.st_mtime_ns, st.st_size, st.st_ino] != stamp or os.stat(obj).st_size != size:
                    return False
            except OSError:
                return False
        return True


def _still_listed(ws: Workspace, store: StoreCheck) -> bool:
    """The shared store's remembered listing still vouches for every key only it made fresh."""
    shared = ws.shared()
    if shared is None or store.listed_at is None:
        return False
    return shared.vouches(store.listed, store.listed_at)


def _local_row(root: str, key: str, ref: str, stamp: list[int] | None) -> list[Any] | None:
    """`[key, ref stamp, object path, size]` when the local ref is this stamp's file and its object
    has the size it records (what `Store.ref_state` calls fresh), else None."""
    if stamp is None:
        return None
    try:
        with open(ref, "rb") as f:
            doc = json.loads(f.read())
        if refs.doc_problem(doc, key, refs.REF_SCHEMA) is not None:
            return None
        obj = f"{root}/objects/sha256/{doc['object'][:2]}/{doc['object'][2:]}"
        size = doc["size"]
        if fs.stat_stamp(ref) != stamp or os.stat(obj).st_size != size:
            return None
    except (OSError, ValueError):
        return None
    return [key, stamp, obj, size]


@dataclass
class Memo:
    """One remembered plan: its JSON text, the stamps it was computed under, the store it saw and
    the summary view a person's `plan` reads."""

    request: Request
    stamps: dict[str, list[int] | None]
    store: StoreCheck
    text: str
    view: list[dict[str, Any]] | None = None
    view_stamp: list[int] | None = None

    @staticmethod
    def folder(cg: Cgfile) -> Path:
        return StateDir(cg.state_dir).plans

    @classmethod
    def load(cls, ws: Workspace, request: Request, stamps: dict[str, list[int] | None]) -> Memo | None:
        """The memo of `request` if its inputs still have `stamps` and its store still holds:
        locally, and for keys only the shared store's remembered listing vouched for, by that
        listing still counting and none of them quarantined (one listing of `quarantine/`)."""
        cg = ws.cg
        base = cls.folder(cg) / request.id
        try:
            index = json.loads((base.with_suffix(".json")).read_bytes())
            if index.get("schema") != SCHEMA or index.get("request") != request.doc:
                return None
            if index.get("stamps") != stamps:
                return None
            store = StoreCheck(index["store"], index["listed_at"])
            if not store.holds(cg.store_dir):
                return None
            if store.listed and not _still_listed(ws, store):
                return None
            text_path = base.with_suffix(".plan")
            if fs.stat_stamp(text_path) != index["text_stamp"]:
                return None
            text = text_path.read_text("utf-8")
            view_stamp = index["view_stamp"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None  # none yet, torn or foreign: the plan is computed in full and rewritten
        return cls(request, stamps, store, text, view_stamp=view_stamp)

    def load_view(self, cg: Cgfile) -> tuple[PlanRow, ...] | None:
        """The summary view saved with this plan, or None (torn, or from another save)."""
        from cgbuild.plan.entries import PlanRow

        path = (self.folder(cg) / self.request.id).with_suffix(".view")
        try:
            if fs.stat_stamp(path) != self.view_stamp:
                return None
            view = json.loads(path.read_bytes())
            if not isinstance(view, list):
                return None
            return tuple(PlanRow.from_json(row, f"[{i}]", _torn) for i, row in enumerate(view))
        except (OSError, ValueError, UserError):
            return None

    def save(self, cg: Cgfile) -> None:
        base = self.folder(cg) / self.request.id
        fs.write_atomic(base.with_suffix(".plan"), self.text)
        fs.write_atomic(base.with_suffix(".view"), json.dumps(self.view, separators=(",", ":")))
        index = {
            "schema": SCHEMA,
            "request": self.request.doc,
            "stamps": self.stamps,
            "store": self.store.rows,
            "listed_at": self.store.listed_at,
            "text_stamp": fs.stat_stamp(base.with_suffix(".plan")),
            "view_stamp": fs.stat_stamp(base.with_suffix(".view")),
        }
        fs.write_atomic(base.with_suffix(".json"), json.dumps(index, separators=(",", ":")))
        _prune(self.folder(cg))


KEEP = 8  # memos kept per workspace (one per request; a 10,000-target plan's is ~13 MB)


def _prune(folder: Path) -> None:
    """Drop all but the `KEEP` most recently written memos."""
    indexes = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
    for index in indexes[KEEP:]:
        for part in folder.glob(f"{index.stem}.*"):
            part.unlink(missing_ok=True)


def _torn(field: str, message: str) -> UserError:
    """A saved view that does not parse is torn: the plan text answers instead."""
    return UserError(message, field=field)


def plan_text(plan: Plan) -> str:
    """The plan JSON as `plan --json` prints it: sorted keys, no spaces, one line."""
    return json.dumps(plan.to_json(), indent=None, sort_keys=True, separators=(",", ":")) + "\n"


@dataclass
class PlanOutput:
    """A plan as `cgbuild plan` prints it: the JSON text, and the rows the human summary and
    `--exit-code` read (from the memo, its saved summary view), parsed only when asked."""

    text: str
    _rows: Callable[[], tuple[PlanRow, ...]]

    @functools.cached_property
    def _parsed(self) -> tuple[PlanRow, ...]:
        return self._rows()

    def summary(self) -> tuple[PlanRow, ...]:
        return self._parsed


def plan_output(
    ws: Workspace,
    selector: Selector,
    *,
    run_traces: bool = True,
    workers: int | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    verify: bool = False,
) -> PlanOutput:
    """`plan` (recorded), served from the memo when every input and every key's ref reads as
    it did when the memo was written (docs/plan.md, "A no-op plan"); else planned in full, and
    memoised when nothing moved while it ran and recording changed nothing.

    `verify` (`plan --verify`) checks the signatures of keys fresh only by the shared store's
    listing; the memo checks no signatures, so a verified plan is never served from, nor written
    to, it."""
    cg = ws.cg
    if verify and not cg.remote:
        raise cg.error(
            "--verify checks the signatures of keys a shared store lists, and this workspace "
            "declares no remote (its local store holds only what this machine admitted)",
            "workspace",
            "remote",
        )
    if verify:
        from cgbuild.plan.planner import PlanContext, plan_in_full

        ctx = PlanContext(ws, run_traces=run_traces, workers=workers, progress=progress, verify=True)
        plan = plan_in_full(ctx, selector, record=True)
        return PlanOutput(plan_text(plan), lambda: plan.rows)
    request = request_of(cg, selector.text, ws.toolchain_lock, run_traces)
    before = input_stamps(cg, ws.toolchain_lock)
    hit = Memo.load(ws, request, before)
    if hit is not None:
        return PlanOutput(hit.text, lambda: hit.load_view(cg) or _rows_of(hit.text, cg))
    from cgbuild.plan.planner import (
        PlanContext,
        plan_in_full,
    )  # the engine's heavy half: a hit never needs it

    ctx = PlanContext(ws, run_traces=run_traces, workers=workers, progress=progress)
    plan = plan_in_full(ctx, selector, record=True)
    text = plan_text(plan)
    if input_stamps(cg, ws.toolchain_lock) == before:
        remote = None if ctx.shared is None else ctx.shared.remembered()
        store = StoreCheck.of(cg.store_dir, ctx.ref_states, remote)
        if store is not None:
            Memo(request, before, store, text, [r.to_json() for r in plan.rows]).save(cg)
    return PlanOutput(text, lambda: plan.rows)


def _rows_of(text: str, cg: Cgfile) -> tuple[PlanRow, ...]:
    """The summary rows of a memoised plan whose view is gone: from the plan text itself."""
    from cgbuild.plan.entries import Plan

    return Plan.from_json(json.loads(text), str(cg.path)).rows
