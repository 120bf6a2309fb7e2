"""Fleet mints on a real local Ray cluster: nodes on loopback advertise fake sm resources and run
real CPU mints (AOTInductor compiles of the toy), so placement, streaming, retry and records are
Ray's and cgbuild's own, never stand-ins. GPUs are Ray's own counters too (`num_gpus` of a node
here without one): Ray schedules and assigns them as on a GPU host, and the mint child of a CUDA
key, started pinned to its assignment, reports what it was given before it refuses the device.

The head carries no `cpu` resource; each test adds the worker nodes it needs and removes them,
so which node can run a key is decided by the test. Compiles are few: one fleet mint, one local
mint to compare shapes with, one mint whose node is killed mid-compile (retried elsewhere), one
whose only capable node is killed mid-compile. A node is lost the hard way: its raylet and the
node's other daemons SIGKILLed at once (`allow_graceful=False`), as when a machine drops off.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest
from support.cli import cli
from support.publishers import keypair
from support.s3 import BUCKET, S3
from support.toy import copy_toy

from cgbuild.config import cgfile
from cgbuild.config.labels import parse_selector
from cgbuild.config.targets import Target, expand
from cgbuild.core.errors import UserError
from cgbuild.exec import fleet
from cgbuild.exec.mint import MintKey, approved
from cgbuild.plan.entries import PlanEntry
from cgbuild.plan.planner import Workspace, make_plan
from cgbuild.plan.reasons import Status
from cgbuild.protocol.mint import Minted, MintFailed
from cgbuild.store.local import Store
from cgbuild.store.s3 import Remote
from cgbuild.store.seal import read_metadata
from cgbuild.store.trust import SIGNING_KEY_ENV, key_id, public_key_bytes

ray = pytest.importorskip("ray")


def entry_of(t: Target) -> PlanEntry:
    """A plan entry of `t` whose key is still to be minted: what a MintKey groups."""
    return PlanEntry(
        t.label,
        t.id.family,
        t.id.module,
        t.id.graph_class,
        t.id.layout,
        "",
        t.id.sm,
        tuple(t.skus),
        {},
        None,
        Status.MINT,
        {},
        (),
        "",
    )


from ray._private import ray_constants  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = pytest.mark.slow

MB = 1 << 20
NODE = {"num_cpus": 1, "object_store_memory": 100 * MB}
MLP8 = "//toy/mlp/8x64-b1@fp32:cpu"
MLP16 = "//toy/mlp/16x64-b1@fp32:cpu"
CONV = "//toy/conv/32x32-b2@fp32:cpu"
MINT_TIMEOUT_S = 900
"""A fleet mint that outlives this is stuck, not slow."""
ORPHAN_GRACE_S = 30
"""A Ray worker notices its raylet gone within about a second, and its mint child dies with it."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A head without sm resources, this process joined to it as the driver, on 127.0.0.1.

    Ray gives a node this machine's routable address (and its servers every interface) unless it
    runs as a single-host cluster, the switch below; the nodes, their workers and the cgbuild
    drivers the tests start inherit it, so the whole cluster talks over loopback alone."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, "0")
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
        mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)  # read when this process was imported
        c = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 0, "object_store_memory": 100 * MB, "include_dashboard": False},
        )
        assert c.address.startswith("127.0.0.1:"), c.address
        fleet.connect(fleet.ExecutorChoice("ray", c.address))
        try:
            yield c
        finally:
            ray.shutdown()
            c.shutdown()


@contextmanager
def nodes(c: Cluster, *resources: dict[str, float]) -> Iterator[list[Any]]:
    """Worker nodes advertising these resources for the test's duration (`GPU`: Ray's `num_gpus`)."""
    added = [
        c.add_node(**NODE, num_gpus=r.get("GPU", 0), resources={k: v for k, v in r.items() if k != "GPU"})
        for r in resources
    ]
    c.wait_for_nodes()
    try:
        yield added
    finally:
        for node in added:
            if node in c.worker_nodes:
                c.remove_node(node)


