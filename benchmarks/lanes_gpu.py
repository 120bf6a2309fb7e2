"""The toy's kernel lanes on a GPU: one AOTI artifact, three lanes, each bound and measured.

Why: a CPU box never builds the `triton` lane (it needs CUDA and triton), so the claims that
matter on a card are checked here, on a machine with one: (1) the one compiled artifact, given
each lane's selector, gives each lane's eager result, the Triton kernel
included; (2) a fresh serving process that never imports the entry (so `toy::triton_linear` is
not registered) still runs the Triton lane: AOTInductor compiled the kernel into the package
rather than calling the op back through the proxy executor; (3) the mint's measurement protocol
(`cgbuild_rules.lanes.measure`: 3 warm-ups, reset peak, 9 timed calls with CUDA events, median,
torch allocator peak), per lane, each in a fresh process, and the rule's verdict for the SKUs
of that sm (`cgbuild.lanes.decide`).

The module is the toy MLP at a size where a matmul's cost shows (`--rows`, `--hidden`); the
lanes are the toy's own implementations. Writes the JSON named by `--out`; the committed
benchmarks/results/lanes_gpu.json holds one such run beside a `cgbuild mint` of the toy's sm_90
target made on the same machine (its sealed lanes block and its lane evidence).

    python benchmarks/lanes_gpu.py [--rows 8192] [--hidden 4096] [--out OUT_JSON] [--commit SHA]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import commit_option, write_result

ROOT = Path(__file__).resolve().parents[1]
LANES = ["baseline", "chunked", "triton"]

_SERVE = """
import json, sys, torch
from cgbuild_rules.lanes import measure, switch_inputs
from cgbuild_rules.loader import Package
from cgbuild.lanes import Switches
work, lane, mode = sys.argv[1], sys.argv[2], sys.argv[3]
table = Switches.from_json(json.load(open(work + "/lanes.json")))
state = torch.load(work + "/state.pt")
x = state.pop("__x__")
package = Package(work + "/model.pt2", device_index=0)
package.bind(state)
_, inputs = switch_inputs(table, {"linear": lane}, "cuda")
out = {"lane": lane, "entry_imported": "toy_models" in sys.modules,
       "op_registered": hasattr(torch.ops, "toy") and hasattr(torch.ops.toy, "triton_linear")}
with torch.no_grad():
    y = package(x, **inputs)
torch.cuda.synchronize()
want = torch.load(work + "/eager.pt")[lane]
out["max_abs_vs_eager"] = float((y - want).abs().max())
out["rel_rms_vs_eager"] = float((y - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())
if mode == "measure":
    out.update(measure(lambda: package(x, **inputs), torch.device("cuda")))
print(json.dumps(out))
"""


def _has_config(name: str) -> bool:
    import torch._inductor.config as config

    try:
        config.__getattr__(name)
        return True
    except AttributeError:
        return False


def _traces() -> dict[str, Any]:
    """cgbuild's own trace rule on this CUDA build (fake and real modes): does each lane set trace?"""
    from cgbuild_rules.trace import export_job

    out: dict[str, Any] = {}
    for name, values, mode, config in (
        ("fake_all", LANES, "fake", {"hidden": 128, "out": 10}),
        ("fake_all_out16", LANES, "fake", {"hidden": 128, "out": 16}),
        ("fake_all_chunks1", LANES, "fake", {"hidden": 128, "out": 10, "chunks": 1}),
        ("fake_baseline_triton", ["baseline", "triton"], "fake", {"hidden": 128, "out": 10}),
        ("real_all", LANES, "real", {"hidden": 128, "out": 10}),
    ):
        job = {
            "id": name,
            "entry": "toy_models:build",
            "root": str(ROOT / "examples" / "toy"),
            "config": config,
            "quant": "plain.fp32",
            "spec": {
                "family": "toy",
                "module": "mlp",
                "graph_class": "8x64-b1",
                "height": 8,
                "width": 64,
                "text_len": None,
                "batch": 1,
                "dtype": "float32",
                "device": "cuda",
                "lanes": {"linear": values},
            },
        }
        try:
            _, facts = export_job(job, mode)  # type: ignore[arg-type]
            out[name] = {"ok": True, "digest": facts["graph_digest"]}
        except Exception as e:
            out[name] = {"ok": False, "error": f"{type(e).__name__}: {' '.join(str(e).split())[:1500]}"}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "lanes_gpu.json"))
    commit_option(ap)
    args = ap.parse_args()

    import torch  # noqa: F401

    sys.path.insert(0, str(ROOT / "examples" / "toy"))
    import toy_models  # noqa: F401  (the entry, imported before the traces as it always was)

    traces = _traces()
    print(json.dumps(traces, indent=1))
    work = Path(tempfile.mkdtemp(prefix="lanes-gpu-"))
    m, x, eager, ep, triton_vs_cublas = _program(args.rows, args.hidden)
    graph_ops, sub_ops = _ops(ep)
    compile_s = _package(ep, m, x, eager, work)
    runs = _serve(work)
    verdicts = _verdicts(runs)
    numbers = {
        "what": f"toy MLP, {args.hidden} wide, {args.rows} rows, fp32, lanes {LANES}",
        "traces": traces,
        "triton_kernel_vs_cublas_max_abs": triton_vs_cublas,
        "export_ops": graph_ops,
        "branch_ops": sub_ops,
        "compile_s": round(compile_s, 2),
        "package_bytes": (work / "model.pt2").stat().st_size,
        "eager_max_abs_vs_baseline": {
            lane: float((eager[lane] - eager["baseline"]).abs().max()) for lane in LANES
        },
        "runs": runs,
        "verdicts": verdicts,
    }
    write_result(Path(args.out), "lanes_gpu", numbers, commit=args.commit)
    print(json.dumps({k: numbers[k] for k in ("compile_s", "package_bytes", "branch_ops")}, indent=1))
    shown = ("median_ns", "peak_bytes", "rel_rms_vs_eager", "entry_imported", "op_registered", "error")
    for lane, r in runs.items():
        print(lane, {k: r.get(k) for k in shown})
    for sku, v in verdicts.items():
        print(sku, v["winner"], v["binding"], v["fallback"])
    return 0


