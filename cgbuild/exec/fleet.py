"""Fleet mints on a Ray cluster: each key runs on a node that advertises its sm as a resource.

Why Ray: it already does what a fleet of mint machines needs — placement by custom resources
(`ray start --resources '{"sm_90": 1}'`), retrying a task whose node died, and streaming a
task's output back while it runs. The engine imports ray only here, and only when a mint asks
for `--executor ray`.

Placement: a key needs one unit of the resource named exactly as its sm (`sm_90`, `sm_120`, and
`cpu` for CPU keys — lowercase; Ray's own `CPU` counts cores and is not used), so the count a
node advertises is how many mints it runs at once; a CUDA key also needs one of Ray's `GPU`s on
that same node (`num_gpus=1`), a CPU key none. A key no live node can take is refused before
anything is submitted (`no-node-for-sm`; `no-gpu-for-sm` when nodes advertise its sm but none
of them has a GPU), never left queued; a key whose last capable node dies while it waits is
cancelled (`fleet-node-lost`) for the same reason.

Pinning: the node starts the key's mint child with `CUDA_VISIBLE_DEVICES` set to exactly the GPU
Ray assigned the task (`get_accelerator_ids()`; empty for a CPU key, which was assigned none),
whatever Ray itself does to the worker's environment, so two mints on one host never compile or
verify on the same GPU, nor on one Ray did not give them. The record names the GPU Ray assigned
(`node.gpus`) and the device verify ran on (the result's `device`).

The worker is `mint.mint_one` on the node, exactly what the local pool runs: the node re-loads
the workspace from the same path (a shared filesystem or the same checkout at the same path,
docs/fleet.md), refuses when its Cgfile's digest differs from the driver's, and its mint child
refuses toolchain, graph and layout drift and a wrong device as it does locally. Admission into
the node's store is crash-safe, so a node lost mid-mint leaves no partial state and Ray's retry
re-runs the whole key elsewhere. The task is a streaming generator: it yields each phase as it
starts and the result last, and the driver feeds them to the same progress board and writes the
same durable record as a local mint. `Fleet` is a `MintExecutor` (`cgbuild.exec.executor`), as
the local pool is: the CLI runs one `build` over either.
"""

from __future__ import annotations

import os
import queue
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cgbuild.config import cgfile
from cgbuild.config.targets import expand
from cgbuild.core.canon import sha256_file
from cgbuild.core.codes import Code
from cgbuild.core.errors import UserError
from cgbuild.core.fs import write_json
from cgbuild.core.platform import CUDA, device_of
from cgbuild.exec.mint import MintKey, mint_one
from cgbuild.plan.entries import PlanEntry
from cgbuild.plan.workspace import Workspace
from cgbuild.protocol.mint import BadResult, MintFailed, Phase, outcome_from_json
from cgbuild.store.s3 import RemoteError

CONNECT_TIMEOUT_S = 5.0
WATCH_S = 2.0  # how often a waiting driver re-checks that some live node still offers the sm
NODE_RETRIES = 3  # Ray re-runs a key this often when its node dies mid-mint


@dataclass(frozen=True)
class ExecutorChoice:
    """The `--executor` a user chose, from which `exec/executor.py` builds its `MintExecutor`: this
    machine's pool, or a Ray cluster (`address` None: the usual discovery — `RAY_ADDRESS`, else the
    cluster this machine belongs to)."""

    kind: str
    address: str | None = None


_HOST = re.compile(r"[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]")
_PORT = re.compile(r"[0-9]{1,5}")


def parse_executor(value: str) -> ExecutorChoice:
    """`local`, `ray` or `ray://HOST:PORT` (the head's GCS address, as `ray start --head` prints)."""
    if value == "local":
        return ExecutorChoice("local")
    if value == "ray":
        return ExecutorChoice("ray")
    if value.startswith("ray://"):
        address = value.removeprefix("ray://")
        host, sep, port = address.rpartition(":")
        if _HOST.fullmatch(host) and sep and _PORT.fullmatch(port) and 0 < int(port) < 65536:
            return ExecutorChoice("ray", address)
    raise UserError(f"unknown executor {value!r}: use local, ray or ray://HOST:PORT", field="--executor")


