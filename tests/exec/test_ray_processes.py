"""The fleet on a Ray cluster of separate processes, as teams run it: `ray start --head` and
`ray start --address ...` worker nodes, each advertising its own resources, and a real CPU mint of
the toy through the CLI with `--executor ray://...` (support/raynodes.py: a namespace of its own
whose only network is loopback, every port fixed, usage stats off). `ray stop --force` is scoped
to the cluster, and a killed owner of the cluster leaves none of its processes behind.

Kept lean for CI: one head and two workers, one key compiled; a second head for the killed owner.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import raynodes
from support.procs import MARK, marked, wait_for
from support.toy import copy_toy

pytest.importorskip("ray")

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True, scope="module")
def _namespaces() -> None:
    """Without a namespace of its own the cluster would not stay on loopback: not run at all."""
    why = raynodes.namespace_refusal()
    if why is not None:
        pytest.skip(f"no user and network namespace here for a loopback-only Ray cluster: {why}")


MLP8 = "//toy/mlp/8x64-b1@fp32:cpu"
MINT_TIMEOUT_S = 900
TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[raynodes.Nodes]:
    """A namespace for the cluster; whatever the test does, nothing of it outlives the test."""
    token = uuid.uuid4().hex
    ns = raynodes.open_namespace(tmp_path_factory.mktemp("ray"), {MARK: token})
    try:
        yield ns
    finally:
        ns.stop()
        assert wait_for(lambda: not marked(token), 30), marked(token)


def test_cli_mint_lands_on_the_worker_node_that_advertises_its_sm(
    nodes: raynodes.Nodes, tmp_path: Path, toy_reference: Path
) -> None:
    nodes.head()
    gpu, cpu = nodes.worker({"sm_90": 1}), nodes.worker({"cpu": 1})
    seen = {n["port"]: n for n in raynodes.nodes_seen(nodes)}
    assert {n["address"] for n in seen.values()} == {"127.0.0.1"} and all(n["alive"] for n in seen.values())
    assert (
        seen[gpu.node_manager]["resources"]["sm_90"] == 1 and "cpu" not in seen[gpu.node_manager]["resources"]
    )
    assert seen[cpu.node_manager]["resources"]["cpu"] == 1
    ws = copy_toy(tmp_path / "toy", toy_reference)
    mint = [sys.executable, "-m", "cgbuild.cli", "-C", str(ws), "mint", MLP8, "--json"]
    proc = nodes.run([*mint, "--executor", f"ray://{nodes.address}"], timeout=MINT_TIMEOUT_S)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (minted,) = json.loads(proc.stdout.strip().splitlines()[-1])["minted"]
    record = json.loads((ws / ".cgbuild" / "mint" / f"{minted['key']}.json").read_text())
    assert record["state"] == "ok" and record["node"]["id"] == seen[cpu.node_manager]["id"]
    # the cluster lives on loopback alone, on the ports chosen for it
    assert nodes.interfaces() == ["lo"]
    listening = nodes.listening()
    assert {host for host, _ in listening} == {"loopback"}, listening
    assert {port for _, port in listening} <= nodes.declared_ports(), listening
    # `ray stop --force` stops this cluster only: a process outside the namespace that it would
    # take for one of Ray's (by its command line) lives on
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "log_monitor.py"])
    try:
        nodes.stop()
        assert decoy.poll() is None
    finally:
        decoy.kill()
        decoy.wait()


def test_a_killed_owner_leaves_no_ray_process(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The process that made the namespace is killed (as a killed pytest would be): the holder
    sees its input close and ends, and the kernel takes every process of the namespace with it."""
    token = uuid.uuid4().hex
    own = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from support import raynodes\n"
        "ns = raynodes.open_namespace(Path(sys.argv[1]), {sys.argv[2]: sys.argv[3]})\n"
        "ns.head()\n"
        "print('up', flush=True)\n"
        "time.sleep(600)\n"
    )
    folder = tmp_path_factory.mktemp("ray")
    owner = subprocess.Popen(
        [sys.executable, "-c", own, str(folder), MARK, token], stdout=subprocess.PIPE, cwd=TESTS
    )
    try:
        assert owner.stdout is not None and owner.stdout.readline() == b"up\n"
        assert any("gcs_server" in cmd for cmd in marked(token).values()), marked(token)
    finally:
        owner.kill()
        owner.wait()
    gone = wait_for(lambda: not marked(token), 30)
    survivors = marked(token)
    for pid in survivors:  # a failing run tidies up after itself (the holder first: it takes the rest)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    assert gone is True, f"outlived the namespace's owner: {survivors}"
