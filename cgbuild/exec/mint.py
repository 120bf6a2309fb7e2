"""Minting what a plan approved: one child per key, parallel within the machine, durable records.

Targets that share a key mint once; the artifact covers every facet of them. Each key runs in
its own `python -m cgbuild_rules.mint` child (a crash there is a typed failure here), its stderr
goes to a log beside its record, and the record (`<state>/mint/<key>.json`: labels, phases with
timings, failure class, log path) is written atomically when the key starts and when it ends, so
a killed run leaves an honest trail and a re-run resumes: admitted keys read `fresh` and are
skipped. Admission is mint-once: a different artifact for an admitted key is reported, never
written over.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cgbuild.config.targets import Target, expand
from cgbuild.core.codes import Code
from cgbuild.core.errors import UserError
from cgbuild.core.fs import write_json
from cgbuild.core.platform import host_name
from cgbuild.plan.diff import load_plan
from cgbuild.plan.entries import Plan, PlanEntry
from cgbuild.plan.jobs import trace_job
from cgbuild.plan.reasons import Status
from cgbuild.plan.workspace import StateDir, Workspace
from cgbuild.protocol.mint import Minted, MintFailed, MintOutcome, MintRequest, Phase, run_worker
from cgbuild.store.errors import StoreError
from cgbuild.store.local import Store
from cgbuild.store.s3 import RemoteError
from cgbuild.store.shared import PublishRefused, SharedStore

if TYPE_CHECKING:
    from cgbuild.exec.held import HeldTraces

RECORD_SCHEMA = "cgbuild.mint-record/1"
GIB = 1 << 30


@dataclass
class MintKey:
    """One key to mint and every plan target it serves."""

    key: str
    entries: list[PlanEntry]
    target: Target
    toolchain: dict[str, Any]
    result: MintOutcome | None = None
    """its outcome, once minted"""

    @property
    def minted(self) -> bool:
        return self.result is not None and self.result.ok

    @property
    def labels(self) -> list[str]:
        return [e.label for e in self.entries]


def default_jobs() -> int:
    """Parallel mints: a compile wants ~2 cores and a few GiB; never more than the machine has."""
    cores = os.cpu_count() or 1
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        avail = 8 * GIB
    return max(1, min(cores // 2, int(avail // (4 * GIB))))


def approved(plan: Plan, ws: Workspace, statuses: tuple[Status, ...] = (Status.MINT,)) -> list[MintKey]:
    """Group the plan's targets of these statuses by key (one mint per key)."""
    targets = {t.label: t for t in expand(ws.cg)}
    groups: dict[str, MintKey] = {}
    for entry in plan.entries:
        if entry.status not in statuses or not entry.key:
            continue
        target = targets.get(entry.label)
        if target is None:
            raise UserError(f"{entry.label} is in the plan but not in the Cgfile", field="targets")
        platform = target.device
        tc = plan.toolchains[platform]
        mk = groups.setdefault(
            entry.key,
            MintKey(
                entry.key,
                [],
                target,
                {"platform": platform, "fold": tc.fold, "components": dict(tc.components)},
            ),
        )
        mk.entries.append(entry)
    return list(groups.values())


def recorded_plan_keys(path: str) -> dict[str, str]:
    """label → key of the targets a recorded plan marked `mint`."""
    return load_plan(path).keys(Status.MINT)


def _evidence_run(result: Minted, how: str) -> dict[str, Any]:
    """One measured run for `<store>/evidence/<key>/<host>.json`: raw timings never sealed."""
    return {
        "how": how,
        "recorded": int(time.time()),
        "artifact_sha256": result.sha256,
        "reproducible": (result.compared or {}).get("reproducible"),
        "verified_on": result.device,
        **(result.lane_evidence or {}),
    }


