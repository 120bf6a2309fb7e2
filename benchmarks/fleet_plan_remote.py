"""What `cgbuild plan` of 10,000+ keys costs when the workspace declares a shared S3 store.

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
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine import (
    GPU_SKUS,
    LAYOUTS,
    NO_TORCH,
    Code,
    Run,
    child_env,
    code_under_test,
    median_walls,
    summarize,
    time_process,
    trace_count,
)
from engine import write_workspace as write_generated_workspace
from fleet_servers import (
    BUCKET,
    HERE,
    RESULT,
    SEAWEEDFS_RESULT,
    SERVERS,
    SIGNING_KEY_ENV,
    S3Server,
    SeaweedServer,
)
from harness import load_average, scratch, stamp, write_json

REMOTE_URL = f"s3://{BUCKET}/plan"
TARGET_MEMO_SECONDS = 0.4  # a no-op plan of 10,000+ keys the remembered listing vouches for
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


# The warm plans served from the memo (the first two against the remote: the target's).
FROM_MEMO = ("warm_plan_json_remote", "warm_plan_human_remote", "warm_plan_json_no_remote")


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


@dataclass
class Bench:
    """One run's fixed parts: the measured Python, its environment (the code under test, the
    server's endpoint), the server, and the workspace with `remote` and `trusted` declared."""

    python: str
    code: Code
    env: dict[str, str]
    server: S3Server | SeaweedServer
    tmp: Path
    ws: Path
    plain: str  # the workspace's Cgfile as generated: no remote declared
    key_path: Path  # the publisher's signing key

    def versions(self) -> dict[str, Any]:
        return measured_versions(self.python, self.env, self.code)

    def plan(
        self, ws: Path, env: dict[str, str] | None = None, wrapper: str = NO_TORCH
    ) -> tuple[Run, dict, str]:
        """`plan_logged` of `ws` under this run's Python (and its environment unless `env`)."""
        return plan_logged(self.python, ws, self.env if env is None else env, wrapper)


def measured_versions(python: str, env: dict[str, str], code: Code) -> dict[str, Any]:
    """The measured Python's versions and the code under test: the same at the end as at the start."""
    out = subprocess.run(
        [python, *CHILD_VERSIONS], env=env, capture_output=True, text=True, check=True
    ).stdout
    return {**json.loads(out), **code.identity()}


def _start(args: argparse.Namespace, stack: contextlib.ExitStack) -> tuple[Bench, dict[str, Any]]:
    """The code under test, the server (stopped when `stack` closes, before its folder goes), the
    publisher's key and the generated workspace; with the measured Python's versions at the start."""
    python = str(args.python)
    tmp = stack.enter_context(scratch("cgbuild-fleet-plan-", args.keep))
    code = code_under_test(args.code, tmp)
    if code.pythonpath is not None:
        sys.path.insert(0, str(code.pythonpath))  # the publisher below uses the same snapshot
    env = child_env(code)
    env.pop(SIGNING_KEY_ENV, None)
    at_start = measured_versions(python, env, code)
    if not at_start["cuda"]:
        raise SystemExit(f"{python}: torch {at_start['torch']} is not a CUDA build")
    server = SERVERS[args.store](tmp)
    stack.callback(server.stop)
    env.update(server.env)
    os.environ.update(server.env)  # this process publishes the refs
    from cgbuild.store.trust import keygen

    bench = Bench(python, code, env, server, tmp, tmp / "ws", "", tmp / "publisher.pem")

    trusted = keygen(bench.key_path, "fleet-bench")
    write_generated_workspace(
        bench.ws, code.toy, families=args.families, shapes=args.shapes, cpu_families=args.cpu_families
    )
    bench.plain = (bench.ws / "Cgfile").read_text()
    declared = f'[workspace]\nremote = "{REMOTE_URL}"\ntrusted = [{json.dumps(trusted)}]\n'
    (bench.ws / "Cgfile").write_text(bench.plain.replace("[workspace]\n", declared, 1))
    bench.server.requests()
    return bench, at_start


