"""One flux2-klein transformer step, side by side: cgbuild's minted artifacts against the peers.

Why: a precompiled artifact is worth shipping only if it serves at least as fast as what a user
gets by compiling the module in place. Every row here is the same module (seed-0 weights, the
entry's own), the same inputs (1024², 512 text tokens, batch 1) and the same process, so the
medians and ratios compare like with like:

  fp32               the stock module in float32, eager: the reference every error is taken against
  cgbuild_fp8        `adopt` of the minted fp8 artifact (its lanes re-fitted here), compiled-only
  cgbuild_bf16       `adopt` of the minted bf16 artifact
  cgbuild_fp8_pinned the fp8 artifact served on the lane `--pin fp8=LANE` names instead of the fit's
  cgbuild_bf16_pinned  (and `--pin bf16=LANE`): a lane the fit left in its tie band, timed beside it
  torchao_fp8        torchao's fp8 row-wise dynamic quantization (activations and weights) of a copy
                     of the stock module, then `torch.compile`, default mode, empty caches
  compile_bf16       `torch.compile` of the stock bf16 module, default mode
  compile_bf16_max   `torch.compile(mode="max-autotune-no-cudagraphs")` of the stock bf16 module

Each row: `first_s` (wrapping to the first output: adopt, or compilation), the median step in ms
of `--reps` CUDA-event timed calls after 3 warm-ups, its relative L2 error against fp32, and for
cgbuild how every call was served. `--profile N` adds N more steps under torch.profiler to each
row (`profile`: kernel time by group and the largest kernels, `profile_gpu.profiled`'s), so a
peer's compiled step and the artifact's are compared kernel by kernel in one process. The JSON is
rewritten after each row: a call cut short keeps what it measured.

    python benchmarks/klein_step_gpu.py OUT_JSON [--store A.tgz,..] [--keys LABEL=KEY,..]
                                                 [--lanes 'qk-norm = [...]'] [--only row,..]
                                                 [--pin fp8=LANE,bf16=LANE] [--profile N]
                                                 [--commit SHA]
    python benchmarks/klein_step_gpu.py OUT_JSON --tiny   # a CPU rehearsal: flux2-klein-tiny,
                                                          # fp32 and int8 minted on the cpu sku
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from harness import cgbuild, commit_option, cuda_times, rel_l2, scratch, wall_times, write_result
from profile_gpu import profiled
from targets import add_lanes, built_of, copy_workspace, job_of

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "flux2_klein"
ROWS = (
    "fp32",
    "cgbuild_fp8",
    "cgbuild_fp8_pinned",
    "cgbuild_bf16",
    "cgbuild_bf16_pinned",
    "torchao_fp8",
    "compile_bf16",
    "compile_bf16_max",
)
FULL = {  # the row's cgbuild layout, per mode
    "gpu": ("//flux2-klein/transformer/1024x1024-t512-b1@{}:sm_90", {"fp8": "fp8", "bf16": "bf16"}),
    "tiny": ("//flux2-klein-tiny/transformer/64x64-t8-b1@{}:cpu", {"fp8": "int8", "bf16": "fp32"}),
}


def _keys(ws: Path, labels: list[str]) -> dict[str, Any]:
    """Each label's key, minting it first where the plan does not find it fresh (the archives
    passed should make that a no-op on the card they were minted for)."""
    found: dict[str, Any] = {}
    for label in labels:
        start = time.perf_counter()
        entry = json.loads(cgbuild(ws, "plan", label, "--json").stdout)["targets"][0]
        if entry["status"] != "fresh":
            cgbuild(ws, "mint", label, "--json")
        seconds = round(time.perf_counter() - start, 1)
        found[label] = {"key": entry["key"], "status": entry["status"], "s": seconds}
    return found


class Step:
    """The stock module and its inputs, built once, and one method per row."""

    def __init__(self, opts: argparse.Namespace, ws: Path, labels: dict[str, str]) -> None:
        from cgbuild.store.local import Store

        self.opts, self.labels, self.ws = opts, labels, ws
        self.store = Store(ws / ".cgbuild" / "store")
        given = dict(kv.split("=", 1) for kv in opts.keys.split(",") if kv)
        keys = {
            label: {"key": given[label], "status": "given"} for label in labels.values() if label in given
        }
        keys |= _keys(ws, [label for label in labels.values() if label not in given])
        self.doc: dict[str, Any] = {"tiny": opts.tiny, "reps": opts.reps, "keys": keys, "rows": {}}
        pattern = FULL["tiny" if opts.tiny else "gpu"][0]
        self.stock = self.build(pattern.format("fp32" if opts.tiny else "bf16"), stock=True)
        self.ref: Any = None

    def build(self, label: str, stock: bool = False) -> Any:
        """The module the label's trace builds, or with `stock` the stock module (diffusers' own
        attention, no lanes): the same seed-0 weights either way."""
        if not stock:
            return built_of(self.ws, label)
        from cgbuild_rules import trace

        raw = job_of(self.ws, label)
        raw["spec"].pop("lanes", None)
        return trace.build(trace.parse_job(raw), "real")

    def save(self) -> None:
        packages = ("diffusers", "torchao")
        write_result(
            self.opts.out, "klein_step_gpu", self.doc, packages=packages, torch=True, commit=self.opts.commit
        )

    def measure(self, row: str, wrap: Callable[[], Callable[..., Any]], given: Any = None) -> dict[str, Any]:
        """`wrap()` timed to its first output, then the steady median; the row recorded and saved."""
        import torch

        given = self.stock.args if given is None else given
        timer = wall_times if self.opts.tiny else cuda_times
        start = time.perf_counter()
        with torch.inference_mode():
            fn = wrap()
            out = fn(*given)
            first = round(time.perf_counter() - start, 2)
            reps, warmup = (3, 0) if row == "fp32" else (self.opts.reps, 3)  # the reference: no contest
            steps = [s * 1e3 for s in timer(lambda: fn(*given), reps=reps, warmup=warmup)]
            cuda = not self.opts.tiny
            kernels = profiled(lambda: fn(*given), self.opts.profile, cuda) if self.opts.profile else None
        rec: dict[str, Any] = {"first_s": first, "ms": round(statistics.median(steps), 3)}
        rec["ms_all"] = [round(s, 3) for s in steps]
        if kernels is not None:
            rec["profile"] = kernels
        if row == "fp32":
            self.ref = out.float()
        elif self.ref is not None:
            rec["vs_fp32"] = rel_l2(out, self.ref, 5)
        self.doc["rows"][row] = rec
        return rec

    def fp32(self, row: str) -> None:
        module = copy.deepcopy(self.stock.module).float()
        args = [a.float() if a.is_floating_point() else a for a in self.stock.args]
        self.measure(row, lambda: lambda *_: module(*args))

    def cgbuild(self, row: str) -> None:
        from cgbuild_rules.adopt import adopt

        label = self.labels[row]
        layout, pinned = row.split("_")[1], row.endswith("_pinned")
        pins = dict(kv.split("=", 1) for kv in self.opts.pin.split(",") if kv)
        if pinned and layout not in pins:
            raise ValueError(f"{row} needs --pin {layout}=LANE")
        built = self.build(label)
        # the stock inputs, in the dtype the layout takes them (the tiny int8 layout: bf16)
        pairs = zip(self.stock.args, built.args, strict=True)
        cast = [a.to(b.dtype) if a.is_floating_point() else a for a, b in pairs]
        served: list[Any] = []  # adopted inside the timed wrap: first_s counts the adopt

        def wrap() -> Any:
            key = self.doc["keys"][label]["key"]
            lane = pins[layout] if pinned else None
            served.append(adopt(key, built.module, store=self.store, strict=True, lane=lane))
            return served[0]

        rec = self.measure(row, wrap, cast)
        rec["counters"] = dict(served[0].counters)
        rec["lanes"] = {axis: v.lane for axis, v in served[0].lanes.items()}

    def compile(self, row: str) -> None:
        import torch

        mode = "max-autotune-no-cudagraphs" if row.endswith("_max") else None
        torch._dynamo.reset()
        self.measure(row, lambda: torch.compile(self.stock.module, mode=mode))["mode"] = mode or "default"

    def torchao(self, row: str) -> None:
        if self.opts.tiny:
            self.doc["rows"][row] = {"skipped": "torchao's fp8 row-wise needs an sm_89+ GPU"}
            return
        import torch
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

        module = copy.deepcopy(self.stock.module)

        def wrap() -> Any:
            quantize_(module, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
            torch._dynamo.reset()
            return torch.compile(module)

        self.measure(row, wrap)

    def ratios(self) -> Iterator[tuple[str, float]]:
        """cgbuild's speedup over each peer: the peer's median over cgbuild's."""
        ms = {row: rec["ms"] for row, rec in self.doc["rows"].items() if "ms" in rec}
        for ours, peer in (
            *((o, "torchao_fp8") for o in ("cgbuild_fp8", "cgbuild_fp8_pinned")),
            *((o, p) for o in ("cgbuild_bf16", "cgbuild_bf16_pinned") for p in ROWS if "compile" in p),
            ("cgbuild_fp8_pinned", "cgbuild_fp8"),
            ("cgbuild_bf16_pinned", "cgbuild_bf16"),
        ):
            if ours in ms and peer in ms:
                yield f"{ours}_vs_{peer}", round(ms[peer] / ms[ours], 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--store", default="", help="store archives to unpack into the workspace")
    parser.add_argument("--only", default=",".join(ROWS), help="the rows to run, in this script's order")
    parser.add_argument("--keys", default="", help="LABEL=KEY,..: keys known, not planned again")
    parser.add_argument("--lanes", default="", help="TOML lines added to the flagship's lanes table")
    parser.add_argument("--pin", default="", help="LAYOUT=LANE,..: the lane each _pinned row serves")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--profile", type=int, default=0, help="steps to profile after each row's timing")
    parser.add_argument("--tiny", action="store_true", help="a CPU rehearsal on the tiny family")
    commit_option(parser)
    opts = parser.parse_args()
    rows = [row for row in ROWS if row in opts.only.split(",")]
    pattern, layouts = FULL["tiny" if opts.tiny else "gpu"]
    labels = {row: pattern.format(layouts[row.split("_")[1]]) for row in rows if row.startswith("cgbuild_")}
    with scratch("klein-step-") as root:
        ws = copy_workspace(EXAMPLE, root / "ws", [a for a in opts.store.split(",") if a])
        if opts.lanes:
            add_lanes(ws / "Cgfile", "flux2-klein", opts.lanes.replace("\\n", "\n"))
        step = Step(opts, ws, labels)
        for row in rows:
            method = getattr(step, row.split("_")[0])
            try:
                method(row)
            except Exception as exc:  # a peer that fails is a row that says so; the others still run
                step.doc["rows"][row] = {"failed": f"{type(exc).__name__}: {str(exc)[:2000]}"}
            shown = {k: v for k, v in step.doc["rows"][row].items() if k not in ("ms_all", "profile")}
            print(row, json.dumps(shown)[:600], flush=True)
            step.save()
            if not opts.tiny:
                import torch

                torch.cuda.empty_cache()
        step.doc.update(step.ratios())
        step.save()
    print(json.dumps({k: v for k, v in step.doc.items() if "_vs_" in k}))


if __name__ == "__main__":
    main()
