"""flux2-klein's lanes on a GPU: each candidate kernel at the model's shapes, then the minted
artifacts served through every lane, beside `torch.compile` and an fp32 reference.

Why: the lane verdict a mint seals is only as good as the candidates it measures, and the
speed claim of an fp8 artifact is only worth its error. Two modes, each one call on the card:

  kernels   the `attention` lane's four ATen kernels on (1, 24, L, 128) bf16 for L = 2816 and
            4608 (768² and 1024² with 512 text tokens): median ms of 20 CUDA-event timed calls,
            TFLOP/s, error against fp64; and the `fp8-gemm` lane's two values at klein-4B's
            linear shapes: `scaled-mm` (the row quantization compiled by Inductor, then
            `torch._scaled_mm` with the bias) and `triton` (the compiled row scale, then
            `cgbuild::fp8_rowwise_linear_v1`), each whole and its GEMM alone, the row
            quantization alone, beside bf16
            `F.linear`, errors against fp64.
  models    in a copy of examples/flux2_klein: optionally `cgbuild plan '//flux2-klein:sm_90'`
            (the graph digests the tests bank), `cgbuild mint` of each `--mint` label (wall,
            phases, `cgbuild inspect`, the store archived), then for each `--serve` label, in
            this process: adopt (the sealed verdict, re-fitted here), then every lane pinned,
            15 timed steps each after 3 warm-ups; the entry's eager module; with `--compile`,
            `torch.compile` of the stock bf16 module (diffusers' own attention, no lanes) over
            an empty cache; errors are relative L2 norms against the stock module in fp32.

    python benchmarks/klein_lanes_gpu.py kernels OUT [--commit SHA]
    python benchmarks/klein_lanes_gpu.py models OUT [--plan] [--mint L,..] [--serve L,..]
                                                 [--store A.tgz,..] [--keys L=KEY,..] [--compile]
                                                 [--commit SHA]

Each JSON file it writes in OUT (kernels, plan, mint_<layout>, serve) carries the machine,
versions, date and commit.

benchmarks/results/klein_lanes_gpu.json gathers three such calls on one H200 (see its `runs`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import commit_option, cuda_timed, write_result
from targets import copy_workspace

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "flux2_klein"
GEMM_SHAPES = (  # (M tokens, K, N): the single blocks' fused in/out projections, the double blocks'
    (2816, 3072, 27648),  # feed-forward and attention output, at 768² (2816) and 1024² (4608 / 4096)
    (2816, 12288, 3072),
    (4608, 3072, 27648),
    (4608, 12288, 3072),
    (4096, 3072, 18432),
    (4096, 9216, 3072),
    (4096, 3072, 3072),
)


def _write(path: Path, numbers: dict[str, Any], opts: argparse.Namespace) -> None:
    write_result(path, "klein_lanes_gpu", numbers, packages=("diffusers",), torch=True, commit=opts.commit)


def _events(fn: Callable[[], Any], warm: int, reps: int) -> float:
    """Median milliseconds of `reps` CUDA-event-timed calls after `warm` untimed ones."""
    return round(cuda_timed(fn, reps=reps, warmup=warm) * 1e3, 4)


def _rel(x: Any, y: Any) -> float:
    return round(float((x.double() - y.double()).norm() / y.double().norm()), 6)


def _attention_rows(tokens: int, gen: Any) -> list[dict[str, Any]]:
    import flux2_entry
    import torch

    q, k, v = (
        torch.randn(1, 24, tokens, 128, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(3)
    )
    ref = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 128**0.5, -1) @ v.double()
    flops = 4 * 24 * tokens * tokens * 128
    rows = []
    for lane, fn in flux2_entry.ATTENTION.items():
        ms = _events(lambda fn=fn: fn(q, k, v), 5, 20)
        rows.append(
            {"tokens": tokens, "lane": lane, "ms": ms, "tflops": round(flops / ms / 1e9, 1),
             "rel_vs_fp64": _rel(fn(q, k, v), ref)}
        )  # fmt: skip
    return rows


def _gemm_row(m: int, k_in: int, n: int, gen: Any, quantize: Any, row_scale: Any) -> dict[str, Any]:
    import torch
    from cgbuild_rules import quant

    x = torch.randn(m, k_in, device="cuda", generator=gen, dtype=torch.bfloat16)
    lin = torch.nn.Linear(k_in, n, device="cuda", dtype=torch.bfloat16)
    q8 = quant.convert(torch.nn.Sequential(lin), "fp8-rowwise", torch.bfloat16)[0][0]
    w, ws, b = q8.weight, q8.weight_scale, q8.bias
    xs, xq = quant._row_scale(x), quantize(x)
    fused = torch.ops.cgbuild.fp8_rowwise_linear_v1

    def scaled_mm(xq: Any, xs: Any) -> Any:
        return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws[None, :], bias=b, out_dtype=torch.bfloat16)

    def scaled_lane() -> Any:
        return scaled_mm(quantize(x), quant._row_scale(x))

    def triton_lane() -> Any:
        return fused(x, row_scale(x), w, ws, b)

    ref = x.double() @ lin.weight.double().t() + lin.bias.double()
    row: dict[str, Any] = {
        "M": m,
        "K": k_in,
        "N": n,
        "bf16_ms": _events(lambda: lin(x), 5, 20),
        "scaled_mm_lane_ms": _events(scaled_lane, 5, 20),
        "scaled_mm_gemm_ms": _events(lambda: scaled_mm(xq, xs), 5, 20),
        "triton_lane_ms": _events(triton_lane, 5, 20),
        "triton_gemm_ms": _events(lambda: fused(x, xs.reshape(-1), w, ws, b), 5, 20),
        "quant_ms": _events(lambda: quantize(x), 5, 20),
        "rel_bf16_vs_fp64": _rel(lin(x), ref),
        "rel_scaled_mm_vs_fp64": _rel(scaled_lane(), ref),
        "rel_triton_vs_fp64": _rel(triton_lane(), ref),
        "rel_triton_vs_scaled_mm": _rel(triton_lane(), scaled_lane()),
    }
    for name in ("scaled_mm_gemm", "triton_gemm"):
        row[f"{name}_tflops"] = round(2 * m * k_in * n / row[f"{name}_ms"] / 1e9, 1)
    return row


def kernels(out: Path, opts: argparse.Namespace) -> dict[str, Any]:
    import torch

    sys.path.insert(0, str(EXAMPLE))
    from cgbuild_rules import fp8_gemm, quant

    res: dict[str, Any] = {"attention": [], "gemm": []}
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for tokens in (2816, 4608):
            res["attention"] += _attention_rows(tokens, gen)
        fp8_gemm.op()
        quantize = torch.compile(
            lambda x: (x.float() / quant._row_scale(x)).clamp(-448, 448).to(torch.float8_e4m3fn), dynamic=True
        )
        row_scale = torch.compile(lambda x: quant._row_scale(x).reshape(-1), dynamic=True)
        for m, k_in, n in GEMM_SHAPES:
            res["gemm"].append(_gemm_row(m, k_in, n, gen, quantize, row_scale))
            print(res["gemm"][-1], flush=True)
    _write(out / "kernels.json", res, opts)
    return res


def _cli(ws: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "cgbuild.cli", "-C", str(ws), *args], capture_output=True, text=True
    )
    return done, round(time.perf_counter() - start, 1)


def models(out: Path, opts: argparse.Namespace) -> dict[str, Any]:
    ws = copy_workspace(EXAMPLE, Path(tempfile.mkdtemp()) / "ws", filter(None, opts.store.split(",")))
    keys = dict(kv.split("=", 1) for kv in filter(None, opts.keys.split(",")))
    if opts.plan:
        done, wall = _cli(ws, "plan", "//flux2-klein:sm_90", "--json")
        plan = json.loads(done.stdout) if done.stdout else None
        _write(out / "plan.json", {"wall_s": wall, "rc": done.returncode, "plan": plan}, opts)
    for label in filter(None, opts.mint.split(",")):
        layout = label.split("@")[1].split(":")[0]
        done, wall = _cli(ws, "mint", label, "--json", "-j", "1")
        rec: dict[str, Any] = {
            "label": label,
            "wall_s": wall,
            "rc": done.returncode,
            "mint": json.loads(done.stdout),
        }
        rec["inspect"] = json.loads(_cli(ws, "inspect", label, "--json")[0].stdout)
        for minted in rec["mint"]["minted"]:
            keys[label] = minted["key"]
        _write(out / f"mint_{layout}.json", rec, opts)
        with tarfile.open(out / f"store_{layout}.tgz", "w:gz") as tar:
            tar.add(ws / ".cgbuild" / "store", arcname="store")
    if not opts.serve:
        return {}
    return _serve(ws, out, opts, keys)


def _serve(ws: Path, out: Path, opts: argparse.Namespace, keys: dict[str, str]) -> dict[str, Any]:
    import torch
    from cgbuild_rules import trace
    from cgbuild_rules.adopt import adopt

    from cgbuild.config import cgfile
    from cgbuild.plan.jobs import resolve_toolchains, trace_job
    from cgbuild.plan.workspace import Workspace
    from cgbuild.store.local import Store

    workspace = Workspace(cgfile.load(ws / "Cgfile"))
    toolchains = resolve_toolchains(workspace)[0]
    store = Store(ws / ".cgbuild" / "store")

    def build(label: str, stock: bool = False) -> Any:
        raw = trace_job(workspace, label, toolchains).with_id("b").to_json()
        if stock:
            raw["spec"].pop("lanes", None)
        return trace.build(trace.parse_job(raw), "real")

    def steady(fn: Any, args: Any) -> float:
        with torch.inference_mode():
            return _events(lambda: fn(*args), 3, 15)

    res: dict[str, Any] = {"keys": keys, "targets": {}}
    bf16 = opts.serve.split(",")[0].split("@")[0] + "@bf16:sm_90"
    ref_built = build(bf16, stock=True)
    ref_built.module.float()
    with torch.inference_mode():
        ref = ref_built.module(*[a.float() if a.is_floating_point() else a for a in ref_built.args]).float()
    del ref_built
    if opts.compile:
        stock = build(bf16, stock=True)
        start = time.perf_counter()
        compiled = torch.compile(stock.module)
        with torch.inference_mode():
            compiled(*stock.args)
            first = round(time.perf_counter() - start, 1)
            res["compile_bf16"] = {
                "first_s": first,
                "steady_ms": steady(compiled, stock.args),
                "vs_fp32": _rel(compiled(*stock.args).float(), ref),
                "eager_ms": steady(stock.module, stock.args),
                "eager_vs_fp32": _rel(stock.module(*stock.args).float(), ref),
            }
        del compiled, stock
    torch.cuda.empty_cache()
    for label in opts.serve.split(","):
        built = build(label)
        served = adopt(keys[label], built.module, store=store)
        sealed = served.armed[0].sealed
        carried = sealed.lanes.switches.carried() if sealed and sealed.lanes else []
        with torch.inference_mode():
            rec: dict[str, Any] = {
                "key": keys[label],
                "adopted": {
                    k: {"lane": v.lane, "code": v.code, "detail": v.detail} for k, v in served.lanes.items()
                },
                "verdict_ms": steady(served, built.args),
                "verdict_vs_fp32": _rel(served(*built.args).float(), ref),
                "eager_ms": steady(built.module, built.args),
                "eager_vs_fp32": _rel(built.module(*built.args).float(), ref),
                "lanes": {},
            }
            for lane in carried:
                pinned = adopt(keys[label], built.module, store=store, lane=lane)
                rec["lanes"][lane] = {
                    "ms": steady(pinned, built.args),
                    "vs_fp32": _rel(pinned(*built.args).float(), ref),
                    "counters": dict(pinned.counters),
                }
        res["targets"][label] = rec
        print(label, json.dumps(rec), flush=True)
        del built, served
        torch.cuda.empty_cache()
    _write(out / "serve.json", res, opts)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("kernels", "models"))
    ap.add_argument("out", type=Path)
    ap.add_argument("--plan", action="store_true")
    ap.add_argument("--mint", default="")
    ap.add_argument("--serve", default="")
    ap.add_argument("--store", default="")
    ap.add_argument("--keys", default="")
    ap.add_argument("--compile", action="store_true")
    commit_option(ap)
    opts = ap.parse_args()
    opts.out.mkdir(parents=True, exist_ok=True)
    if opts.mode == "kernels":
        kernels(opts.out, opts)
    else:
        models(opts.out, opts)


if __name__ == "__main__":
    main()
