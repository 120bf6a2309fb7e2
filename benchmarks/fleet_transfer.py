"""What publishing and fetching one large artifact costs against SeaweedFS, beside boto3.

Transfers (`transfer`): what publishing and fetching one large artifact costs against SeaweedFS
on loopback, beside boto3's own transfer manager on the same server as the anchor. Per size (100
MiB and 1 GiB of random bytes) and round: `SharedStore.publish` (the object deleted first, so it
uploads: Remote.upload's TransferConfig, 64 MiB parts; then the create-only ref),
`client.upload_file` (boto3's defaults: 8 MiB parts, 10 threads), `SharedStore.pull` into a fresh
cache (what `cgbuild fetch` does per key: ref, signature, one streamed GET hashed on arrival, local
admission), `Remote.download` alone (that GET into a file) and `client.download_file` (ranged GETs
in parallel); MiB/s, medians, the server's CPU per run. The code measured is this checkout.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from fleet_servers import BUCKET, MB, SEAWEEDFS_RESULT, SIGNING_KEY_ENV, SeaweedServer
from harness import load_average, scratch, stamp, write_json

TRANSFER_URL = f"s3://{BUCKET}/transfer"
OPS = ("publish", "boto3_upload_file", "fetch", "download", "boto3_download_file")
"""Measured per round, in this order on even rounds and the anchors first on odd ones."""


def random_file(path: Path, size: int) -> str:
    """`size` random bytes at `path` (incompressible, as a packed artifact nearly is); their sha256."""
    h = hashlib.sha256()
    with open(path, "wb") as f:
        for start in range(0, size, 64 * MB):
            block = os.urandom(min(64 * MB, size - start))
            h.update(block)
            f.write(block)
    return h.hexdigest()


class Transfers:
    """One artifact's transfers through cgbuild (`SharedStore.publish`, `SharedStore.pull`,
    `Remote.download`) and through boto3's transfer manager with its defaults (`upload_file`,
    `download_file`), each a callable that leaves the store as the next round needs it."""

    def __init__(self, tmp: Path, path: Path, sha: str, trusted: dict[str, bytes]) -> None:
        import boto3

        from cgbuild.store import trust
        from cgbuild.store.local import Store
        from cgbuild.store.s3 import Remote
        from cgbuild.store.shared import SharedStore

        self.tmp, self.path, self.sha, self.size = tmp, path, sha, path.stat().st_size
        self.key = hashlib.sha256(f"transfer {sha}".encode()).hexdigest()
        self.remote = Remote(TRANSFER_URL)
        self.client = boto3.session.Session().client("s3")
        signer = trust.load_signer()
        assert signer is not None
        self.signature = signer.sign(trust.artifact_statement(self.key, sha, self.size))
        self.publisher = SharedStore(Store(tmp / "publisher"), self.remote, trusted, "fleet-bench")
        self.publisher.check_publishable()  # the create-only probe, once, untimed
        self.cache = lambda: SharedStore(Store(tmp / "cache"), Remote(TRANSFER_URL), trusted, "fleet-bench")
        self.anchor = f"anchor/{sha}"

    def publish(self) -> None:
        """The object uploaded (it was deleted before), then its create-only ref."""
        self.remote.delete(self.remote.object_name(self.sha))
        self.remote.delete(self.remote.ref_name(self.key))
        status, _ = self.publisher.publish(self.key, self.path, self.sha, self.size, self.signature, {})
        assert status == "admitted", status

    def boto3_upload_file(self) -> None:
        self.client.upload_file(str(self.path), BUCKET, self.anchor)

    def fetch(self) -> None:
        """`cgbuild fetch`'s work for one key: ref read, signature checked, the object streamed
        and hashed into the cache's temp folder, admitted into a fresh cache (synced, re-read and
        hashed, linked into place)."""
        shutil.rmtree(self.tmp / "cache", ignore_errors=True)
        self.cache().pull(self.key)

    def download(self) -> None:
        """`Remote.download` alone: the transfer (one GET, hashed as it streams) into a file."""
        with open(self.tmp / "download", "wb") as out:
            assert self.remote.download(self.sha, out) == (self.sha, self.size)

    def boto3_download_file(self) -> None:
        self.client.download_file(BUCKET, self.anchor, str(self.tmp / "anchor-download"))


def transfer_size(tmp: Path, size: int, reps: int, server: SeaweedServer) -> dict[str, Any]:
    """Every op on one artifact of `size` bytes, `reps` rounds: seconds, MiB/s, the server's CPU."""
    from cgbuild.store import trust

    key_path = tmp / "publisher.pem"
    if not key_path.exists():
        os.environ[SIGNING_KEY_ENV] = str(key_path)
        trust.keygen(key_path, "fleet-bench")
    name, _, public = Path(f"{key_path}.pub").read_text().strip().partition(":")
    art = tmp / f"artifact-{size}"
    transfers = Transfers(tmp, art, random_file(art, size), {name: trust.public_key_bytes(public)})
    seconds: dict[str, list[float]] = {op: [] for op in OPS}
    server_cpu: dict[str, list[float]] = {op: [] for op in OPS}
    for r in range(reps):
        order = OPS if r % 2 == 0 else (OPS[1], OPS[0], OPS[4], OPS[2], OPS[3])
        for op in order:
            cpu = server.cpu()
            started = time.perf_counter()
            getattr(transfers, op)()
            seconds[op].append(round(time.perf_counter() - started, 3))
            server_cpu[op].append(round(server.cpu() - cpu, 2))
        print(f"{size >> 20} MiB round {r}: { {op: v[-1] for op, v in seconds.items()} }", flush=True)
    for leftover in (art, tmp / "download", tmp / "anchor-download"):
        leftover.unlink(missing_ok=True)
    rate = {op: [round(size / MB / t, 1) for t in ts] for op, ts in seconds.items()}
    med = {op: statistics.median(v) for op, v in rate.items()}
    return {
        "bytes": size,
        "seconds": seconds,
        "mib_per_s": rate,
        "median_mib_per_s": {op: round(v, 1) for op, v in med.items()},
        "server_cpu_seconds": server_cpu,
        "ratios_vs_boto3": {
            "publish_over_upload_file": round(med["publish"] / med["boto3_upload_file"], 2),
            "fetch_over_download_file": round(med["fetch"] / med["boto3_download_file"], 2),
            "download_over_download_file": round(med["download"] / med["boto3_download_file"], 2),
        },
    }