def _layout_request(ws: Workspace, t: Target, readable: dict[str, Any]) -> dict[str, Any]:
    """What the worker needs to re-derive the layout axis (and refuse drift): the rule, the
    component, the reference it was read from (a path for this machine only: never sealed)."""
    lay = ws.cg.layouts[t.id.layout]
    return {
        "quant": lay.quant,
        "dtype": lay.dtype,
        "component": t.module.component,
        "reference": str(lay.reference) if lay.reference else None,
        "reading": lay.reading(t.module.component).to_json(),
        "topology": readable["topology"],
        "quant_digest": readable["quant"],
    }


def _lanes_request(ws: Workspace, mk: MintKey) -> dict[str, Any] | None:
    """The family's declared lanes and their needs, and the SKU the mint's verdict is fitted to.

    That SKU is the largest-memory card the key's targets declare for this sm: the verdict is
    then the best lane for the roomiest card, and every smaller card of the same sm re-fits at
    adopt down the recorded fallback order (docs/lanes.md).
    """
    fam = mk.target.family
    axes = fam.lanes_for(ws.cg.layouts[mk.target.id.layout].quant)
    if not axes:
        return None
    skus = [ws.cg.skus[name] for name in sorted({s for e in mk.entries for s in e.skus})]
    fit = max(skus, key=lambda s: s.memory_bytes)  # the first by name among equals
    return {
        "axes": [[axis, list(values)] for axis, values in axes],
        "needs": {a: {v: n.to_json() for v, n in fam.lane_table[a].items()} for a, _ in axes},
        "sku": {"name": fit.name, "memory_bytes": fit.memory_bytes},
    }


def request_for(ws: Workspace, mk: MintKey, out: Path, **extra: Any) -> dict[str, Any]:
    """The worker's request for one key (`extra`: `fresh`, `compare_with`, ... of MintRequest)."""
    first = mk.entries[0]
    axes = first.to_json()["axes"]
    return MintRequest(
        id=mk.key,
        key=mk.key,
        labels=mk.labels,
        job=trace_job(ws, mk.target, {mk.target.device: mk.toolchain}).with_id(mk.key),
        lanes=_lanes_request(ws, mk) or None,
        sm=mk.target.id.sm,
        graph_digest=first.axis("graph")["digest"],
        toolchain=mk.toolchain,
        # the toolchain source may be a lock path: a machine fact, not one for sealed bytes
        axes={**axes, "toolchain": {k: v for k, v in axes["toolchain"].items() if k != "source"}},
        facets=[dict(e.envelope) for e in mk.entries],
        stamp=first.stamp,
        layout=_layout_request(ws, mk.target, axes["layout"]),
        cxx=ws.cg.cxx,
        out=str(out),
        **extra,
    ).to_json()


def mint_one(
    ws: Workspace,
    mk: MintKey,
    store: Store,
    on_event: Callable[[MintKey, str], None] | None = None,
    held: HeldTraces | None = None,
    env: Mapping[str, str] | None = None,
) -> MintKey:
    """Mint, admit and record one key on this machine; returns it with `result` filled.

    The unit both executors run: the local pool calls it per key, a fleet worker calls it on
    the node that holds the key's sm, with `env` its mint child's environment (pinned to the
    GPU Ray assigned). A worker `held` from the plan's trace mints it when one traced its unit
    here (cgbuild.exec.held).
    """
    record_path = ws.state.record(mk.key)
    log = ws.state.log(mk.key)
    worker = None
    record = {
        "schema": RECORD_SCHEMA,
        "key": mk.key,
        "labels": mk.labels,
        "state": "running",
        "started": time.time(),
        "pid": os.getpid(),  # gc leaves a live mint's build files alone
        "log": str(log),
    }
    write_json(record_path, record, indent=1)
    if on_event:
        on_event(mk, "starting")

    def progress(phase: str) -> None:
        if on_event:
            on_event(mk, phase)

    shared = ws.shared(store)
    try:
        store.heal(mk.key)  # a malformed ref is quarantined before the compile, not after it
        if shared is not None:
            shared.check_publishable()  # before the compile: an unpublishable mint is wasted
        request = request_for(ws, mk, ws.state.build)
        worker = held.claim(mk.target, log) if held is not None else None  # after the refusals above
        result = worker.complete(request, progress) if worker else run_worker(request, log, progress, env=env)
        if isinstance(result, Minted):
            if on_event:
                on_event(mk, "admitting")
            result = _admit(mk, result, store, shared)
    except StoreError as e:  # PublishRefused (no usable signing key), local refusals
        phase = Phase.PUBLISH if isinstance(e, PublishRefused) else Phase.ADMIT
        result = MintFailed(Code(e.code), phase, e.detail)
    except RemoteError as e:
        result = MintFailed(Code(e.code), Phase.PUBLISH, e.detail)
    except OSError as e:  # the state folder or the build folder refused a write: this key fails
        result = MintFailed(Code.IO_ERROR, Phase.ADMIT, str(e))
    mk.result = result
    record.update(
        traced_here=worker is not None,  # the plan's trace of it was this mint's own
        state="ok" if result.ok else "failed",
        finished=time.time(),
        result={k: v for k, v in result.to_json().items() if k not in ("members", "lane_evidence")},
    )
    write_json(record_path, record, indent=1)
    if on_event:
        on_event(mk, "done" if result.ok else "failed")
    return mk