def _program(rows: int, hidden: int) -> tuple[Any, Any, dict[str, Any], Any, float]:
    """The toy MLP with every lane on the GPU: each lane's eager output, the exported program (its
    lane selector included), and the Triton kernel's distance from cuBLAS on the same rows."""
    import torch
    import toy_models
    from cgbuild_rules.lanes import export, selector_of, set_lanes

    dev = torch.device("cuda")
    torch.manual_seed(0)
    m = toy_models.MLP(hidden, hidden, hidden, {"linear": LANES}).to(dev).eval()
    x = torch.randn(1, rows, hidden, device=dev)
    eager: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for lane in LANES:
            set_lanes(m, {"linear": lane})
            eager[lane] = m(x)
        set_lanes(m, {"linear": "baseline"})
        ep = export(m, (x,), {}, None, selector_of(m, dev))
        rows2d = x.reshape(-1, hidden)
        direct = toy_models.triton_linear()(rows2d, m.fc1.weight, m.fc1.bias)
        triton_vs_cublas = float(
            (direct - torch.nn.functional.linear(rows2d, m.fc1.weight, m.fc1.bias)).abs().max()
        )
    return m, x, eager, ep, triton_vs_cublas


def _ops(ep: Any) -> tuple[list[str], list[str]]:
    """The exported program's ops, and those of its branches (the lanes' subgraphs)."""
    import torch

    graph_ops = sorted({str(n.target) for n in ep.graph_module.graph.nodes if n.op == "call_function"})
    sub_ops = sorted(
        {
            str(n.target)
            for mod in ep.graph_module.modules()
            if isinstance(mod, torch.fx.GraphModule)
            for n in mod.graph.nodes
            if n.op == "call_function"
        }
    )
    return graph_ops, sub_ops


def _package(ep: Any, m: Any, x: Any, eager: dict[str, Any], work: Path) -> float:
    """The program compiled under the mint policy into `work/model.pt2`, beside what a serving
    process reads (the lane table, the weights and input, the eager outputs). Returns compile seconds."""
    import torch
    from cgbuild_rules.lanes import lane_rows, switch_table

    from cgbuild.identity import compiler, policy

    # the mint policy's settings this torch knows (an older torch lacks e.g. the x86 clamp knobs)
    known: dict[str, Any] = {k: v for k, v in policy.inductor_configs("x86_64").items() if _has_config(k)}
    known["cpp.cxx"] = (None, compiler.choose_cxx(None))  # never $CXX (a wrapper here segfaults loads)
    t = time.perf_counter()
    torch._inductor.aoti_compile_and_package(ep, package_path=str(work / "model.pt2"), inductor_configs=known)
    compile_s = time.perf_counter() - t
    rows = lane_rows(m, ["linear"], {"linear": LANES})
    (work / "lanes.json").write_text(json.dumps(switch_table(rows).to_json()))
    state = {**{k: v for k, v in m.state_dict().items()}, "__x__": x}
    torch.save(state, work / "state.pt")
    torch.save(eager, work / "eager.pt")
    return compile_s


def _serve(work: Path) -> dict[str, Any]:
    """Each lane served and measured in a fresh process that never imports the entry."""
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    runs: dict[str, Any] = {}
    for lane in LANES:
        proc = subprocess.run(
            [sys.executable, "-c", _SERVE, str(work), lane, "measure"],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        if proc.returncode != 0:
            runs[lane] = {"returncode": proc.returncode, "error": (proc.stderr + proc.stdout)[-3000:]}
            continue
        runs[lane] = json.loads(proc.stdout.strip().splitlines()[-1])
    return runs


def _verdicts(runs: dict[str, Any]) -> dict[str, Any]:
    """`lanes.decide` over the measured lanes for GPUs of four memory sizes (none under two lanes)."""
    from cgbuild import lanes

    measured = [
        lanes.Measured(lane, r["median_ns"], r["peak_bytes"]) for lane, r in runs.items() if "median_ns" in r
    ]
    if len(measured) < 2:
        return {}
    return {
        sku: lanes.decide(measured, sku, gib << 30)
        for sku, gib in (("h200", 141), ("rtx-pro-6000", 96), ("rtx5090", 32), ("l4", 24))
    }


if __name__ == "__main__":
    sys.exit(main())