@dataclass
class Cold:
    """The cold plan (everything traced, the facts published) and the refs published after it."""

    run: Run
    requests: Counter[str]
    traces: int
    targets: list[dict[str, Any]]
    keys: dict[str, str]  # label: key
    labels: dict[str, str]  # key: label
    facts: int
    published: Counter[str] = field(default_factory=Counter)
    publish_wall: float = 0.0
    publish_requests: Counter[str] = field(default_factory=Counter)
    refs: int = 0


def _cold(bench: Bench, threads: int) -> Cold:
    """1. Cold, with a signing key: trace everything, publish the facts. Then one ref per key."""
    server = bench.server
    run, cold, err = bench.plan(bench.ws, {**bench.env, SIGNING_KEY_ENV: str(bench.key_path)})
    requests = server.requests()
    traces = trace_count(bench.ws)
    targets = cold["targets"]
    statuses = Counter(t["status"] for t in targets)
    keys = {t["label"]: t["key"] for t in targets}
    labels = {key: label for label, key in keys.items()}
    assert statuses == {"mint": len(targets)} and len(labels) == len(targets), statuses
    facts = listed("facts")
    server.requests()  # not the plan's: this process's own listing
    wrote = server.wrote(requests, "facts", traces)
    assert facts == traces and wrote, (facts, traces, requests)
    assert err.count("tracing [") == traces  # so its absence below means no trace ran
    print(f"cold plan: {len(targets)} keys, {traces} traces, {run.wall:.1f} s", flush=True)
    out = Cold(run, requests, traces, targets, keys, labels, facts)
    pub_start = time.perf_counter()
    out.published = publish_placeholders(bench.tmp, labels, bench.key_path, threads)
    out.publish_wall = time.perf_counter() - pub_start
    out.publish_requests = server.requests()
    out.refs = listed("refs")
    assert out.published == {"admitted": len(labels)} and out.refs == len(labels), (out.published, out.refs)
    print(f"published {out.refs} refs in {out.publish_wall:.1f} s", flush=True)
    return out


def memo_stamp(root: Path) -> list[tuple[str, int, int]]:
    """The plan memo's index files as they stand: a plan served from the memo leaves them so."""
    indexes = sorted((root / ".cgbuild" / "cache" / "plans").glob("*.json"))
    return [(p.name, p.stat().st_mtime_ns, p.stat().st_ino) for p in indexes]


def memoise(bench: Bench, root: Path) -> None:
    """Untimed plans until one is served from the memo (its index left as it was): the
    first may still record, or find the memo stale and rewrite it."""
    for _ in range(4):
        before = memo_stamp(root)
        bench.plan(root)
        if before and memo_stamp(root) == before:
            return
    raise SystemExit(f"the warm plan of {root} was never served from its memo")


def _imported(err: str) -> dict[str, bool]:
    """What `WHAT_IMPORTED` printed on stderr's last line."""
    return dict(json.loads(err.strip().splitlines()[-1]))


@dataclass
class Warm:
    """2. The warm plans: with and without the remote, from the memo, in full and relisting."""

    imports_first: dict[str, bool]
    imports_memo: dict[str, bool] = field(default_factory=dict)
    runs: dict[str, list[Run]] = field(default_factory=dict)
    server_cpu: dict[str, list[float]] = field(default_factory=dict)
    requests: dict[str, list[Counter[str]]] = field(default_factory=dict)
    memo_hits: dict[str, list[bool]] = field(default_factory=dict)
    memo_rewritten: list[bool] = field(default_factory=list)  # the full runs: each kept its memo