def _admit(mk: MintKey, result: Minted, store: Store, shared: SharedStore | None) -> MintOutcome:
    """Admit a sealed artifact: locally, and with a remote also signed and published (mint-once
    across machines: a conflict names the artifact that stands, and this mint is told)."""
    labels = {"labels": mk.labels}
    where = "the store"
    try:
        if shared is None:
            admission = store.admit(mk.key, result.artifact, metadata=labels)
        else:
            where = f"the shared store {shared.remote.url}"
            admission = shared.admit(mk.key, result.artifact, metadata=labels)
        if admission.status == "conflict":
            detail = (
                f"{where} already holds a different artifact for {mk.key[:12]} "
                f"({admission.existing}); it stands (mint-once)"
            )
            return MintFailed(Code.CONFLICT, Phase.ADMIT, detail, {"standing": admission.existing}, result.id)
        evidence = None
        if admission.ok and result.lane_evidence:
            run = _evidence_run(result, "mint")
            if shared is None:
                store.add_evidence(mk.key, host_name(), run)
            elif (why := shared.add_evidence(mk.key, run)) is not None:
                evidence = f"kept on this machine only: {why}"
        return result.admitted(admission.status, evidence)
    finally:
        Path(result.artifact).unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    """Running: a zombie (dead, not yet reaped by whoever inherited it) is no live mint."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc here: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _pid_of(name: str) -> int | None:
    """The pid a build entry's name ends with: `.mint-<key16>-<pid>`, `.<file>.<pid>.tmp`."""
    stem = name.removesuffix(".tmp")
    digits = stem.rpartition("-" if name.startswith(".mint-") else ".")[2]
    return int(digits) if digits.isdigit() else None


def _live_mint(state: StateDir, entry: Path) -> bool:
    """Whether a build entry may still be in use: its worker (by the pid in its name) runs, or,
    for a sealed `<key>.tar.gz` awaiting admission, the key's record is `running` under a live
    cgbuild. A reused pid only keeps an entry longer, never removes a live one."""
    if entry.name.endswith(".tar.gz"):
        record = state.read_record(entry.name.removesuffix(".tar.gz"))
        if record is None:
            return False
        pid = record.get("pid")
        return record.get("state") == "running" and (type(pid) is not int or _alive(pid))
    pid = _pid_of(entry.name)
    return pid is not None and _alive(pid)


