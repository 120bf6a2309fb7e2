"""What the graph digest costs: klein-4B trace (export + digest + contract + topology) vs bare export.

Both sides build the same FLUX.2 [klein] 4B-shaped transformer under FakeTensorMode (bf16, 4096
image tokens = 1024x1024, 512 text tokens, batch 1, CPU) from the example entry and export it with
the default (pre-decomposition) torch.export. `bare` stops there; `trace` is the trace rule's
whole job (`run_job`). They alternate in one process (ABBA order), after one untimed warm-up
export (the first export pays one-off imports), and the median of the repetitions is reported, in wall time
and in process CPU time (steadier than wall time on a shared 2-core box). `digest_only` times
`graph_facts` alone on the bare program.

Target: trace ≤ 1.1 × bare. Writes benchmarks/results/trace_digest.json.

    python benchmarks/trace_digest.py [--reps 4]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from cgbuild_rules.digest import graph_facts
from cgbuild_rules.trace import default_dtype, load_entry, parse_job, run_job
from harness import load_average, write_result
from torch._subclasses.fake_tensor import FakeTensorMode

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent / "examples" / "flux2_klein"
TARGET_RATIO = 1.1

KLEIN_4B = {
    "model": {
        "patch_size": 1,
        "in_channels": 128,
        "num_layers": 5,
        "num_single_layers": 20,
        "attention_head_dim": 128,
        "num_attention_heads": 24,
        "joint_attention_dim": 7680,
        "timestep_guidance_channels": 256,
        "mlp_ratio": 3.0,
        "axes_dims_rope": [32, 32, 32, 32],
        "rope_theta": 2000,
        "guidance_embeds": False,
    }
}

JOB: dict[str, Any] = {
    "id": "klein-4b",
    "entry": "flux2_entry:build",
    "root": str(ROOT),
    "config": KLEIN_4B,
    "quant": "plain.bf16",
    "spec": {
        "family": "flux2-klein",
        "module": "transformer",
        "graph_class": "1024x1024-t512-b1",
        "height": 1024,
        "width": 1024,
        "text_len": 512,
        "batch": 1,
        "dtype": "bfloat16",
        "device": "cpu",
    },
}


def bare_export() -> tuple[float, float, Any]:
    """The same build and export with nothing of cgbuild's on top: (wall, cpu, program)."""
    job = parse_job(JOB)
    build = load_entry(job.entry, job.root)
    start, cpu = time.perf_counter(), time.process_time()
    with default_dtype(torch.bfloat16), torch.no_grad(), FakeTensorMode(), torch.device("cpu"):
        module, args, kwargs = build(dict(job.spec))
        module.eval()
    with torch.no_grad():
        ep = torch.export.export(module, args, kwargs, strict=False)
    return time.perf_counter() - start, time.process_time() - cpu, ep


def traced() -> tuple[float, float, dict[str, Any]]:
    """The trace rule's whole job: (wall, cpu, result line)."""
    start, cpu = time.perf_counter(), time.process_time()
    line = run_job(JOB)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    if not line["ok"]:
        raise SystemExit(f"trace failed: {line}")
    return wall, cpu, line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=4)  # even: ABBA balanced
    parser.add_argument("--out", type=Path, default=HERE / "results" / "trace_digest.json")
    opts = parser.parse_args()

    load_start = load_average()[0]
    bare_export()  # warm-up: one-off imports and caches
    bare: list[float] = []
    trace: list[float] = []
    bare_cpu: list[float] = []
    trace_cpu: list[float] = []
    digest_only: list[float] = []
    line: dict[str, Any] = {}
    for rep in range(opts.reps):
        # ABBA order: whichever runs second in a pair inherits the first one's memory state.
        for side in ("bare", "trace") if rep % 2 == 0 else ("trace", "bare"):
            gc.collect()  # neither side pays for the other's garbage
            if side == "bare":
                wall, cpu, ep = bare_export()
                bare.append(wall)
                bare_cpu.append(cpu)
                start = time.perf_counter()
                digest = graph_facts(ep).digest
                digest_only.append(time.perf_counter() - start)
                del ep
            else:
                wall, cpu, line = traced()
                trace.append(wall)
                trace_cpu.append(cpu)
        assert digest == line["graph_digest"]

    bare_med, trace_med = statistics.median(bare), statistics.median(trace)
    bare_cpu_med, trace_cpu_med = statistics.median(bare_cpu), statistics.median(trace_cpu)
    params = sum(math.prod(shape) for _, _, shape in line["topology"])
    numbers = {
        "what": "klein-4B transformer, FakeTensorMode, bf16, 1024x1024 (4096 image tokens), text 512, b1",
        # Other work on the box inflates both sides alike; the digest's own share is digest_only.
        "machine": {"loadavg_1m": [load_start, load_average()[0]]},
        "reps": opts.reps,
        "graph": {"digest": line["graph_digest"], "nodes": line["nodes"], "params": params},
        "seconds": {
            "bare_export": [round(s, 3) for s in bare],
            "run_job": [round(s, 3) for s in trace],
            "digest_only": [round(s, 4) for s in digest_only],
            "bare_export_median": round(bare_med, 3),
            "trace_job_median": round(trace_med, 3),
            "digest_only_median": round(statistics.median(digest_only), 4),
        },
        "cpu_seconds": {
            "bare_export": [round(s, 3) for s in bare_cpu],
            "run_job": [round(s, 3) for s in trace_cpu],
            "bare_export_median": round(bare_cpu_med, 3),
            "trace_job_median": round(trace_cpu_med, 3),
        },
        "ratio_trace_over_bare": round(trace_med / bare_med, 3),
        "ratio_trace_over_bare_cpu": round(trace_cpu_med / bare_cpu_med, 3),
        "target_ratio": TARGET_RATIO,
        "meets_target": trace_med <= TARGET_RATIO * bare_med and trace_cpu_med <= TARGET_RATIO * bare_cpu_med,
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }
    print(json.dumps(write_result(opts.out, "trace_digest", numbers, packages=("diffusers",)), indent=2))


if __name__ == "__main__":
    main()
