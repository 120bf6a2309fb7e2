"""Does adding a Ray node add mints per second? Fleet mint throughput on 1 and 2 nodes.

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
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from fleet_servers import MB, RESULT
from harness import cgbuild, load_average, scratch, write_result

TOY = Path(__file__).resolve().parents[1] / "examples" / "toy"


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