def mint_json(ws: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any], str]:
    proc = cli(ws, "mint", *args, "--json", env=env, timeout=MINT_TIMEOUT_S)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def shape(value: Any) -> Any:
    """The keys of a JSON value, recursively (lists by their first element)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


H100 = ("h100", "sm_90", 80)
B200 = ("b200", "sm_100", 180)


def with_skus(ws: Path, *skus: tuple[str, str, int]) -> Path:
    """The toy workspace whose targets also build for these SKUs (name, sm, memory in GiB)."""
    text = (ws / "Cgfile").read_text()
    names = ", ".join(f'"{name}"' for name, _, _ in skus)
    text = text.replace('skus = ["cpu"]', f'skus = ["cpu", {names}]')
    text += "".join(f'\n[sku.{name}]\nsm = "{sm}"\nmemory_gib = {gib}\n' for name, sm, gib in skus)
    (ws / "Cgfile").write_text(text)
    return ws


def planned(ws: Path, label: str) -> tuple[Workspace, MintKey]:
    w = Workspace(cgfile.load(ws / "Cgfile"))
    (mk,) = approved(make_plan(w, parse_selector(label)), w)
    return w, mk


def on_sm_90(ws: Workspace, mk: MintKey) -> MintKey:
    """A planned CPU key as its target's sm_90 key (CPU torch plans none): the same request for a
    CUDA device, which the mint child refuses `wrong-device` here, naming the
    `CUDA_VISIBLE_DEVICES` it was started with."""
    (entry,) = mk.entries
    label = entry.label.removesuffix(":cpu") + ":sm_90"
    target = next(t for t in expand(ws.cg) if t.label == label)
    gpu = dataclasses.replace(entry, label=label, sm="sm_90", skus=(H100[0],))
    return MintKey(mk.key, [gpu], target, {**mk.toolchain, "platform": "cuda"})


def compiling_on(
    executor: fleet.Fleet, ws: Workspace, mk: MintKey
) -> tuple[threading.Thread, threading.Event, list[str]]:
    """The fleet mint of `mk` on a thread, the event set once the key's compile starts, and the
    phases the board was shown."""
    compiling = threading.Event()
    events: list[str] = []

    def on_event(_mk: MintKey, phase: str) -> None:
        events.append(phase)
        if phase == "compile":
            compiling.set()

    run = threading.Thread(target=executor.mint_keys, args=(ws, [mk], on_event))
    run.start()
    return run, compiling, events


def command(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return "(gone)"


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_node(c: Cluster, node: Any) -> None:
    """Remove `node` without grace while it mints: its raylet SIGKILLed, and with it every process
    under it, its Ray workers and their mint children (checked: the mint child was there, and
    within seconds nothing under the raylet is left, whoever adopted it)."""
    raylet = psutil.Process(node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid)
    under = [raylet, *raylet.children(recursive=True)]
    assert any("cgbuild_rules.mint" in command(p) for p in under[1:]), [command(p) for p in under]
    c.remove_node(node, allow_graceful=False)

    deadline = time.monotonic() + ORPHAN_GRACE_S
    while any(map(alive, under)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in under if alive(p)]
    for p in left:  # a failing run tidies up after itself
        p.kill()
    assert not left, f"outlived their raylet: {[command(p) for p in left]}"


def consistent(store: Store) -> list[str]:
    """The store's keys, once every ref verifies and every object is named by a ref (no partial
    object, no ref without its object)."""
    assert all(v.status == "ok" for v in store.verify_all()), store.verify_all()
    report = store.gc(dry_run=True)
    assert report.objects_removed == [] and report.refs_dropped == [], report
    return [r.key for r in store.iter_refs()]


# ---- no cluster needed ------------------------------------------------------------------------
def test_parse_executor() -> None:
    assert fleet.parse_executor("local") == fleet.ExecutorChoice("local")
    assert fleet.parse_executor("ray") == fleet.ExecutorChoice("ray")
    assert fleet.parse_executor("ray://10.0.0.1:6379") == fleet.ExecutorChoice("ray", "10.0.0.1:6379")
    for bad in ("ray://", "ray://host", "ray://host:port", "slurm", "Ray"):
        with pytest.raises(UserError, match="unknown executor"):
            fleet.parse_executor(bad)


def test_bad_or_unreachable_executor_is_bad_input(tmp_path: Path, toy_reference: Path) -> None:
    ws = copy_toy(tmp_path / "toy", toy_reference)
    proc = cli(ws, "mint", MLP8, "--executor", "slurm", timeout=MINT_TIMEOUT_S)
    assert proc.returncode == 2 and "unknown executor" in proc.stderr
    started = time.monotonic()  # nothing listens there: refused in seconds, not after Ray's 2 min
    proc = cli(ws, "mint", MLP8, "--executor", "ray://127.0.0.1:1", timeout=60)
    assert proc.returncode == 2 and "cannot reach the Ray head" in proc.stderr
    assert time.monotonic() - started < 30


def test_check_on_the_fleet_is_refused(tmp_path: Path) -> None:
    proc = cli(tmp_path, "mint", MLP8, "--check", "--executor", "ray://127.0.0.1:1", timeout=MINT_TIMEOUT_S)
    assert proc.returncode == 2 and "--check compares bytes on this machine" in proc.stderr


def test_admission_blocks_keys_no_node_offers(tmp_path: Path, toy_reference: Path) -> None:
    ws = with_skus(copy_toy(tmp_path / "toy", toy_reference), H100, B200)
    targets = [t for t in expand(cgfile.load(ws / "Cgfile")) if t.id.graph_class == "8x64-b1"]
    keys = [MintKey(f"{i:064x}", [entry_of(t)], t, {}) for i, t in enumerate(targets)]

    def sms(mks: list[MintKey]) -> set[str]:
        return {mk.target.id.sm for mk in mks}

    def refusals(rows: list[dict[str, Any]]) -> dict[str, str]:
        return {r["label"].rpartition(":")[2]: r["code"] for r in rows}

    runnable, refused = fleet.admission(keys, [{"cpu": 2.0, "CPU": 2.0}, {"sm_90": 1.0, "GPU": 1.0}])
    assert sms(runnable) == {"cpu", "sm_90"}
    assert refusals(refused) == {"sm_100": "no-node-for-sm"}
    assert "nodes offer: cpu, sm_90" in refused[0]["detail"]
    # Ray's own CPU (cores) is not the cpu sm: a cluster of plain nodes mints no CPU key
    runnable, refused = fleet.admission(keys, [{"CPU": 8.0}])
    assert runnable == [] and len(refused) == len(keys)
    # a CUDA key needs its sm and a GPU on ONE node; a CPU key needs no GPU
    for no_gpu in ([{"cpu": 1.0}, {"sm_90": 2.0}], [{"cpu": 1.0, "GPU": 1.0}, {"sm_90": 2.0}]):
        runnable, refused = fleet.admission(keys, no_gpu)
        assert sms(runnable) == {"cpu"}
        assert refusals(refused) == {"sm_90": "no-gpu-for-sm", "sm_100": "no-node-for-sm"}
        gpu_rows = [r for r in refused if r["code"] == "no-gpu-for-sm"]
        assert all("advertise 'sm_90' but none of them has a GPU" in r["detail"] for r in gpu_rows)


def test_task_options_ask_one_gpu_for_a_cuda_key_and_none_for_a_cpu_key() -> None:
    assert fleet.task_options("sm_90") == {"resources": {"sm_90": 1.0}, "num_gpus": 1.0, "num_cpus": 0}
    assert fleet.task_options("sm_120") == {"resources": {"sm_120": 1.0}, "num_gpus": 1.0, "num_cpus": 0}
    assert fleet.task_options("cpu") == {"resources": {"cpu": 1.0}, "num_gpus": 0, "num_cpus": 0}


def test_a_key_the_driver_cannot_see_counts_as_not_minted(tmp_path: Path, toy_reference: Path) -> None:
    """A node that admitted into a store the driver does not share (no remote, no shared
    filesystem) has minted nothing this driver can serve: the key fails, naming the node."""
    ws = Workspace(cgfile.load(copy_toy(tmp_path / "toy", toy_reference) / "Cgfile"))
    target = next(t for t in expand(ws.cg) if t.label == MLP8)
    ok = Minted("a" * 64, "gone.tar.gz", "c" * 64, 12, {}, {}, admission="admitted")
    unseen = MintKey("a" * 64, [entry_of(target)], target, {}, result=ok)
    fleet.settle_visibility(ws, unseen, "node-7")
    assert isinstance(unseen.result, MintFailed) and unseen.result.code == "not-visible"
    assert unseen.result.phase == "admit" and "node-7" in unseen.result.detail
    artifact = tmp_path / "sealed.bin"
    artifact.write_bytes(b"sealed bytes")
    ws.store().admit("b" * 64, artifact)
    seen = MintKey("b" * 64, [entry_of(target)], target, {}, result=ok)
    fleet.settle_visibility(ws, seen, "node-7")
    assert seen.result is ok


# ---- on the cluster ---------------------------------------------------------------------------
def test_offered_is_what_live_nodes_advertise(cluster: Cluster) -> None:
    with nodes(cluster, {"sm_90": 1, "GPU": 2}) as (node,):
        offers = fleet.offered()
        assert [(n["sm_90"], n["GPU"]) for n in offers if "sm_90" in n] == [(1, 2)]
        assert not any("cpu" in n for n in offers)
        cluster.remove_node(node)
        deadline = time.monotonic() + 60
        while any("sm_90" in n for n in fleet.offered()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not any("sm_90" in n for n in fleet.offered())


def test_node_refuses_a_workspace_it_does_not_share(
    cluster: Cluster, tmp_path: Path, toy_reference: Path
) -> None:
    ws = Workspace(cgfile.load(copy_toy(tmp_path / "toy", toy_reference) / "Cgfile"))
    target = next(t for t in expand(ws.cg) if t.label == MLP8)
    order = fleet.order_for(ws, MintKey("0" * 64, [entry_of(target)], target, {}))
    task = ray.remote(fleet.mint_on_node).options(resources={"cpu": 1}, num_cpus=0, num_returns="streaming")
    with nodes(cluster, {"cpu": 1}):
        for changed, code in (
            ({"cgfile_sha256": "f" * 64}, "workspace-drift"),  # another checkout at the same path
            ({"cgfile": str(tmp_path / "elsewhere" / "Cgfile")}, "workspace-missing"),
        ):
            (last,) = [ray.get(ref) for ref in task.remote(dataclasses.replace(order, **changed))]
            assert last["result"]["code"] == code and last["result"]["retryable"] is False, last


def test_cli_fleet_mint_lands_on_a_cpu_node_with_a_local_mints_records(
    cluster: Cluster, tmp_path: Path, toy_reference: Path
) -> None:
    ws = copy_toy(tmp_path / "toy", toy_reference)
    with nodes(cluster, {"sm_90": 1}, {"cpu": 1, "GPU": 1}) as (_gpu, cpu):
        rc, remote, stderr = mint_json(ws, MLP8, "--executor", f"ray://{cluster.address}")
    assert rc == 0, (remote, stderr)
    assert [m["labels"] for m in remote["minted"]] == [[MLP8]] and not remote["failed"]
    assert f"{MLP8}: compile" in stderr and f"{MLP8}: done" in stderr  # phases streamed from the node
    key = remote["minted"][0]["key"]
    record = json.loads((ws / ".cgbuild" / "mint" / f"{key}.json").read_text())
    assert record["state"] == "ok" and record["node"]["id"] == cpu.node_id
    # a CPU key asks Ray for no GPU, though its node has one, and its mint child is shown none
    assert record["node"]["gpus"] == []
    assert record["result"]["device"] == remote["minted"][0]["device"] == {"type": "cpu", "visible": ""}
    meta = read_metadata(Store(ws / ".cgbuild" / "store").resolve(key).path)
    assert meta["key"] == key and meta["sm"] == "cpu"
    assert "visible" not in json.dumps(meta)  # the device it was verified on is never sealed
    # the same workspace minted locally (seeing no GPU, as a node shows a CPU key): one summary
    # shape, one record shape (plus the node)
    rc, local, _ = mint_json(ws, MLP16, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert rc == 0, local
    assert shape(remote) == shape(local)
    local_record = json.loads((ws / ".cgbuild" / "mint" / f"{local['minted'][0]['key']}.json").read_text())
    assert shape(record) == {**shape(local_record), "node": {"id": "str", "host": "str", "gpus": []}}


def test_cuda_mints_on_one_host_each_run_on_the_gpu_ray_assigned(
    cluster: Cluster, tmp_path: Path, toy_reference: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two sm_90 keys on one node declaring two GPUs: each task asks Ray for one GPU, and each
    mint child runs under exactly the GPU Ray assigned its task; running at once, the two hold
    different GPUs. The node's workers are told to leave `CUDA_VISIBLE_DEVICES` alone
    (`RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`), so the pin seen here is the fleet's own.
    With no GPU here each child refuses `wrong-device`, naming what it was given."""
    monkeypatch.setenv("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "1")  # the node inherits it
    ws = with_skus(copy_toy(tmp_path / "toy", toy_reference), H100)
    w, first = planned(ws, MLP8)
    keys = [on_sm_90(w, first), on_sm_90(w, planned(ws, MLP16)[1])]
    with nodes(cluster, {"sm_90": 2, "GPU": 2}, {"sm_90": 2}):
        assert fleet.admission(keys, fleet.offered()) == (keys, [])
        fleet.Fleet().mint_keys(w, keys)
    for mk in keys:  # each mint child ran, and found no GPU here
        assert isinstance(mk.result, MintFailed) and mk.result.code == "wrong-device", mk.result
    records = [json.loads(w.state.record(mk.key).read_text()) for mk in keys]
    (start_a, end_a), (start_b, end_b) = [(r["started"], r["finished"]) for r in records]
    assert start_a < end_b and start_b < end_a, "the two mints did not run at once"
    assert sorted(r["node"]["gpus"] for r in records) == [["0"], ["1"]]  # one GPU each, not the same
    for mk, record in zip(keys, records, strict=True):
        assert isinstance(mk.result, MintFailed)
        (gpu,) = record["node"]["gpus"]
        assert mk.result.facts["visible"] == record["result"]["visible"] == gpu
        assert f"(CUDA_VISIBLE_DEVICES='{gpu}')" in mk.result.detail


def test_a_cuda_key_never_runs_without_a_gpu_of_its_own(
    cluster: Cluster, tmp_path: Path, toy_reference: Path
) -> None:
    """A node that advertises sm_90 but has no GPU: a task given no GPU is refused on the node
    before any mint child starts, and the executor's own task, which waits for a GPU no live
    node offers, fails instead of staying queued."""
    ws = with_skus(copy_toy(tmp_path / "toy", toy_reference), H100)
    w, mk = planned(ws, MLP8)
    key = on_sm_90(w, mk)
    task = ray.remote(fleet.mint_on_node).options(resources={"sm_90": 1}, num_cpus=0, num_returns="streaming")
    with nodes(cluster, {"sm_90": 1}):
        (last,) = [ray.get(ref) for ref in task.remote(fleet.order_for(w, key))]
        assert last["result"]["code"] == "no-gpu-for-sm", last
        assert "0 GPUs: a CUDA key mints on exactly one" in last["result"]["detail"]
        run = threading.Thread(target=fleet.Fleet().mint_keys, args=(w, [key]))
        run.start()
        run.join(120)
        assert not run.is_alive(), "a CUDA key waited for a GPU no node offers"
    assert isinstance(key.result, MintFailed) and key.result.code == "fleet-node-lost", key.result
    assert "no live node offers 'sm_90' with a GPU" in key.result.detail
    assert not w.state.record(key.key).exists()  # no mint started anywhere


def test_fleet_mint_publishes_signed_into_the_shared_store(
    cluster: Cluster, s3: S3, tmp_path: Path, toy_reference: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a shared remote declared, the node that mints also signs and publishes: the key is
    in the remote, signed by the node's publisher key, and the driver counts it minted."""
    key_path, entry = keypair(tmp_path / "keys", "fleet")
    monkeypatch.setenv(SIGNING_KEY_ENV, str(key_path))  # the nodes' and the driver's environment
    url = f"s3://{BUCKET}/fleet-{int(time.time())}"
    ws = copy_toy(tmp_path / "toy", toy_reference)
    text = (ws / "Cgfile").read_text()
    declared = f"[workspace]\nremote = {json.dumps(url)}\ntrusted = {json.dumps([entry])}\n"
    (ws / "Cgfile").write_text(text.replace("[workspace]\n", declared, 1))
    with nodes(cluster, {"cpu": 1}):
        rc, summary, stderr = mint_json(ws, MLP8, "--executor", f"ray://{cluster.address}")
    assert rc == 0, (summary, stderr)
    (minted,) = summary["minted"]
    remote = Remote(url)
    assert minted["key"] in remote.list_keys()
    ref = remote.get_json(remote.ref_name(minted["key"]))
    assert ref is not None and ref.doc["signature"]["key_id"] == key_id(public_key_bytes(entry.split(":")[1]))
    assert remote.has_object(ref.doc["object"], ref.doc["size"])


def test_node_lost_mid_mint_is_retried_on_another_without_partial_state(
    cluster: Cluster, tmp_path: Path, toy_reference: Path
) -> None:
    ws, mk = planned(copy_toy(tmp_path / "toy", toy_reference), CONV)
    executor = fleet.Fleet()
    with nodes(cluster, {"cpu": 1}, {"cpu": 1}) as pair:
        run, compiling, events = compiling_on(executor, ws, mk)
        assert compiling.wait(300)
        first = next(n for n in pair if n.node_id == executor.placed[mk.key])
        kill_node(cluster, first)
        run.join(900)
    assert not run.is_alive()
    assert isinstance(mk.result, Minted), mk.result
    assert mk.result.admission == "admitted"
    assert "retrying" in events and events[-1] == "done"
    survivor = next(n for n in pair if n is not first)
    record = json.loads(ws.state.record(mk.key).read_text())
    assert record["state"] == "ok" and record["node"]["id"] == survivor.node_id
    assert consistent(Store(ws.cg.store_dir)) == [mk.key]
    assert not list(ws.state.build.glob("*.tar.gz"))  # the sealed file went into the store


def test_last_capable_node_lost_fails_instead_of_queueing(
    cluster: Cluster, tmp_path: Path, toy_reference: Path
) -> None:
    ws, mk = planned(copy_toy(tmp_path / "toy", toy_reference), MLP8)
    executor = fleet.Fleet()
    with nodes(cluster, {"cpu": 1}, {"sm_90": 1}) as (node, _gpu):
        run, compiling, _ = compiling_on(executor, ws, mk)
        assert compiling.wait(300)
        kill_node(cluster, node)
        run.join(120)
    assert not run.is_alive()
    assert isinstance(mk.result, MintFailed), mk.result
    assert mk.result.code == "fleet-node-lost" and mk.result.retryable, mk.result
    assert consistent(Store(ws.cg.store_dir)) == []