def sweep_build(state: StateDir, grace_s: float, *, dry_run: bool = False) -> list[str]:
    """Remove what killed mints left in `<state>/build` (work folders `.mint-*`, sealed
    `*.tar.gz` never admitted, `*.tmp` seal temps) once older than `grace_s` seconds and no
    live mint's; returns their names. A mint always cleans up after itself, so anything here
    past the grace period belongs to a mint that was killed."""
    build = state.build
    if not build.is_dir():
        return []
    removed: list[str] = []
    cutoff = time.time() - grace_s
    for entry in sorted(build.iterdir()):
        leftover = entry.name.startswith(".mint-") or entry.name.endswith((".tar.gz", ".tmp"))
        try:
            old = entry.lstat().st_mtime < cutoff
        except FileNotFoundError:
            continue
        if not leftover or not old or _live_mint(state, entry):
            continue
        removed.append(entry.name)
        if not dry_run:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
    return removed


def _fresh(plan: Plan) -> set[str]:
    return set(plan.keys(Status.FRESH).values())


def prove_shared_store(ws: Workspace, keys: list[MintKey], plan: Plan) -> None:
    """Before anything is compiled or published: a shared store that fails the create-only probe
    is the workspace's misconfiguration, one `RemoteError` naming it (exit 2), not a failure of
    every key. A machine without a usable signing key is left to each key's failure, which names
    that; with nothing to mint or publish the store is not asked."""
    shared = ws.shared()
    if shared is None or not (keys or shared.unpublished(_fresh(plan))):
        return
    with contextlib.suppress(PublishRefused):
        shared.check_publishable()


def publish_unpublished(ws: Workspace, plan: Plan) -> list[dict[str, Any]]:
    """Publish the plan's fresh keys that only this machine's cache holds (a publish that failed
    after the local admission, or keys minted before the remote was declared)."""
    shared = ws.shared()
    if shared is None:
        return []
    out: list[dict[str, Any]] = []
    for key in shared.unpublished(_fresh(plan)):
        try:
            status, standing = shared.republish(key)
        except (StoreError, RemoteError) as e:
            out.append({"key": key, "publish": "failed", "code": e.code, "detail": e.detail})
            continue
        entry = {"key": key, "publish": status}
        out.append({**entry, "standing": standing} if status == "conflict" else entry)
    return out


def mint_keys(
    ws: Workspace,
    keys: list[MintKey],
    *,
    jobs: int,
    on_event: Callable[[MintKey, str], None] | None = None,
    held: HeldTraces | None = None,
) -> list[MintKey]:
    """Mint, admit and record each key, `jobs` at once; returns them with `result` filled.

    Keys a held worker will mint go first (that worker already holds its program). Keys past
    the first `jobs` are announced as waiting for a free slot until a worker takes them.
    """
    store = Store(ws.cg.store_dir)
    order = sorted(keys, key=lambda mk: held is None or not held.holds(mk.target))
    if on_event:
        for mk in order[max(1, jobs) :]:
            on_event(mk, f"waiting for a free mint slot ({max(1, jobs)} at once, -j to change)")
    pool = ThreadPoolExecutor(max_workers=max(1, jobs))
    try:
        list(pool.map(lambda mk: mint_one(ws, mk, store, on_event, held), order))
        return keys
    finally:  # interrupted: keys not yet started never start
        pool.shutdown(wait=True, cancel_futures=True)


def remint_and_compare(ws: Workspace, mk: MintKey) -> MintOutcome:
    """Re-mint a stored key in a fresh sandbox and compare with the stored artifact, member by member."""
    store = Store(ws.cg.store_dir)
    resolved = store.resolve(mk.key, verify=True)
    if (bad := store.check_sealed_key(mk.key)) is not None:  # another key's object: quarantined
        return MintFailed(Code(bad.status), Phase.CHECK, bad.detail or "")
    with tempfile.TemporaryDirectory(prefix="cgbuild-check-") as tmp:
        req = request_for(ws, mk, Path(tmp), empty_sandbox=True, compare_with=str(resolved.path))
        result = run_worker(req, ws.state.log(mk.key, "check"))
        if isinstance(result, Minted) and result.lane_evidence:
            store.add_evidence(mk.key, host_name(), _evidence_run(result, "check"))
        shutil.rmtree(tmp, ignore_errors=True)
    return result