def _warm_first(bench: Bench, cold: Cold) -> tuple[Warm, Path]:
    """The first warm plans against the remote and without (a copy, state included, of the
    workspace without `remote`): keys, statuses, nothing traced; then both memoised. Returns the
    copy beside them."""
    ws, keys = bench.ws, cold.keys
    local = bench.tmp / "ws-local"
    shutil.copytree(ws, local, symlinks=True)
    (local / "Cgfile").write_text(bench.plain)
    _, warm_remote, err = bench.plan(ws, wrapper=WHAT_IMPORTED)
    warm = Warm(_imported(err))
    assert {t["label"]: t["key"] for t in warm_remote["targets"]} == keys
    remote_statuses = Counter(t["status"] for t in warm_remote["targets"])
    assert remote_statuses == {"fresh": len(keys)}, remote_statuses
    assert "tracing [" not in err and not any((ws / ".cgbuild" / "store" / "refs").glob("*/*.json"))
    _, warm_local, err = bench.plan(local)
    assert {t["label"]: t["key"] for t in warm_local["targets"]} == keys and "tracing [" not in err
    assert Counter(t["status"] for t in warm_local["targets"]) == {"mint": len(keys)}
    memoise(bench, ws)
    memoise(bench, local)
    stamps = memo_stamp(ws)
    _, hit, err = bench.plan(ws, wrapper=WHAT_IMPORTED)
    warm.imports_memo = _imported(err)
    assert memo_stamp(ws) == stamps, "the warm plan was not served from its memo"
    assert {t["label"]: (t["key"], t["status"]) for t in hit["targets"]} == {
        label: (key, "fresh") for label, key in keys.items()
    }
    bench.server.requests()
    return warm, local


def _cases(bench: Bench, local: Path, refs: int) -> dict[str, tuple[list[str], Path]]:
    """Each warm measurement: its command and where it runs, alternating with the anchors."""
    python, ws = bench.python, bench.ws
    plan_argv = [python, "-c", NO_TORCH, "-C", str(ws), "plan"]
    return {
        "python_pass": ([python, "-c", "pass"], ws),
        "python_import_boto3": ([python, "-c", "import boto3, botocore.config"], ws),
        "warm_plan_json_remote": ([*plan_argv, "--json"], ws),
        "warm_plan_human_remote": (plan_argv, ws),
        "warm_plan_json_remote_full": ([*plan_argv, "--json"], ws),
        "warm_plan_json_remote_relist": ([*plan_argv, "--json"], ws),
        "warm_plan_json_no_remote": ([python, "-c", NO_TORCH, "-C", str(local), "plan", "--json"], local),
        "list_refs_only": ([python, "-c", LIST_REFS, REMOTE_URL, str(refs)], ws),
    }


def _warm(bench: Bench, cold: Cold, reps: int) -> Warm:
    """`reps` rounds of every warm case, each a fresh process, its requests checked."""
    warm, local = _warm_first(bench, cold)
    server, ws = bench.server, bench.ws
    cases = _cases(bench, local, cold.refs)
    warm.runs = {name: [] for name in cases}
    warm.server_cpu = {name: [] for name in cases}
    warm.requests = {name: [] for name in cases if "plan" in name}
    warm.memo_hits = {name: [] for name in FROM_MEMO}
    for _ in range(reps):
        for name, (argv, cwd) in cases.items():
            if name == "warm_plan_json_remote_full":
                shutil.rmtree(ws / ".cgbuild" / "cache" / "plans")  # the same plan computed in full
            if name == "warm_plan_json_remote_relist":
                shutil.rmtree(ws / ".cgbuild" / "store" / "remote")  # as on the first plan, or past the TTL
            before, stamps = server.cpu(), memo_stamp(cwd)
            warm.runs[name].append(time_process(argv, cwd=cwd, env=bench.env))
            sent = server.requests()
            warm.server_cpu[name].append(round(server.cpu() - before, 2))
            if name in warm.requests:
                warm.requests[name].append(sent)
            if name in warm.memo_hits:
                warm.memo_hits[name].append(bool(stamps) and memo_stamp(cwd) == stamps)
            if name == "warm_plan_json_remote_full":
                warm.memo_rewritten.append(bool(memo_stamp(ws)))  # its memo was removed before the run
            _check_sent(bench, name, sent, cold.refs)
    assert all(all(warm.memo_hits[name]) for name in FROM_MEMO), warm.memo_hits
    assert all(warm.memo_rewritten), warm.memo_rewritten
    print({name: round(wall, 3) for name, wall in median_walls(warm.runs).items()}, flush=True)
    return warm