# ---- driver -----------------------------------------------------------------------------------
def connect(executor: ExecutorChoice) -> None:
    """Join the cluster as a driver; an unreachable head is bad input, not a two-minute hang."""
    import logging

    if executor.address:
        host, _, port = executor.address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as exc:
            raise UserError(
                f"cannot reach the Ray head at {executor.address}: {exc.strerror or exc}", field="--executor"
            ) from None
    import ray

    if ray.is_initialized():
        return
    try:
        ray.init(address=executor.address or "auto", logging_level=logging.ERROR, log_to_driver=False)
    except (ConnectionError, RuntimeError) as exc:
        raise UserError(f"cannot join the Ray cluster: {exc}", field="--executor") from None


def offered() -> list[dict[str, float]]:
    """The resources each live node advertises (a key needs ONE node that has all it asks for)."""
    import ray

    return [dict(node.get("Resources", {})) for node in ray.nodes() if node.get("Alive")]


def needs(sm: str) -> dict[str, float]:
    """What one mint of an `sm` key asks of its node: a unit of the sm, and a GPU for a CUDA sm."""
    return {sm: 1.0, "GPU": 1.0} if device_of(sm) == CUDA else {sm: 1.0}


def placeable(sm: str, nodes: list[dict[str, float]]) -> bool:
    """Whether some node offers everything a key of `sm` asks for."""
    need = needs(sm)
    return any(all(node.get(name, 0) >= amount for name, amount in need.items()) for node in nodes)


def task_options(sm: str) -> dict[str, Any]:
    """The Ray options that place a key of `sm`: its sm's unit, one `GPU` for a CUDA key (Ray
    then assigns the task a GPU of its own), none of Ray's `CPU`s (the sm paces the node)."""
    need = needs(sm)
    return {"resources": {sm: need[sm]}, "num_gpus": need.get("GPU", 0), "num_cpus": 0}


def _blocked(sm: str, nodes: list[dict[str, float]]) -> tuple[Code, str]:
    """Why no node can take a key of `sm`: the code and its words."""
    if any(node.get(sm, 0) >= 1 for node in nodes):
        return Code.NO_GPU_FOR_SM, (
            f"blocked: nodes advertise {sm!r} but none of them has a GPU for Ray to assign "
            "(a CUDA key runs on one GPU Ray gives it: start the node on its GPU machine, where "
            "Ray counts the GPUs, or with `ray start --num-gpus N`)"
        )
    sms = sorted({name for node in nodes for name in node if name == "cpu" or name.startswith("sm_")})
    return Code.NO_NODE_FOR_SM, (
        f"blocked: no node of the cluster advertises the resource {sm!r} "
        f"(nodes offer: {', '.join(sms) or 'no sm'}; start one with "
        f"`ray start --resources '{{\"{sm}\": 1}}'`)"
    )


def admission(
    keys: list[MintKey], nodes: list[dict[str, float]]
) -> tuple[list[MintKey], list[dict[str, Any]]]:
    """Keys some node can mint, and a `refused` row per label of those none can (blocked now)."""
    runnable: list[MintKey] = []
    blocked: list[dict[str, Any]] = []
    for mk in keys:
        sm = mk.target.id.sm
        if placeable(sm, nodes):
            runnable.append(mk)
            continue
        code, detail = _blocked(sm, nodes)
        blocked.extend({"label": label, "code": code, "detail": detail} for label in mk.labels)
    return runnable, blocked


@dataclass
class Order:
    """What the driver sends a node for one key: where the workspace is, what it must read there."""

    cgfile: str
    cgfile_sha256: str
    key: str
    entries: list[PlanEntry]
    toolchain: dict[str, Any]


def order_for(ws: Workspace, mk: MintKey) -> Order:
    path = ws.cg.path.resolve()
    return Order(str(path), sha256_file(str(path)), mk.key, mk.entries, mk.toolchain)


def _failure(code: Code, detail: str, *, phase: Phase = Phase.FLEET) -> dict[str, Any]:
    """A failed key's last word as the node's stream carries it."""
    return {"result": MintFailed(code, phase, detail).to_json()}


@dataclass
class _Followed:
    """One submitted key as the driver follows it: its stream, its last word, when it last spoke."""

    mk: MintKey
    gen: Any
    heard: float
    final: dict[str, Any]


