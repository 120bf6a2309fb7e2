"""A Ray cluster of separate processes (`ray start --head`, `ray start --address ...`) on a
loopback-only network of its own, for the fleet's smoke test.

Why a network namespace: `ray start` turns `--node-ip-address=127.0.0.1` into this machine's
routable address (Ray resolves loopback away so that other hosts can reach the node), and its
servers then listen on every interface. In a user and network namespace whose only interface is
`lo`, Ray's own discovery finds no route out and settles on 127.0.0.1, binds its servers to it
(Ray listens on loopback alone exactly when a node's address is 127.0.0.1), and the kernel
refuses every other address: nothing the cluster does reaches past loopback. The namespace's
ports are all free, so every port each node opens is fixed here (`Ports`), none left to Ray.

Why a PID (and mount) namespace too: `ray stop` stops every Ray process it can see, and inside
the namespace it sees only this cluster's. And the namespace's first process (the holder, this
file run as a script) ends when its standard input closes, which happens when the process that
made the namespace is gone, however it ended; the kernel then kills whatever is left in the
namespace, so a killed pytest leaves no Ray process behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GCS_PORT = 6379
DASHBOARD_PORT = 8265
OBJECT_STORE_BYTES = 100 << 20
START_TIMEOUT_S = 120.0
SOCKET_PATH_MAX = 107
"""A unix socket's path fits in 108 bytes (with its NUL); Ray's sockets sit in `--temp-dir`."""
SOCKET_PATH_ROOM = 64
"""What Ray adds under `--temp-dir` for its sockets, at most: `/session_<date>_<time>_<usec>_<pid>`
(a small pid inside the namespace) then `/sockets/plasma_store.<node>`."""
UNSHARE = ("unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--mount-proc", "--kill-child")
_LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
"""127.0.0.1, ::1 and ::ffff:127.0.0.1 as /proc/net/tcp{,6} spell them."""
_IFF_UP, _IFF_LOOPBACK, _IFF_RUNNING, _SIOCSIFFLAGS = 0x1, 0x8, 0x40, 0x8914


@dataclass(frozen=True)
class Ports:
    """Every port one node listens on, chosen here: a node at `index` owns 10,000 + 1,000 x index
    up to the next thousand (the head's GCS and dashboard ports are `GCS_PORT`, `DASHBOARD_PORT`)."""

    index: int

    @property
    def base(self) -> int:
        return 10_000 + 1_000 * self.index

    @property
    def node_manager(self) -> int:
        """The raylet's port: how the head's node table names this node."""
        return self.base + 1

    @property
    def workers(self) -> range:
        """One port per Ray worker process of the node (`--min-worker-port`..`--max-worker-port`)."""
        return range(self.base + 100, self.base + 200)

    def flags(self) -> list[str]:
        names = (
            "node-manager-port",
            "object-manager-port",
            "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port",
            "metrics-export-port",
            "runtime-env-agent-port",
        )
        fixed = [f"--{name}={self.base + i + 1}" for i, name in enumerate(names)]
        return [*fixed, f"--min-worker-port={self.workers[0]}", f"--max-worker-port={self.workers[-1]}"]

    def all(self) -> set[int]:
        return {self.base + i + 1 for i in range(6)} | set(self.workers)


def ray_binary() -> Path:
    """The `ray` of this Python's environment (never another one on PATH)."""
    return Path(sysconfig.get_path("scripts")) / "ray"


def _loopback_up() -> None:
    """`ip link set lo up`, without needing iproute2: a new network namespace's `lo` is down."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = _IFF_UP | _IFF_LOOPBACK | _IFF_RUNNING
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags))


def _hold() -> None:
    """The holder, the namespace's first process: `lo` up, then wait for standard input to close.
    As the namespace's init it reaps the orphans it inherits (SIGCHLD ignored), else `ray stop`
    waits out its grace period on zombies."""
    _loopback_up()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    print("ready", flush=True)
    sys.stdin.buffer.read()


@dataclass
class Nodes:
    """One cluster's namespace; `run` starts a command inside it, as a process of the cluster."""

    folder: Path
    holder: subprocess.Popen[bytes]
    pid: int
    """The holder's pid as this (outer) namespace sees it: what `nsenter` joins."""
    env: dict[str, str]
    nodes: list[Ports] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{GCS_PORT}"

    def run(self, argv: Sequence[str], *, timeout: float) -> subprocess.CompletedProcess[str]:
        """`argv` inside the namespace (its output captured), with the cluster's environment."""
        enter = ["nsenter", "-t", str(self.pid), "-U", "-n", "-p", "-m", "--preserve-credentials"]
        return subprocess.run([*enter, *argv], env=self.env, capture_output=True, text=True, timeout=timeout)

    def _start(self, argv: list[str]) -> Ports:
        ports = Ports(len(self.nodes))
        flags = [*ports.flags(), "--node-ip-address=127.0.0.1", f"--temp-dir={self.folder}"]
        flags += ["--disable-usage-stats", f"--object-store-memory={OBJECT_STORE_BYTES}"]
        proc = self.run([str(ray_binary()), "start", *argv, *flags], timeout=START_TIMEOUT_S)
        if proc.returncode != 0:
            output = f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
            raise RuntimeError(f"ray start {' '.join(argv)} failed:\n{output}")
        self.nodes.append(ports)
        return ports

    def head(self) -> Ports:
        """The head: it schedules and advertises no resource (no CPU, no sm), so no key lands on it."""
        dashboard = ["--include-dashboard=false", f"--dashboard-port={DASHBOARD_PORT}"]
        return self._start(["--head", f"--port={GCS_PORT}", *dashboard, "--num-cpus=0"])

    def worker(self, resources: dict[str, float]) -> Ports:
        """A worker node advertising `resources` (its sm values) and one Ray CPU."""
        offers = f"--resources={json.dumps(resources)}"
        return self._start([f"--address={self.address}", "--num-cpus=1", offers])

    def listening(self) -> list[tuple[str, int]]:
        """(address, port) of every TCP socket listening in the namespace: its own /proc view."""
        found = []
        for table in ("tcp", "tcp6"):
            for line in Path(f"/proc/{self.pid}/net/{table}").read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A":  # LISTEN
                    host, port = local.split(":")
                    found.append(("loopback" if host in _LOOPBACK else host, int(port, 16)))
        return found

    def interfaces(self) -> list[str]:
        lines = Path(f"/proc/{self.pid}/net/dev").read_text().splitlines()[2:]
        return sorted(line.split(":")[0].strip() for line in lines)

    def declared_ports(self) -> set[int]:
        return {GCS_PORT, DASHBOARD_PORT}.union(*(p.all() for p in self.nodes))

    def stop(self) -> None:
        """`ray stop --force` (it sees only this namespace's processes), then the holder's input
        closed: the namespace and anything still in it go with it."""
        if self.holder.poll() is None and self.nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.run([str(ray_binary()), "stop", "--force"], timeout=60)
        if self.holder.stdin is not None:
            self.holder.stdin.close()
        try:
            self.holder.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.holder.kill()
            self.holder.wait()


def namespace_refusal() -> str | None:
    """Why this machine makes no namespace for the nodes (no user namespaces allowed, no
    util-linux `unshare`), or None when it makes one. Asked apart from `open_namespace`, so a
    namespace that is made but leaves the cluster off loopback fails its test instead of skipping."""
    try:
        done = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return None if done.returncode == 0 else (done.stderr.strip() or f"exit {done.returncode}")[-300:]


def open_namespace(folder: Path, env: dict[str, str]) -> Nodes:
    """A new namespace with its holder running, not yet any node; every process of the cluster
    gets this process's environment with `env` added. `OSError` where the namespace cannot be
    made (no user namespaces allowed here, no util-linux `unshare` and `nsenter`)."""
    if len(str(folder)) + SOCKET_PATH_ROOM > SOCKET_PATH_MAX:
        raise ValueError(f"{folder} is too long for Ray's unix sockets under it (pytest --basetemp)")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **env}
    holder = subprocess.Popen(
        [*UNSHARE, sys.executable, __file__, "hold"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert holder.stdout is not None and holder.stderr is not None
    if holder.stdout.readline().strip() != b"ready":
        holder.wait()
        why = holder.stderr.read().decode(errors="replace")[-500:]
        raise OSError(f"no namespace for the Ray nodes ({' '.join(UNSHARE)}): {why}")
    (inner,) = Path(f"/proc/{holder.pid}/task/{holder.pid}/children").read_text().split()
    return Nodes(folder, holder, int(inner), env)


def nodes_seen(cluster: Nodes) -> list[dict[str, Any]]:
    """What the head knows of each node: id, node-manager port, resources, liveness (a driver
    inside the namespace asks it)."""
    ask = (
        "import json, ray\n"
        f"ray.init(address={cluster.address!r}, log_to_driver=False, logging_level='ERROR')\n"
        "print(json.dumps([{'id': n['NodeID'], 'port': n['NodeManagerPort'], 'alive': n['Alive'], "
        "'address': n['NodeManagerAddress'], 'resources': n['Resources']} for n in ray.nodes()]))\n"
    )
    proc = cluster.run([sys.executable, "-c", ask], timeout=START_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


if __name__ == "__main__":
    _hold()