def _check_sent(bench: Bench, name: str, sent: Counter[str], refs: int) -> None:
    """What case `name` asked of the store: the remembered listing's plans list quarantine/ once,
    a relist lists refs/ (and is memoised again after), the anchors ask nothing."""
    server = bench.server
    if name in ("warm_plan_json_remote", "warm_plan_human_remote", "warm_plan_json_remote_full"):
        assert sent == server.listing("quarantine", 1), sent
    elif name == "warm_plan_json_remote_relist":
        assert sent == server.listing("refs", -(-refs // 1000)), sent
        memoise(bench, bench.ws)  # the listing moved, so the memo with it: plan until it is kept again
        server.requests()
    elif name == "list_refs_only":
        assert sent == server.listing("refs", -(-refs // 1000)), sent
    else:
        assert not sent, (name, sent)


@dataclass
class Clone:
    """3. Clean clones: the workspace's files, no state; facts from the remote, nothing traced."""

    runs: list[Run] = field(default_factory=list)
    requests: list[Counter[str]] = field(default_factory=list)
    checks: list[dict[str, Any]] = field(default_factory=list)
    server_cpu: list[float] = field(default_factory=list)
    imports: dict[str, bool] = field(default_factory=dict)


def _clones(bench: Bench, cold: Cold, reps: int) -> Clone:
    clone = Clone()
    for rep in range(reps):
        where = bench.tmp / f"clone-{rep}"
        shutil.copytree(bench.ws, where, ignore=shutil.ignore_patterns(".cgbuild"))
        wrapper = WHAT_IMPORTED if rep == 0 else NO_TORCH
        before = bench.server.cpu()
        run, plan, err = bench.plan(where, wrapper=wrapper)
        clone.requests.append(bench.server.requests())
        clone.server_cpu.append(round(bench.server.cpu() - before, 2))
        if rep == 0:
            clone.imports = _imported(err)
            assert not clone.imports["torch"], clone.imports
        check = {
            "tracing_lines_on_stderr": err.count("tracing ["),
            "facts_cached_locally": trace_count(where),
            "keys_identical": {t["label"]: t["key"] for t in plan["targets"]} == cold.keys,
            "all_fresh": Counter(t["status"] for t in plan["targets"]) == {"fresh": len(cold.keys)},
        }
        assert check["tracing_lines_on_stderr"] == 0 and check["facts_cached_locally"] == cold.traces, check
        assert check["keys_identical"] and check["all_fresh"], check
        clone.runs.append(run)
        clone.checks.append(check)
        shutil.rmtree(where)
    print(f"clean clone: {[round(r.wall, 2) for r in clone.runs]}", flush=True)
    return clone


def plan_remote(args: argparse.Namespace) -> None:
    """Cold plan and publish, warm plans, clean clones: `plan_against_remote` of the result."""
    started = time.perf_counter()
    load_before = load_average()
    with contextlib.ExitStack() as stack:  # on the way out: the server stopped, then its folder removed
        bench, at_start = _start(args, stack)
        cold = _cold(bench, args.publish_threads)
        warm = _warm(bench, cold, args.reps)
        clone = _clones(bench, cold, args.clone_reps)
        warm.server_cpu["clean_clone_plan"] = clone.server_cpu
        if bench.versions() != at_start:
            raise SystemExit("the measured code or Python changed during the run; run it again")
        section = {
            **_setting(args, bench, cold, load_before),
            **_measured(args, bench.server, cold, warm, clone),
            "benchmark_seconds": round(time.perf_counter() - started, 1),
        }
        section["versions"] = {**at_start, bench.server.name: bench.server.version}  # the measured Python's
        path = RESULT if args.store == "moto" else SEAWEEDFS_RESULT
        result = json.loads(path.read_text()) if path.exists() else {"benchmark": path.stem}
        result["plan_against_remote"] = section
        write_json(path, result)
        print(json.dumps({k: section[k] for k in ("targets", "seconds", "ratios")}, indent=2))


def _setting(args: argparse.Namespace, bench: Bench, cold: Cold, load_before: list[float]) -> dict[str, Any]:
    """What was measured, where and on what: the section's first fields."""
    server, refs = bench.server, cold.refs
    return {
        "what": f"cgbuild plan of {len(cold.keys)} keyed targets against a shared S3 store "
        f"({server.name} {server.version} on loopback) holding {refs} refs: warm with the "
        "remembered listing (lists quarantine/ only) served from the plan memo (--json and "
        "human) and computed in full, warm with the listing removed (lists refs/), no remote "
        "declared (every key mint; that no-op plan is served from its memo too), and a clean "
        "clone that takes its trace facts from the store; fresh processes",
        **stamp(commit=bench.code.commit),
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
            "total": len(cold.targets),
            "keyed": len(cold.keys),
            "distinct_keys": len(cold.labels),
            "by_sm": dict(sorted(Counter(t["sm"] for t in cold.targets).items())),
            "traced_units": cold.traces,
            "facts_published": cold.facts,
            "refs_listed": refs,
        },
        "synthetic": "every remote ref is real and signed (SharedStore.publish, the benchmark's "
        "publisher key, trusted by the workspace), but names a placeholder object of a few bytes "
        "('placeholder for key ...'), not an artifact: no mint ran. Plan lists refs/ only, so it "
        "never reads the objects",
        "publish": {
            "refs": dict(cold.published),
            "threads": args.publish_threads,
            "wall_seconds": round(cold.publish_wall, 1),
            "requests": dict(sorted(cold.publish_requests.items())),
        },
    }


def _measured(
    args: argparse.Namespace, server: S3Server | SeaweedServer, cold: Cold, warm: Warm, clone: Clone
) -> dict[str, Any]:
    """The section's numbers: seconds, requests, the server's CPU, the memo's checks, ratios."""
    return {
        "reps": args.reps,
        "clone_reps": args.clone_reps,
        "seconds": {
            "cold_plan_with_publish": {"wall": round(cold.run.wall, 3), "cpu": round(cold.run.cpu, 3)},
            **{name: summarize(rs) for name, rs in warm.runs.items()},
            "clean_clone_plan": summarize(clone.runs),
        },
        "requests": {
            "cold_plan": dict(sorted(cold.requests.items())),
            **{name: [dict(sorted(r.items())) for r in sent] for name, sent in warm.requests.items()},
            "clean_clone_plan": [dict(sorted(r.items())) for r in clone.requests],
            "expected_ref_listings": -(-cold.refs // 1000),
        },
        "server_cpu_seconds": {
            "basis": f"{server.name}'s user + sys CPU during each run (its answers; not in the runs' cpu)",
            **{
                name: {"runs": v, "median": round(statistics.median(v), 2)}
                for name, v in warm.server_cpu.items()
                if name.startswith(("warm", "list", "clean"))
            },
        },
        "memo_hit": warm.memo_hits,
        "full_runs_memoised_again": warm.memo_rewritten,
        "imports": {
            "first_warm_plan_json_remote": warm.imports_first,
            "warm_plan_json_remote": warm.imports_memo,
            "clean_clone_plan": clone.imports,
        },
        "clean_clone_checks": clone.checks,
        **_against_target(cold, warm, clone),
        "torch_imported_by_engine": False,  # every timed cgbuild run exits 99 otherwise
    }


def _against_target(cold: Cold, warm: Warm, clone: Clone) -> dict[str, Any]:
    """The memo's plans against `TARGET_MEMO_SECONDS`, and how the cases compare."""
    med = median_walls(warm.runs)
    clone_wall = statistics.median(r.wall for r in clone.runs)
    full, memo = med["warm_plan_json_remote_full"], med["warm_plan_json_remote"]
    relist = med["warm_plan_json_remote_relist"]
    return {
        "target_seconds": TARGET_MEMO_SECONDS,
        "met": {name: med[name] <= TARGET_MEMO_SECONDS for name in FROM_MEMO[:2]},  # the remote's
        "ratios": {
            "full_over_memo": round(full / memo, 2),
            "memo_remote_over_memo_no_remote": round(memo / med["warm_plan_json_no_remote"], 2),
            "remote_cost_seconds": round(memo - med["warm_plan_json_no_remote"], 3),
            "boto3_import_seconds": round(med["python_import_boto3"] - med["python_pass"], 3),
            "relist_over_memo": round(relist / memo, 2),
            "relist_over_full": round(relist / full, 2),
            "list_refs_only_seconds": round(med["list_refs_only"], 3),
            "clean_clone_over_full": round(clone_wall / full, 2),
            "cold_over_clean_clone": round(cold.run.wall / clone_wall, 1),
        },
    }
