"""The S3 servers the fleet benchmarks run on loopback, and what each command asked of them.

moto's server (`moto_server`) logs every request, so its counts name the kind and the prefix
(`list refs`, `PUT facts`); SeaweedFS (`weed server`) counts requests in Prometheus counters by
kind only (`LIST`, `GET` with HEAD, `PUT`, `DELETE`). Both answer `requests()` (what was asked
since the last call), `listing` and `wrote` (what a check expects, in the server's own terms),
and `cpu()` (the server's CPU seconds, measured beside the client's).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from harness import REPO

HERE = Path(__file__).resolve().parent
RESULT = HERE / "results" / "fleet.json"
SEAWEEDFS_RESULT = HERE / "results" / "fleet_seaweedfs.json"
MB = 1 << 20
BUCKET = "cgbuild-fleet-bench"
SIGNING_KEY_ENV = "CGBUILD_SIGNING_KEY"  # cgbuild.store.trust.SIGNING_KEY_ENV
# werkzeug's access log line (colours included): "GET /bucket/prefix/refs/…?query HTTP/1.1" 200 -
REQUEST = re.compile(r'"(?:\x1b\[[0-9;]*m)*([A-Z]+) (\S+) HTTP/[\d.]+')
# SeaweedFS's counter of S3 requests, labels in Prometheus's (sorted) order
SEAWEED_REQUESTS = re.compile(
    r'^SeaweedFS_s3_request_total\{bucket="([^"]*)",code="[^"]*",type="([^"]*)"\} (\S+)$', re.M
)


class S3Server:
    """moto's S3 server (`moto_server`) as a subprocess on a free loopback port, with the bucket.

    Its access log (one line per request) counts what each command asked of the store.
    """

    name = "moto_server"

    def __init__(self, folder: Path) -> None:
        beside = Path(sys.executable).with_name("moto_server")
        exe = str(beside) if beside.exists() else shutil.which("moto_server")
        if exe is None:
            raise SystemExit(
                "moto_server is neither beside this Python nor on PATH: pip install 'moto[server]'"
            )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.log = folder / "moto.log"
        with open(self.log, "wb") as log:  # the server keeps its own descriptor
            self.proc = subprocess.Popen(
                [exe, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT
            )
        self.endpoint = f"http://127.0.0.1:{port}"
        self.version = md.version("moto")
        self._mark = 0
        nowhere = folder / "no-aws-config"
        self.env = {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_CONFIG_FILE": str(nowhere),
            "AWS_SHARED_CREDENTIALS_FILE": str(nowhere),
        }
        for _ in range(300):
            try:
                urllib.request.urlopen(self.endpoint, timeout=1).close()
                break
            except urllib.error.HTTPError:
                break  # it answers
            except OSError:
                time.sleep(0.1)
        else:
            raise SystemExit(f"moto_server did not come up: {self.log.read_text()[-2000:]}")
        import boto3

        session = boto3.session.Session(aws_access_key_id="testing", aws_secret_access_key="testing")
        session.client("s3", endpoint_url=self.endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        self.requests()

    def requests(self) -> Counter[str]:
        """Requests since the last call, by kind: `list refs`, `GET facts`, `PUT refs`, ..."""
        time.sleep(0.3)  # the server logs a request as it answers it
        data = self.log.read_bytes()
        new, self._mark = data[self._mark :], len(data)
        kinds: Counter[str] = Counter()
        for method, target in REQUEST.findall(new.decode(errors="replace")):
            url = urllib.parse.urlsplit(target)
            query = urllib.parse.parse_qs(url.query)
            if method == "GET" and "list-type" in query:
                kinds[f"list {query.get('prefix', [''])[0].split('/')[1]}"] += 1
            else:
                parts = url.path.split("/")  # "", bucket, prefix, area, ...
                kinds[f"{method} {parts[3] if len(parts) > 3 else url.path}"] += 1
        return kinds

    def listing(self, sub: str, pages: int) -> Counter[str]:
        """What `pages` list requests of `sub/` look like in `requests`."""
        return Counter({f"list {sub}": pages})

    def wrote(self, sent: Counter[str], area: str, n: int) -> bool:
        """`sent` holds exactly `n` PUTs under `area/`."""
        return sent[f"PUT {area}"] == n

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def cpu_seconds(pid: int) -> float:
    """A server's CPU seconds so far (user + sys): what answering cost, beside the client's."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def seaweedfs_support() -> Any:
    """tests/support/seaweedfs.py: SeaweedFS started as the shared-store tests start it (loopback,
    every port chosen, telemetry off, the committed test-only identity, a watchdog that stops it
    if this process dies), reached the way kill_points.py reaches the test support code."""
    sys.path.insert(0, str(REPO / "tests"))
    from support import seaweedfs

    return seaweedfs


class SeaweedServer:
    """SeaweedFS (`weed server`: master, volume, filer and S3 gateway in one process) on loopback,
    with the bucket. Its Prometheus request counters, served on a loopback port, count what each
    command asked: per bucket and per kind (`LIST`; `GET`, which counts HEADs too; `PUT`;
    `DELETE`), never per prefix."""

    name = "seaweedfs"

    def __init__(self, folder: Path) -> None:
        support = seaweedfs_support()
        self.server = support.start(folder / "weed", metrics=True)
        try:
            support.wait_ready(self.server, BUCKET)
        except BaseException:
            self.server.stop()
            raise
        self.version = self.server.version
        self.endpoint = f"http://127.0.0.1:{self.server.port}"
        self.env = support.client_env(self.endpoint, folder)
        self._seen = self._totals()

    def _totals(self) -> Counter[str]:
        time.sleep(0.3)  # a request is counted as it ends
        url = f"http://127.0.0.1:{self.server.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as page:
            text = page.read().decode()
        totals: Counter[str] = Counter()
        for bucket, kind, n in SEAWEED_REQUESTS.findall(text):
            if bucket == BUCKET:
                totals[kind] += int(float(n))
        return totals

    def requests(self) -> Counter[str]:
        """Requests since the last call, by kind."""
        now = self._totals()
        new, self._seen = now - self._seen, now
        return new

    def listing(self, sub: str, pages: int) -> Counter[str]:
        return Counter({"LIST": pages})

    def wrote(self, sent: Counter[str], area: str, n: int) -> bool:
        """At least `n` PUTs (the counters do not say where: the probe's writes count too)."""
        return sent["PUT"] >= n

    def cpu(self) -> float:
        return cpu_seconds(self.server.proc.pid)

    def stop(self) -> None:
        self.server.stop()


SERVERS: dict[str, type[S3Server] | type[SeaweedServer]] = {"moto": S3Server, "seaweedfs": SeaweedServer}