class Fleet:
    """Mints keys on the cluster the driver joined; `placed` says which node runs each key now."""

    def __init__(self) -> None:
        self.placed: dict[str, str] = {}

    def take(self, keys: list[MintKey]) -> tuple[list[MintKey], list[dict[str, Any]]]:
        """The keys some live node can mint; the others refused now (`admission`)."""
        return admission(keys, offered())

    def mint_keys(
        self, ws: Workspace, keys: list[MintKey], on_event: Callable[[MintKey, str], None] | None = None
    ) -> list[MintKey]:
        """Submit every key at once (the cluster's resources pace them) and follow them all from
        one loop: each arrival costs one `ray.wait`, so thousands of keys need no thread each."""
        import ray

        task = ray.remote(mint_on_node)

        def submit(mk: MintKey) -> _Followed:
            gen = task.options(
                **task_options(mk.target.id.sm),
                max_retries=NODE_RETRIES,
                retry_exceptions=False,
                num_returns="streaming",
                name=f"mint {mk.labels[0]}",
            ).remote(order_for(ws, mk))
            no_result = _failure(Code.FLEET_ERROR, "the node returned no result")
            return _Followed(mk, gen, time.monotonic(), no_result)

        live = {f.gen: f for f in map(submit, keys)}
        checked = time.monotonic()
        while live:
            ready, _ = ray.wait([f.gen for f in live.values()], num_returns=1, timeout=WATCH_S)
            for gen in ready:
                f = live[gen]
                f.heard = time.monotonic()
                final = self._take(f, on_event)
                if final is not None:
                    del live[gen]
                    self._finish(ws, f.mk, final, on_event)
            if time.monotonic() - checked >= WATCH_S:
                checked = time.monotonic()
                self._drop_orphans(ws, live, on_event)
        return keys

    def _take(self, f: _Followed, on_event: Callable[[MintKey, str], None] | None) -> dict[str, Any] | None:
        """Read one message of a ready stream: a phase goes to `on_event` (a change of node shows
        as `retrying`); returns the key's last word once its stream ends or breaks."""
        import ray

        try:
            message = ray.get(next(f.gen))
        except StopIteration:
            return f.final
        except ray.exceptions.RayError as exc:
            return _failure(Code.FLEET_ERROR, f"{type(exc).__name__}: {exc}")
        if "phase" not in message:
            f.final = message
            return None
        key = f.mk.key
        if self.placed.get(key, message["node"]) != message["node"] and on_event:
            on_event(f.mk, "retrying")
        self.placed[key] = message["node"]
        if on_event:
            on_event(f.mk, message["phase"])
        return None

    def _drop_orphans(
        self, ws: Workspace, live: dict[Any, _Followed], on_event: Callable[[MintKey, str], None] | None
    ) -> None:
        """A key silent for WATCH_S that no live node can take any more (its sm, and a GPU for a
        CUDA key) is cancelled and failed (`fleet-node-lost`), never left queued for a node that
        will not come."""
        import ray

        quiet = [f for f in live.values() if time.monotonic() - f.heard >= WATCH_S]
        if not quiet:
            return
        nodes = offered()
        for f in quiet:
            sm = f.mk.target.id.sm
            if placeable(sm, nodes):
                continue
            ray.cancel(f.gen, force=True)
            del live[f.gen]
            offer = " with a GPU" if "GPU" in needs(sm) else ""
            detail = f"no live node offers {sm!r}{offer} any more (the node minting it was lost)"
            self._finish(ws, f.mk, _failure(Code.FLEET_NODE_LOST, detail), on_event)

    def _finish(
        self,
        ws: Workspace,
        mk: MintKey,
        final: dict[str, Any],
        on_event: Callable[[MintKey, str], None] | None,
    ) -> None:
        """Take the key's result and keep its record on the driver too."""
        try:
            mk.result = outcome_from_json(final.get("result"))
        except BadResult as e:
            detail = f"the node's result is not a mint result: {e}"
            mk.result = MintFailed(Code.FLEET_ERROR, Phase.FLEET, detail)
        settle_visibility(ws, mk, final.get("node", {}).get("host", "?"))
        if "record" in final:
            write_json(ws.state.record(mk.key), {**final["record"], "node": final["node"]}, indent=1)
        if on_event:
            on_event(mk, "done" if mk.minted else "failed")


