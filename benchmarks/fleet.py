"""Fleet: mint throughput through Ray on 1 and 2 nodes, plan time for 10,000+ keys against the remote,
and the shared store's transfer throughput against a real S3 server.

Throughput (`throughput`): the same toy-sized CPU keys minted through Ray on 1 and on 2 nodes.

Why: `--executor ray` is only worth its machinery if adding a node adds mints per second, and the
per-key cost of the fleet path (a task per key, streamed phases, records written back) must stay
small next to a compile. Measured on one machine, so "nodes" are Ray nodes on loopback sharing
its cores: this measures the fleet path's overhead and scheduling, not a real fleet's speed-up
(two nodes share what one node's compile already mostly uses).

Keys: a generated Cgfile of the toy family (examples/toy) with only its MLP at `--keys` row
counts (8x64, 16x64, …), fp32: distinct graphs, so distinct keys. Per round and per node count:
a fresh copy of that workspace, `cgbuild plan` (untimed: it traces), then
`cgbuild mint //toy --executor ray://… --json` in a new process; the summary's `seconds` (the
mint phase, from first submission to last result) gives keys/s. Each node advertises `cpu: 1`
(one mint at a time per node). One untimed mint first warms the shared mint sandbox
(Inductor's precompiled headers), as every mint after a machine's first sees it.

Plan against the remote (`plan-remote`): what `cgbuild plan` of 10,000+ keys costs when the
workspace declares a shared S3 store. The workspace is engine.py's generator (`write_workspace`)
with `remote` and `trusted` added: F families x S shapes x 2 modules x 2 layouts on six GPU sm
values (+ C CPU families; default F=50, S=10, C=0: 12,000 GPU targets). Its GPU targets key only
under a CUDA build of torch (no GPU needed: CUDA graphs trace under fake tensors), so every cgbuild
process runs under `--python`, a Python with a CUDA build of torch and cgbuild installed; the one
CUDA trace unit of a target is shared by its six sm values, so 2,000 traces key 12,000 targets.
The S3 server (`--store`) runs as a subprocess on loopback: moto's (`moto_server`, beside this
interpreter or on PATH), whose request log counts each command's requests by kind and prefix; or
SeaweedFS (`weed server`, started by tests/support/seaweedfs.py as the shared-store tests start
it), whose Prometheus counters, served on loopback, count them by kind only (LIST, GET with HEAD,
PUT, DELETE), so its checks are "one listing" and "twelve listings", not which prefix.

  1. cold plan (once; remote declared, signing key set): traces every unit and publishes each
     unit's signed trace facts. Then a remote ref is published for every key, through
     `SharedStore.publish` with a real signature, naming a PLACEHOLDER object per key (a few
     bytes, "placeholder for key ...", not an artifact: no mint ran). Plan only lists `refs/`,
     so what it measures does not depend on the objects.
  2. warm `plan --json` and `plan` against the remote (trace cache warm, local store empty:
     every key is fresh because the remembered listing vouches for it), served from the plan
     memo (asserted: its index not rewritten) and computed in full (the memo removed before the
     run), vs the same workspace's warm plan with no remote declared (a copy of it, state
     included, without `remote`/`trusted`: every key `mint`) and the warm plan with the
     remembered listing removed (it lists `refs/`; untimed plans then memoise again), rounds
     alternating with `python -c pass`, `import boto3` and a fresh process that only lists
     `refs/` (`Remote.list_keys`). Which of boto3 / cryptography / torch the engine imported is
     recorded.
  3. clean clone: a fresh copy of the workspace's files with no state, planned against the remote:
     trace facts come from the remote (asserted: no "tracing [" on stderr, same keys, all fresh).

Every measured process is fresh and goes through engine.py's no-torch wrapper (exit 99 if the
engine imported torch); wall and CPU time (the child's; the S3 server's CPU time per run is
recorded beside it), medians, load averages before and after. The code measured is a git
snapshot (`--code`, as plan_scale.py).

Transfers (`transfer`): what publishing and fetching one large artifact costs against SeaweedFS
on loopback, beside boto3's own transfer manager on the same server as the anchor. Per size (100
MiB and 1 GiB of random bytes) and round: `SharedStore.publish` (the object deleted first, so it
uploads: Remote.upload's TransferConfig, 64 MiB parts; then the create-only ref),
`client.upload_file` (boto3's defaults: 8 MiB parts, 10 threads), `SharedStore.pull` into a fresh
cache (what `cgbuild fetch` does per key: ref, signature, one streamed GET hashed on arrival, local
admission), `Remote.download` alone (that GET into a file) and `client.download_file` (ranged GETs
in parallel); MiB/s, medians, the server's CPU per run. The code measured is this checkout.

Writes benchmarks/results/fleet.json: `throughput` rewrites the file but keeps
`plan_against_remote`; `plan-remote` adds or replaces only `plan_against_remote`. Against
SeaweedFS, `plan-remote --store seaweedfs` and `transfer` write `plan_against_remote` and
`transfer` of benchmarks/results/fleet_seaweedfs.json.

    python benchmarks/fleet.py throughput [--keys 3] [--reps 3]
    python benchmarks/fleet.py plan-remote --python PY [--families 50] [--shapes 10] [--cpu-families 0]
        [--reps 7] [--clone-reps 3] [--code HEAD] [--store moto|seaweedfs]
    python benchmarks/fleet.py transfer [--sizes 100 1024] [--reps 3]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata as md
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from engine import (
    GPU_SKUS,
    LAYOUTS,
    NO_TORCH,
    Run,
    child_env,
    code_under_test,
    summarize,
    time_process,
    trace_count,
    write_workspace,
)
from harness import REPO, cgbuild, load_average, scratch, stamp, write_json, write_result

HERE = Path(__file__).resolve().parent
TOY = HERE.parent / "examples" / "toy"
RESULT = HERE / "results" / "fleet.json"
SEAWEEDFS_RESULT = HERE / "results" / "fleet_seaweedfs.json"
TARGET_MEMO_SECONDS = 0.4  # a no-op plan of 10,000+ keys the remembered listing vouches for
MB = 1 << 20


def toy_workspace(dest: Path, rows: list[int]) -> Path:
    """examples/toy with only its MLP, at these row counts, in the fp32 layout."""
    shutil.copytree(TOY, dest, ignore=shutil.ignore_patterns(".cgbuild", "__pycache__"))
    cg = dest / "Cgfile"
    text = cg.read_text()
    text = text.replace('shapes = ["8x64", "16x64"]', f"shapes = {json.dumps([f'{r}x64' for r in rows])}")
    text = text.replace('layouts = ["fp32", "int8"]', 'layouts = ["fp32"]')
    text = text[: text.index("[family.toy.module.conv]")]
    cg.write_text(text)
    return dest


def fleet_mint(ws: Path, address: str, label: str) -> dict[str, Any]:
    cgbuild(ws, "plan", label)
    started = time.perf_counter()
    summary = json.loads(cgbuild(ws, "mint", label, "--executor", f"ray://{address}", "--json").stdout)
    wall = time.perf_counter() - started
    assert not summary["failed"] and not summary["refused"], summary
    minted = len(summary["minted"])
    return {
        "keys": minted,
        "mint_seconds": summary["seconds"],
        "command_seconds": round(wall, 3),
        "keys_per_minute": round(60 * minted / summary["seconds"], 3),
        "compile_seconds": [m["phases"]["compile"] for m in summary["minted"]],
    }


def throughput(args: argparse.Namespace) -> None:
    from ray.cluster_utils import Cluster

    rows = [8 * (i + 1) for i in range(args.keys)]
    load_start = load_average()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "object_store_memory": 100 * MB, "include_dashboard": False},
    )
    runs: dict[str, list[dict[str, Any]]] = {"1": [], "2": []}
    try:
        workers = [
            cluster.add_node(num_cpus=1, resources={"cpu": 1}, object_store_memory=100 * MB) for _ in range(2)
        ]
        cluster.wait_for_nodes()
        with scratch("cgbuild-fleet-bench-") as tmp:
            warm = toy_workspace(tmp / "warm", [4])
            fleet_mint(warm, cluster.address, "//toy")
            for r in range(args.reps):
                for n in (1, 2):
                    if n == 1:
                        cluster.remove_node(workers.pop())
                    else:
                        workers.append(
                            cluster.add_node(num_cpus=1, resources={"cpu": 1}, object_store_memory=100 * MB)
                        )
                    cluster.wait_for_nodes()
                    ws = toy_workspace(tmp / f"r{r}-n{n}", rows)
                    run = fleet_mint(ws, cluster.address, "//toy")
                    run["load_end"] = load_average()
                    runs[str(n)].append(run)
                    print(f"round {r} nodes {n}: {run}", file=sys.stderr, flush=True)
    finally:
        cluster.shutdown()

    def median(n: str, field: str) -> float:
        return round(statistics.median(run[field] for run in runs[n]), 3)

    numbers: dict[str, Any] = {
        "what": f"{args.keys} distinct toy MLP keys (CPU) minted with `--executor ray` on 1 and 2 Ray nodes "
        "of one machine (each advertising cpu: 1)",
        "machine": {
            "loadavg_start": load_start,
            "loadavg_end": load_average(),
            "note": "both Ray nodes share this machine's cores, and a CPU compile already uses about two; "
            "other work may share the CPU too (see loadavg)",
        },
        "keys": [f"//toy/mlp/{r}x64-b1@fp32:cpu" for r in rows],
        "reps": args.reps,
        "runs": runs,
        "median": {
            f"{n}_node{'s' if n == '2' else ''}": {
                "mint_seconds": median(n, "mint_seconds"),
                "keys_per_minute": median(n, "keys_per_minute"),
                "compile_seconds_per_key": round(
                    statistics.median(c for run in runs[n] for c in run["compile_seconds"]), 3
                ),
            }
            for n in ("1", "2")
        },
    }
    numbers["median"]["speedup_2_over_1"] = round(
        numbers["median"]["2_nodes"]["keys_per_minute"] / numbers["median"]["1_node"]["keys_per_minute"], 3
    )
    if RESULT.exists() and "plan_against_remote" in (old := json.loads(RESULT.read_text())):
        numbers["plan_against_remote"] = old["plan_against_remote"]
    write_result(RESULT, "fleet", numbers, packages=("ray", "cgbuild"))
    print(json.dumps(numbers["median"], indent=2))


# -- plan against the remote -------------------------------------------------------------------------
BUCKET = "cgbuild-fleet-bench"
REMOTE_URL = f"s3://{BUCKET}/plan"
SIGNING_KEY_ENV = "CGBUILD_SIGNING_KEY"  # cgbuild.store.trust.SIGNING_KEY_ENV
# werkzeug's access log line (colours included): "GET /bucket/prefix/refs/…?query HTTP/1.1" 200 -
REQUEST = re.compile(r'"(?:\x1b\[[0-9;]*m)*([A-Z]+) (\S+) HTTP/[\d.]+')
# SeaweedFS's counter of S3 requests, labels in Prometheus's (sorted) order
SEAWEED_REQUESTS = re.compile(
    r'^SeaweedFS_s3_request_total\{bucket="([^"]*)",code="[^"]*",type="([^"]*)"\} (\S+)$', re.M
)
# The measured Python's versions, in a process of its own: harness.py prints them.
CHILD_VERSIONS = (str(HERE / "harness.py"), "cgbuild", "boto3", "botocore", "cryptography", "networkx")
# The listing alone, in a fresh process: import, client, every page of refs/.
LIST_REFS = (
    "import sys\n"
    "from cgbuild.store.s3 import Remote\n"
    "sys.exit(0 if len(Remote(sys.argv[1]).list_keys()) == int(sys.argv[2]) else 1)\n"
)
# Prepended to a wrapper: stderr (fd 2) to the file named by the first argument.
STDERR_TO = "import os, sys\nos.dup2(os.open(sys.argv.pop(1), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)\n"
# NO_TORCH, and which of the remote's libraries the engine imported (on stderr's last line).
WHAT_IMPORTED = (
    "import json, sys\n"
    "from cgbuild.cli.main import main\n"
    "rc = main(sys.argv[1:])\n"
    "names = ('boto3', 'cryptography', 'torch')\n"
    "print(json.dumps({n: n in sys.modules for n in names}), file=sys.stderr)\n"
    "sys.exit(rc)\n"
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


def plan_logged(python: str, ws: Path, env: dict[str, str], wrapper: str = NO_TORCH) -> tuple[Run, dict, str]:
    """A timed, fresh `plan --json` (engine's `time_process`): its parsed output and its stderr (the
    child points its fd 2, which trace workers inherit, at a file: `time_process` keeps no stderr)."""
    out, err = ws.parent / "plan-out.json", ws.parent / "plan-err.txt"
    argv = [python, "-c", STDERR_TO + wrapper, str(err), "-C", str(ws), "plan", "--json"]
    try:
        with open(out, "w") as f:
            run = time_process(argv, cwd=ws, env=env, stdout=f)
    except SystemExit as e:
        raise SystemExit(f"{e}\n{err.read_text()[-2000:]}") from None
    return run, json.loads(out.read_text()), err.read_text()


def publish_placeholders(folder: Path, labels: dict[str, str], key_path: Path, threads: int) -> Counter[str]:
    """One signed remote ref per key (`SharedStore.publish`), naming a placeholder object per key."""
    os.environ[SIGNING_KEY_ENV] = str(key_path)
    from cgbuild.store import trust
    from cgbuild.store.local import Store
    from cgbuild.store.s3 import Remote
    from cgbuild.store.shared import SharedStore

    signer = trust.load_signer()
    assert signer is not None
    shared = SharedStore(Store(folder / "publisher-store"), Remote(REMOTE_URL), {}, "fleet-bench")
    shared.check_publishable()  # the create-only probe, as a real publisher's first publish
    (folder / "placeholders").mkdir()

    def one(key: str) -> str:
        data = f"placeholder for key {key}: not an artifact\n".encode()
        path = folder / "placeholders" / hashlib.sha256(key.encode()).hexdigest()
        path.write_bytes(data)
        sha = hashlib.sha256(data).hexdigest()
        signature = signer.sign(trust.artifact_statement(key, sha, len(data)))
        metadata = {"label": labels[key], "placeholder": True}
        return shared.publish(key, path, sha, len(data), signature, metadata)[0]

    with ThreadPoolExecutor(threads) as pool:
        return Counter(pool.map(one, sorted(labels)))


def listed(sub: str) -> int:
    from cgbuild.store.s3 import Remote

    return sum(1 for _ in Remote(REMOTE_URL).list_names(sub))


def plan_remote(args: argparse.Namespace) -> None:
    python = str(args.python)
    started = time.perf_counter()
    load_before = load_average()
    with contextlib.ExitStack() as stack:  # on the way out: the server stopped, then its folder removed
        tmp = stack.enter_context(scratch("cgbuild-fleet-plan-", args.keep))
        code = code_under_test(args.code, tmp)
        if code.pythonpath is not None:
            sys.path.insert(0, str(code.pythonpath))  # the publisher below uses the same snapshot
        env = child_env(code)
        env.pop(SIGNING_KEY_ENV, None)

        def child_versions() -> dict[str, Any]:
            out = subprocess.run(
                [python, *CHILD_VERSIONS], env=env, capture_output=True, text=True, check=True
            ).stdout
            return {**json.loads(out), **code.identity()}

        at_start = child_versions()
        if not at_start["cuda"]:
            raise SystemExit(f"{python}: torch {at_start['torch']} is not a CUDA build")
        server = SERVERS[args.store](tmp)
        stack.callback(server.stop)
        env.update(server.env)
        os.environ.update(server.env)  # this process publishes the refs
        from cgbuild.store.trust import keygen

        key_path = tmp / "publisher.pem"
        trusted = keygen(key_path, "fleet-bench")
        publisher_env = {**env, SIGNING_KEY_ENV: str(key_path)}

        ws = tmp / "ws"
        write_workspace(
            ws, code.toy, families=args.families, shapes=args.shapes, cpu_families=args.cpu_families
        )
        plain = (ws / "Cgfile").read_text()
        declared = f'[workspace]\nremote = "{REMOTE_URL}"\ntrusted = [{json.dumps(trusted)}]\n'
        (ws / "Cgfile").write_text(plain.replace("[workspace]\n", declared, 1))
        server.requests()

        # 1. Cold, with a signing key: trace everything, publish the facts. Then one ref per key.
        cold_run, cold, cold_err = plan_logged(python, ws, publisher_env)
        cold_requests = server.requests()
        traces = trace_count(ws)
        targets = cold["targets"]
        statuses = Counter(t["status"] for t in targets)
        keys = {t["label"]: t["key"] for t in targets}
        labels = {key: label for label, key in keys.items()}
        assert statuses == {"mint": len(targets)} and len(labels) == len(targets), statuses
        facts = listed("facts")
        server.requests()  # not the plan's: this process's own listing
        wrote = server.wrote(cold_requests, "facts", traces)
        assert facts == traces and wrote, (facts, traces, cold_requests)
        assert cold_err.count("tracing [") == traces  # so its absence below means no trace ran
        print(f"cold plan: {len(targets)} keys, {traces} traces, {cold_run.wall:.1f} s", flush=True)
        pub_start = time.perf_counter()
        published = publish_placeholders(tmp, labels, key_path, args.publish_threads)
        pub_wall = time.perf_counter() - pub_start
        pub_requests = server.requests()
        refs = listed("refs")
        assert published == {"admitted": len(labels)} and refs == len(labels), (published, refs)
        print(f"published {refs} refs in {pub_wall:.1f} s", flush=True)

        # 2. Warm against the remote vs the same workspace (state copied) without a remote.
        local = tmp / "ws-local"
        shutil.copytree(ws, local, symlinks=True)
        (local / "Cgfile").write_text(plain)
        _, warm_remote, err = plan_logged(python, ws, env, WHAT_IMPORTED)
        imports_warm = json.loads(err.strip().splitlines()[-1])
        assert {t["label"]: t["key"] for t in warm_remote["targets"]} == keys
        remote_statuses = Counter(t["status"] for t in warm_remote["targets"])
        assert remote_statuses == {"fresh": len(keys)}, remote_statuses
        assert "tracing [" not in err and not any((ws / ".cgbuild" / "store" / "refs").glob("*/*.json"))
        _, warm_local, err = plan_logged(python, local, env)
        assert {t["label"]: t["key"] for t in warm_local["targets"]} == keys and "tracing [" not in err
        assert Counter(t["status"] for t in warm_local["targets"]) == {"mint": len(keys)}
        memo = ws / ".cgbuild" / "cache" / "plans"

        def memo_stamp(root: Path = ws) -> list[tuple[str, int, int]]:
            indexes = sorted((root / ".cgbuild" / "cache" / "plans").glob("*.json"))
            return [(p.name, p.stat().st_mtime_ns, p.stat().st_ino) for p in indexes]

        def memoise(root: Path = ws) -> None:
            """Untimed plans until one is served from the memo (its index left as it was): the
            first may still record, or find the memo stale and rewrite it."""
            for _ in range(4):
                before = memo_stamp(root)
                plan_logged(python, root, env)
                if before and memo_stamp(root) == before:
                    return
            raise SystemExit(f"the warm plan of {root} was never served from its memo")

        memoise()
        memoise(local)
        stamps = memo_stamp()
        _, hit, err = plan_logged(python, ws, env, WHAT_IMPORTED)
        imports_memo = json.loads(err.strip().splitlines()[-1])
        assert memo_stamp() == stamps, "the warm plan was not served from its memo"
        assert {t["label"]: (t["key"], t["status"]) for t in hit["targets"]} == {
            label: (key, "fresh") for label, key in keys.items()
        }
        server.requests()
        plan_argv = [python, "-c", NO_TORCH, "-C", str(ws), "plan"]
        cases: dict[str, tuple[list[str], Path]] = {
            "python_pass": ([python, "-c", "pass"], ws),
            "python_import_boto3": ([python, "-c", "import boto3, botocore.config"], ws),
            "warm_plan_json_remote": ([*plan_argv, "--json"], ws),
            "warm_plan_human_remote": (plan_argv, ws),
            "warm_plan_json_remote_full": ([*plan_argv, "--json"], ws),
            "warm_plan_json_remote_relist": ([*plan_argv, "--json"], ws),
            "warm_plan_json_no_remote": ([python, "-c", NO_TORCH, "-C", str(local), "plan", "--json"], local),
            "list_refs_only": ([python, "-c", LIST_REFS, REMOTE_URL, str(refs)], ws),
        }
        from_memo = ("warm_plan_json_remote", "warm_plan_human_remote", "warm_plan_json_no_remote")
        runs: dict[str, list[Run]] = {name: [] for name in cases}
        server_cpu: dict[str, list[float]] = {name: [] for name in cases}
        warm_requests: dict[str, list[Counter[str]]] = {name: [] for name in cases if "plan" in name}
        memo_hits: dict[str, list[bool]] = {name: [] for name in from_memo}
        memo_rewritten: list[bool] = []  # the full runs: each planned in full and kept its memo
        remembered = ws / ".cgbuild" / "store" / "remote"
        for _ in range(args.reps):
            for name, (argv, cwd) in cases.items():
                if name == "warm_plan_json_remote_full":
                    shutil.rmtree(memo)  # the same plan computed in full, from the remembered listing
                if name == "warm_plan_json_remote_relist":
                    shutil.rmtree(remembered)  # as on the first plan here, or past the listing's TTL
                before, stamps = server.cpu(), memo_stamp(cwd)
                runs[name].append(time_process(argv, cwd=cwd, env=env))
                sent = server.requests()
                server_cpu[name].append(round(server.cpu() - before, 2))
                if name in warm_requests:
                    warm_requests[name].append(sent)
                if name in memo_hits:
                    memo_hits[name].append(bool(stamps) and memo_stamp(cwd) == stamps)
                if name == "warm_plan_json_remote_full":
                    memo_rewritten.append(bool(memo_stamp()))  # its memo was removed before the run
                if name in ("warm_plan_json_remote", "warm_plan_human_remote", "warm_plan_json_remote_full"):
                    assert sent == server.listing("quarantine", 1), sent
                elif name == "warm_plan_json_remote_relist":
                    assert sent == server.listing("refs", -(-refs // 1000)), sent
                    memoise()  # the listing moved, so the memo with it: plan until it is kept again
                    server.requests()
                elif name == "list_refs_only":
                    assert sent == server.listing("refs", -(-refs // 1000)), sent
                else:
                    assert not sent, (name, sent)
        assert all(all(memo_hits[name]) for name in from_memo), memo_hits
        assert all(memo_rewritten), memo_rewritten
        print(
            {name: round(statistics.median(r.wall for r in rs), 3) for name, rs in runs.items()}, flush=True
        )

        # 3. Clean clone: the workspace's files, no state; facts from the remote, nothing traced.
        clone_runs: list[Run] = []
        clone_requests: list[Counter[str]] = []
        clone_checks: list[dict[str, Any]] = []
        for rep in range(args.clone_reps):
            clone = tmp / f"clone-{rep}"
            shutil.copytree(ws, clone, ignore=shutil.ignore_patterns(".cgbuild"))
            wrapper = WHAT_IMPORTED if rep == 0 else NO_TORCH
            before = server.cpu()
            run, plan, err = plan_logged(python, clone, env, wrapper)
            clone_requests.append(server.requests())
            server_cpu.setdefault("clean_clone_plan", []).append(round(server.cpu() - before, 2))
            if rep == 0:
                imports_clone = json.loads(err.strip().splitlines()[-1])
                assert not imports_clone["torch"], imports_clone
            check = {
                "tracing_lines_on_stderr": err.count("tracing ["),
                "facts_cached_locally": trace_count(clone),
                "keys_identical": {t["label"]: t["key"] for t in plan["targets"]} == keys,
                "all_fresh": Counter(t["status"] for t in plan["targets"]) == {"fresh": len(keys)},
            }
            assert check["tracing_lines_on_stderr"] == 0 and check["facts_cached_locally"] == traces, check
            assert check["keys_identical"] and check["all_fresh"], check
            clone_runs.append(run)
            clone_checks.append(check)
            shutil.rmtree(clone)
        print(f"clean clone: {[round(r.wall, 2) for r in clone_runs]}", flush=True)

        if child_versions() != at_start:
            raise SystemExit("the measured code or Python changed during the run; run it again")
        med = {name: statistics.median(r.wall for r in rs) for name, rs in runs.items()}
        clone_wall = statistics.median(r.wall for r in clone_runs)
        sms = Counter(t["sm"] for t in targets)
        section = {
            "what": f"cgbuild plan of {len(keys)} keyed targets against a shared S3 store "
            f"({server.name} {server.version} on loopback) holding {refs} refs: warm with the "
            "remembered listing (lists quarantine/ only) served from the plan memo (--json and "
            "human) and computed in full, warm with the listing removed (lists refs/), no remote "
            "declared (every key mint; that no-op plan is served from its memo too), and a clean "
            "clone that takes its trace facts from the store; fresh processes",
            **stamp(commit=code.commit),
            "load_average": {"before": load_before, "after": load_average()},
            "python": "a venv with a CUDA build of torch (no GPU: CUDA graphs trace under fake tensors)",
            "store": f"{server.name} {server.version}, a subprocess on loopback: no network latency; "
            "its CPU time is not in the plans' CPU time",
            "workspace": {
                "generator": "benchmarks/engine.py write_workspace, plus remote and trusted",
                "families": args.families,
                "cpu_families": args.cpu_families,
                "shapes_per_module": args.shapes,
                "modules_per_family": 2,
                "layouts": LAYOUTS,
                "gpu_skus": {name: sm for name, (sm, _) in GPU_SKUS.items()},
            },
            "targets": {
                "total": len(targets),
                "keyed": len(keys),
                "distinct_keys": len(labels),
                "by_sm": dict(sorted(sms.items())),
                "traced_units": traces,
                "facts_published": facts,
                "refs_listed": refs,
            },
            "synthetic": "every remote ref is real and signed (SharedStore.publish, the benchmark's "
            "publisher key, trusted by the workspace), but names a placeholder object of a few bytes "
            "('placeholder for key ...'), not an artifact: no mint ran. Plan lists refs/ only, so it "
            "never reads the objects",
            "publish": {
                "refs": dict(published),
                "threads": args.publish_threads,
                "wall_seconds": round(pub_wall, 1),
                "requests": dict(sorted(pub_requests.items())),
            },
            "reps": args.reps,
            "clone_reps": args.clone_reps,
            "seconds": {
                "cold_plan_with_publish": {"wall": round(cold_run.wall, 3), "cpu": round(cold_run.cpu, 3)},
                **{name: summarize(rs) for name, rs in runs.items()},
                "clean_clone_plan": summarize(clone_runs),
            },
            "requests": {
                "cold_plan": dict(sorted(cold_requests.items())),
                **{name: [dict(sorted(r.items())) for r in sent] for name, sent in warm_requests.items()},
                "clean_clone_plan": [dict(sorted(r.items())) for r in clone_requests],
                "expected_ref_listings": -(-refs // 1000),
            },
            "server_cpu_seconds": {
                "basis": f"{server.name}'s user + sys CPU during each run (its answers; not in the "
                "runs' cpu)",
                **{
                    name: {"runs": v, "median": round(statistics.median(v), 2)}
                    for name, v in server_cpu.items()
                    if name.startswith(("warm", "list", "clean"))
                },
            },
            "memo_hit": memo_hits,
            "full_runs_memoised_again": memo_rewritten,
            "imports": {
                "first_warm_plan_json_remote": imports_warm,
                "warm_plan_json_remote": imports_memo,
                "clean_clone_plan": imports_clone,
            },
            "clean_clone_checks": clone_checks,
            "target_seconds": TARGET_MEMO_SECONDS,
            "met": {name: med[name] <= TARGET_MEMO_SECONDS for name in from_memo[:2]},  # the remote's
            "ratios": {
                "full_over_memo": round(med["warm_plan_json_remote_full"] / med["warm_plan_json_remote"], 2),
                "memo_remote_over_memo_no_remote": round(
                    med["warm_plan_json_remote"] / med["warm_plan_json_no_remote"], 2
                ),
                "remote_cost_seconds": round(
                    med["warm_plan_json_remote"] - med["warm_plan_json_no_remote"], 3
                ),
                "boto3_import_seconds": round(med["python_import_boto3"] - med["python_pass"], 3),
                "relist_over_memo": round(
                    med["warm_plan_json_remote_relist"] / med["warm_plan_json_remote"], 2
                ),
                "relist_over_full": round(
                    med["warm_plan_json_remote_relist"] / med["warm_plan_json_remote_full"], 2
                ),
                "list_refs_only_seconds": round(med["list_refs_only"], 3),
                "clean_clone_over_full": round(clone_wall / med["warm_plan_json_remote_full"], 2),
                "cold_over_clean_clone": round(cold_run.wall / clone_wall, 1),
            },
            "torch_imported_by_engine": False,  # every timed cgbuild run exits 99 otherwise
            "benchmark_seconds": round(time.perf_counter() - started, 1),
        }
        section["versions"] = {**at_start, server.name: server.version}  # the measured Python's
        path = RESULT if args.store == "moto" else SEAWEEDFS_RESULT
        result = json.loads(path.read_text()) if path.exists() else {"benchmark": path.stem}
        result["plan_against_remote"] = section
        write_json(path, result)
        print(json.dumps({k: section[k] for k in ("targets", "seconds", "ratios")}, indent=2))


# -- transfers against SeaweedFS ---------------------------------------------------------------------
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="part", required=True)
    tp = sub.add_parser("throughput", help="fleet mint throughput on 1 and 2 Ray nodes")
    tp.add_argument("--keys", type=int, default=3, help="distinct toy keys minted per run")
    tp.add_argument("--reps", type=int, default=3, help="rounds (each mints on 1 then 2 nodes)")
    pr = sub.add_parser("plan-remote", help="plan of 10,000+ keys against the shared S3 store")
    pr.add_argument(
        "--python", type=Path, required=True, help="a Python with a CUDA build of torch and cgbuild"
    )
    pr.add_argument("--families", type=int, default=50)
    pr.add_argument("--shapes", type=int, default=10, help="shapes per module")
    pr.add_argument("--cpu-families", type=int, default=0, help="families that also serve on the CPU")
    pr.add_argument("--reps", type=int, default=7, help="fresh processes per warm measurement")
    pr.add_argument("--clone-reps", type=int, default=3, help="clean-clone plans")
    pr.add_argument("--publish-threads", type=int, default=8)
    pr.add_argument("--code", default="HEAD", help="commit to measure (exported), or 'worktree'")
    pr.add_argument("--keep", action="store_true", help="keep the temporary folder")
    pr.add_argument("--store", choices=sorted(SERVERS), default="moto", help="the S3 server on loopback")
    tr = sub.add_parser("transfer", help="publish and fetch throughput against SeaweedFS")
    tr.add_argument("--sizes", type=int, nargs="+", default=[100, 1024], help="artifact sizes in MiB")
    tr.add_argument("--reps", type=int, default=3, help="rounds per size")
    tr.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = parser.parse_args()
    {"throughput": throughput, "plan-remote": plan_remote, "transfer": transfer}[args.part](args)


if __name__ == "__main__":
    main()