def transfer(args: argparse.Namespace) -> None:
    """Publish and fetch throughput of artifacts of `--sizes` MiB against SeaweedFS on loopback."""
    from boto3.s3.transfer import TransferConfig

    from cgbuild.store import s3

    load_start = load_average()
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(scratch("cgbuild-fleet-transfer-", args.keep))
        server = SeaweedServer(tmp)
        stack.callback(server.stop)
        os.environ.update(server.env)
        by_size = {f"{mib}_mib": transfer_size(tmp, mib * MB, args.reps, server) for mib in args.sizes}
    defaults, threshold = TransferConfig(), s3.Remote(TRANSFER_URL).multipart_threshold
    section = {
        "what": "publish and fetch of one incompressible artifact per size against SeaweedFS on loopback, "
        "through cgbuild (SharedStore.publish: HEAD, upload, create-only ref, HEAD; SharedStore.pull: ref, "
        "signature, streamed download hashed on arrival, admission into a fresh local cache; "
        "Remote.download: the streamed GET alone) beside boto3's transfer manager with its defaults "
        "(upload_file, download_file) on the same server; the object and the ref are deleted before each "
        "publish, so each uploads; files are in the page cache (24 GiB of memory)",
        **stamp("boto3", "botocore", "cgbuild"),
        "load_average": {"start": load_start, "end": load_average()},
        "store": f"SeaweedFS {server.version} (`weed server`, one process) on loopback, data on this disk",
        "reps": args.reps,
        "cgbuild_upload": {
            "multipart_threshold": threshold,
            "part_bytes": max(s3.MIN_PART, min(threshold, s3.DEFAULT_MULTIPART)),
            "max_concurrency": defaults.max_request_concurrency,
        },
        "cgbuild_download": "one GET, streamed in 1 MiB chunks, hashed as it arrives",
        "boto3_defaults": {
            "multipart_threshold": defaults.multipart_threshold,
            "part_bytes": defaults.multipart_chunksize,
            "max_concurrency": defaults.max_request_concurrency,
        },
        "sizes": by_size,
        "benchmark_seconds": round(time.perf_counter() - started, 1),
    }
    result = json.loads(SEAWEEDFS_RESULT.read_text()) if SEAWEEDFS_RESULT.exists() else {}
    write_json(SEAWEEDFS_RESULT, {"benchmark": SEAWEEDFS_RESULT.stem, **result, "transfer": section})
    print(json.dumps({k: v["median_mib_per_s"] | v["ratios_vs_boto3"] for k, v in by_size.items()}, indent=2))