def settle_visibility(ws: Workspace, mk: MintKey, host: str) -> None:
    """A key minted on a node counts only once this driver can serve it: from its own store (a
    workspace on a shared filesystem) or from the shared remote the node published to. Else the
    artifact sits on one node's disk where no plan will find it, so the key fails, named."""
    if not mk.minted:
        return
    remote = ws.remote
    try:
        # one ref read, not a listing of the whole store per finished key
        visible = ws.store().ref_state(mk.key) == "fresh" or (
            remote is not None and remote.get_json(remote.ref_name(mk.key)) is not None
        )
    except RemoteError as exc:
        mk.result = MintFailed(Code(exc.code), Phase.ADMIT, exc.detail)
        return
    if not visible:
        mk.result = MintFailed(
            Code.NOT_VISIBLE,
            Phase.ADMIT,
            f"node {host} minted {mk.key[:12]} into a store this driver cannot read: declare a shared "
            "remote store (docs/store.md) or keep the workspace on a filesystem every node shares",
        )


# ---- node ---------------------------------------------------------------------------------------
class _Refusal(Exception):
    def __init__(self, code: Code, detail: str) -> None:
        super().__init__(detail)
        self.code, self.detail = code, detail


def _workspace_here(order: Order) -> tuple[Workspace, MintKey]:
    """The driver's workspace as this node sees it, refused unless its Cgfile is the same file."""
    path = Path(order.cgfile)
    host = socket.gethostname()
    try:
        here = sha256_file(str(path))
    except OSError as exc:
        raise _Refusal(
            Code.WORKSPACE_MISSING, f"node {host} cannot read the workspace's Cgfile {path}: {exc.strerror}"
        ) from None
    if here != order.cgfile_sha256:
        raise _Refusal(
            Code.WORKSPACE_DRIFT,
            f"node {host} has a different Cgfile at {path} (sha256 {here[:12]}, the driver's "
            f"{order.cgfile_sha256[:12]}): run one checkout of the workspace on every node",
        )
    ws = Workspace(cgfile.load(path))
    target = {t.label: t for t in expand(ws.cg)}[order.entries[0].label]
    return ws, MintKey(order.key, order.entries, target, order.toolchain)


def pinned_environment(gpus: list[str]) -> dict[str, str]:
    """The mint child's environment: this process's, seeing exactly the GPUs Ray assigned the
    task (an empty `CUDA_VISIBLE_DEVICES` for a CPU key, which was assigned none: no GPU of the
    host). Set here, not left to Ray, which leaves the variable alone for a task that asked for
    no GPU and, under `RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`, for every task."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(gpus)}


def mint_on_node(order: Order) -> Iterator[dict[str, Any]]:
    """The Ray task: `mint_one` here, yielding `{"phase", "node"}` per phase, then the result.

    `done`/`failed` are the driver's to announce, once it holds the result.
    """
    import ray

    context = ray.get_runtime_context()
    node = context.get_node_id()
    host = socket.gethostname()
    gpus = sorted(context.get_accelerator_ids().get("GPU", []))
    try:
        ws, mk = _workspace_here(order)
    except (_Refusal, UserError) as exc:
        code = exc.code if isinstance(exc, _Refusal) else Code.WORKSPACE_DRIFT
        yield _failure(code, str(exc))
        return
    sm = mk.target.id.sm
    if device_of(sm) == CUDA and len(gpus) != 1:
        detail = f"node {host} gave this {sm} key {len(gpus)} GPUs: a CUDA key mints on exactly one"
        yield _failure(Code.NO_GPU_FOR_SM, detail)
        return
    env = pinned_environment(gpus)
    events: queue.Queue[str | None] = queue.Queue()
    raised: list[BaseException] = []

    def run() -> None:
        try:
            mint_one(ws, mk, ws.store(), lambda _mk, phase: events.put(phase), env=env)
        except BaseException as exc:  # re-raised below: the driver sees the task fail with it
            raised.append(exc)
        finally:
            events.put(None)

    worker = threading.Thread(target=run, name=f"mint {mk.key[:12]}")
    worker.start()
    while (phase := events.get()) is not None:
        if phase not in ("done", "failed"):
            yield {"phase": phase, "node": node}
    worker.join()
    if raised:
        raise raised[0]
    record = ws.state.read_record(mk.key) or {}
    assert mk.result is not None  # mint_one always ends with one
    yield {"result": mk.result.to_json(), "record": record, "node": {"id": node, "host": host, "gpus": gpus}}
