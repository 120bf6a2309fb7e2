"""What a user sees serving FLUX.2 [klein] (4B-shaped) as a stock diffusers pipeline on a GPU.

    python benchmarks/pipeline_gpu.py all WORK OUT_JSON [--phases a,b,...] [--archive-out DIR]
                                                       [--lanes-archive A.tgz] [--commit SHA]
                                                       [--selector] [--lanes 'qk-norm = [...]']

`setup` copies the example workspace twice: with its lanes dropped (the plain bf16 programs the
committed `gpu_sm90_store_fp8.tgz` and `gpu_sm90_store_768.tgz` archives hold) and as committed
(the fp8 program with its lanes, `gpu_sm90_store_lanes.tgz`, or `--lanes-archive`: a store
minted since, e.g. by `klein_lanes_gpu.py models --mint`, whose keys the plan then finds fresh).
It unpacks those archives, and `gpu_sm90_store_vae.tgz` when committed, into one serving store;
mints the VAE decoder when the plan says it is not fresh (its store archive written to
`--archive-out`); writes the serving manifests and a seed-0 bf16 checkpoint of the transformer,
the VAE and the prompt embeddings. Then every path is a new process that builds a stock
`Flux2KleinPipeline` (no text encoder: prompt embeddings given) from that checkpoint (in the page
cache) and makes 4-step images, batch 1:

  fp32            the eager pipeline in float32: the reference image for every error
  eager           the eager pipeline in bf16
  compile_cold    `torch.compile` of the transformer and `vae.decode`, empty caches
  compile_warm    the same in a new process over the warm caches
  cgbuild_bf16    `adopt_pipeline` with the bf16 transformer and decoder
  cgbuild_fp8     `adopt_pipeline` with the fp8 transformer (compiled-only) and the bf16 decoder;
                  then a call outside its envelope under `torch.profiler`: `CompiledRequired`
                  raised and no CUDA kernel launched
  *_768           the same at 768x768 (fp32, compile_cold, compile_warm, cgbuild_bf16)
  importtime      `python -X importtime` of importing the pipeline's code: what dominates

Each path reports time to first image broken into import torch, import diffusers, import the
pipeline's module (diffusers imports it lazily; it imports transformers), weights
(`from_pretrained` with `device_map="cuda"`), arm (adopt or compile wrapping), warm-up and the
first image; the steady image latency (median of
10 images after 2 warm-up images, CUDA events around the whole pipeline call); the image's
relative L2 error against the fp32 image; and, for cgbuild, how every call was served.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

from harness import PhaseClock, cgbuild, commit_option, cuda_times, write_result
from targets import add_lanes, drop_lanes

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
EXAMPLE = ROOT / "examples" / "flux2_klein"
ARCHIVES = ("gpu_sm90_store_fp8.tgz", "gpu_sm90_store_768.tgz", "gpu_sm90_store_vae.tgz")
LANES_ARCHIVE = "gpu_sm90_store_lanes.tgz"
VAE_ARCHIVE = "gpu_sm90_store_vae.tgz"
STEPS = 4
TEXT = 512
IMAGES = 10
PATHS = (
    "fp32",
    "eager",
    "compile_cold",
    "compile_warm",
    "cgbuild_bf16",
    "cgbuild_fp8",
    "fp32_768",
    "compile_cold_768",
    "compile_warm_768",
    "cgbuild_bf16_768",
    "importtime",
)
MANIFESTS = {  # (workspace, selector) of each part: `ws` without lanes, `ws-lanes` as committed
    "bf16": (("ws", "//flux2-klein@bf16:sm_90"),),
    "fp8": (
        ("ws-lanes", "//flux2-klein/transformer/1024x1024-t512-b1@fp8:sm_90"),
        ("ws", "//flux2-klein/vae.decode@bf16:sm_90"),
    ),
}
SELECTOR_MANIFESTS = {  # --selector: both transformers with their lanes (gpu_sm90_store_klein.tgz)
    "bf16": (
        ("ws-lanes", "//flux2-klein/transformer/1024x1024-t512-b1@bf16:sm_90"),
        ("ws-lanes", "//flux2-klein/vae.decode/1024x1024-b1@bf16:sm_90"),
    ),
    "fp8": (
        ("ws-lanes", "//flux2-klein/transformer/1024x1024-t512-b1@fp8:sm_90"),
        ("ws-lanes", "//flux2-klein/vae.decode/1024x1024-b1@bf16:sm_90"),
    ),
}


def _statuses(ws: Path, selector: str) -> dict[str, str]:
    plan = json.loads(cgbuild(ws, "plan", selector, "--json").stdout)
    return {t["label"]: t["status"] for t in plan["targets"]}


def _workspace(ws: Path, lanes: bool, archives: tuple[Path, ...], extra: str = "") -> None:
    """The example at `ws` (kept when there: its store holds what an earlier call minted), with
    its lanes dropped, or with `extra` lines added to them."""
    if not ws.exists():
        shutil.copytree(EXAMPLE, ws, ignore=shutil.ignore_patterns(".cgbuild", "__pycache__"))
        if not lanes:
            drop_lanes(ws / "Cgfile")
        elif extra:
            add_lanes(ws / "Cgfile", "flux2-klein", extra)
    (ws / ".cgbuild").mkdir(exist_ok=True)
    for archive in archives:
        if archive.exists():
            with tarfile.open(archive) as tar:
                tar.extractall(ws / ".cgbuild", filter="data")


def setup(
    work: Path, archive_out: Path | None, lanes_archive: Path, selector: bool, lanes: str = ""
) -> dict[str, Any]:
    ws = work / "ws"
    archives = (*(RESULTS / n for n in ARCHIVES), lanes_archive)
    manifests = SELECTOR_MANIFESTS if selector else MANIFESTS
    _workspace(ws, False, archives)  # the serving store holds every artifact
    _workspace(work / "ws-lanes", True, (lanes_archive, RESULTS / VAE_ARCHIVE), lanes)
    rec: dict[str, Any] = {"archives": [a.name for a in archives if a.exists()], "manifests": manifests}
    if lanes:
        rec["lanes_added"] = lanes
    t = time.perf_counter()
    if selector:  # only what is served (a trace of 4B takes a while; the archive's cache is warm)
        rec["plan"] = before = {}
        for where, label in manifests["bf16"] + manifests["fp8"][:1]:
            rec["plan"].update(_statuses(work / where, label))
    else:
        rec["plan"] = before = _statuses(ws, MANIFESTS["bf16"][0][1])
        rec["plan_lanes"] = _statuses(work / "ws-lanes", MANIFESTS["fp8"][0][1])
    rec["plan_s"] = round(time.perf_counter() - t, 2)
    vae = [label for label, status in before.items() if "/vae.decode/" in label and status != "fresh"]
    if vae:
        t = time.perf_counter()
        minted = cgbuild(ws, "mint", "//flux2-klein/vae.decode:sm_90", "--json")
        rec["vae_mint"] = {
            "seconds": round(time.perf_counter() - t, 1),
            "summary": json.loads(minted.stdout.strip().splitlines()[-1]),
        }
        if archive_out is not None:
            rec["vae_archive"] = str(_archive_vae(ws, archive_out / VAE_ARCHIVE))
        rec["plan_after"] = _statuses(ws, manifests["bf16"][0][1])
    for name, parts in manifests.items():
        docs = []
        for i, (where, selector) in enumerate(parts):
            out = work / f"manifest-{name}-{i}.json"
            cgbuild(work / where, "manifest", selector, "-o", str(out))
            docs.append(json.loads(out.read_text()))
        merged = docs[0]
        for doc in docs[1:]:  # one family's manifests of disjoint modules: one manifest
            merged["modules"].update(doc["modules"])
        (work / f"manifest-{name}.json").write_text(json.dumps(merged, indent=1))
    proc = subprocess.run([sys.executable, __file__, "weights", str(work)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"weights failed:\n{proc.stderr[-3000:]}")
    rec["weights"] = json.loads(proc.stdout.strip().splitlines()[-1])
    return rec


def _archive_vae(ws: Path, dest: Path) -> Path:
    """The store's VAE keys (refs, objects, evidence) as a tar a later run unpacks."""
    from cgbuild.store.local import Store

    store = ws / ".cgbuild" / "store"
    members: list[Path] = []
    for ref in sorted((store / "refs").glob("*/*.json")):
        doc = json.loads(ref.read_text())
        if not any("/vae.decode/" in label for label in doc.get("metadata", {}).get("labels", [])):
            continue
        members.append(ref)
        obj = doc.get("object")
        members += [Store(store).object_path(obj)] if obj else []
        members += (
            sorted((store / "evidence" / doc["key"]).glob("*")) if (store / "evidence").exists() else []
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(dest, "w:gz") as tar:
        for m in members:
            tar.add(m, arcname=str(m.relative_to(ws / ".cgbuild")))
    return dest


def _configs(work: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    import tomllib

    fam = tomllib.loads((work / "ws" / "Cgfile").read_text())["family"]["flux2-klein"]
    return dict(fam["config"]["model"]), dict(fam["config"].get("vae") or {})


def weights(work: Path) -> dict[str, Any]:
    """A seed-0 bf16 pipeline saved as diffusers saves one (`pipe/`: model_index.json, the
    transformer and the VAE, no text encoder), and the prompt embeddings, on disk."""
    import torch
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )
    from safetensors.torch import save_file

    model_cfg, vae_cfg = _configs(work)
    t = time.perf_counter()
    torch.manual_seed(0)
    with torch.device("cuda"):
        transformer = Flux2Transformer2DModel(**model_cfg).to(torch.bfloat16)
        vae = AutoencoderKLFlux2(**vae_cfg).to(torch.bfloat16)
    Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        transformer=transformer,
        is_distilled=True,
    ).save_pretrained(work / "pipe")
    gen = torch.Generator().manual_seed(1)
    embeds = torch.randn(1, TEXT, model_cfg["joint_attention_dim"], generator=gen).to(torch.bfloat16)
    save_file({"prompt_embeds": embeds}, work / "embeds.safetensors")
    params = sum(p.numel() for p in transformer.parameters())
    return {"transformer_params": params, "seconds": round(time.perf_counter() - t, 1)}


def _pipeline(work: Path, dtype: Any) -> Any:
    """The stock way in: `from_pretrained` with the weights placed straight on the GPU
    (`device_map`: built on the meta device, no random init, no copy through the host)."""
    from diffusers import Flux2KleinPipeline

    pipe = Flux2KleinPipeline.from_pretrained(
        work / "pipe", text_encoder=None, tokenizer=None, dtype=dtype, device_map="cuda"
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _image(pipe: Any, embeds: Any, size: int) -> Any:
    import torch

    with torch.inference_mode():
        return pipe(
            prompt_embeds=embeds,
            height=size,
            width=size,
            num_inference_steps=STEPS,
            output_type="pt",
            generator=torch.Generator("cuda").manual_seed(3),
        ).images


def _rel(out: Any, ref: Any) -> float:
    diff = (out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)
    return float(diff)


def phase(name: str, work: Path) -> dict[str, Any]:
    """One path in this process (a fresh child per path): time to first image part by part, the
    steady image latency, the error against the fp32 image and how cgbuild served the calls."""
    clock = PhaseClock()
    import torch

    clock.lap("import_torch")
    import diffusers  # noqa: F401

    clock.lap("import_diffusers")
    from diffusers import Flux2KleinPipeline  # noqa: F401  (its module imports transformers)

    clock.lap("import_pipeline")
    size = 768 if name.endswith("_768") else 1024
    kind = name.removesuffix("_768")
    pipe, embeds = _loaded(work, kind)
    clock.lap("weights")
    rec: dict[str, Any] = {"size": size}
    served, target = _armed(pipe, kind, work, clock, rec)
    torch.cuda.synchronize()
    clock.lap("warmup")
    first = _image(target, embeds, size)
    torch.cuda.synchronize()
    clock.lap("first_image")
    clock.total("to_first_image")
    rec["seconds"] = clock.record
    last: list[Any] = [None]

    def image() -> None:
        last[0] = _image(target, embeds, size)

    times = [s * 1e3 for s in cuda_times(image, reps=IMAGES, warmup=2)]
    rec["image_ms"] = round(sorted(times)[len(times) // 2], 2)
    rec["image_ms_all"] = [round(x, 2) for x in times]
    _errors(rec, work, kind, size, first, last[0])
    if served is not None:
        rec["counters"] = served.counters
        rec["eager_calls"] = sum(
            n for c in served.counters.values() for k, n in c.items() if k.startswith(("eager:", "refused:"))
        )
        if kind == "cgbuild_fp8":
            rec["compiled_only_check"] = _compiled_only_check(pipe, embeds)
    rec["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return rec


def _loaded(work: Path, kind: str) -> tuple[Any, Any]:
    """The stock pipeline from the checkpoint and the prompt embeddings, in the path's dtype (the
    fp8 path's transformer converted), on the GPU."""
    import torch
    from safetensors.torch import load_file

    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    pipe = _pipeline(work, dtype)
    embeds = load_file(work / "embeds.safetensors", device="cuda")["prompt_embeds"].to(dtype)
    if kind == "cgbuild_fp8":
        from cgbuild_rules.quant import convert

        convert(pipe.transformer, "fp8-rowwise", torch.bfloat16)
    torch.cuda.synchronize()
    return pipe, embeds


def _armed(pipe: Any, kind: str, work: Path, clock: PhaseClock, rec: dict[str, Any]) -> tuple[Any, Any]:
    """The path's pipeline armed (adopted, compile-wrapped or as is), `arm` lapped on `clock` before
    any warm-up: the served pipeline (None but for cgbuild) and what makes the images."""
    import torch

    if kind.startswith("cgbuild"):
        from cgbuild_rules.pipeline import adopt_pipeline

        from cgbuild.store.local import Store

        manifest = work / f"manifest-{'fp8' if kind == 'cgbuild_fp8' else 'bf16'}.json"
        served = adopt_pipeline(pipe, manifest, store=Store(work / "ws" / ".cgbuild" / "store"))
        clock.lap("arm")
        rec["warmup"] = served.warmup()
        return served, served
    if kind.startswith("compile"):
        pipe.transformer.compile()
        pipe.vae.decode = torch.compile(pipe.vae.decode)
    clock.lap("arm")
    return None, pipe


def _errors(rec: dict[str, Any], work: Path, kind: str, size: int, first: Any, out: Any) -> None:
    """The steady image's relative error against the fp32 path's (which saves it) and the first's."""
    import torch

    ref_path = work / f"fp32_{size}.pt"
    if kind == "fp32":
        torch.save(out.float().cpu(), ref_path)
    elif ref_path.exists():
        rec["rel_err_vs_fp32"] = round(_rel(out.cpu(), torch.load(ref_path)), 5)
    rec["rel_err_first_vs_steady"] = round(_rel(first, out), 6)


def _compiled_only_check(pipe: Any, embeds: Any) -> dict[str, Any]:
    """A transformer call outside the fp8 envelope (768x768's tokens) under the profiler:
    `CompiledRequired` must be raised before any CUDA kernel of the module runs."""
    import torch
    from cgbuild_rules.adopt.refusal import CompiledRequired

    tokens, dim = 48 * 48, pipe.transformer.config.in_channels
    call = {
        "hidden_states": torch.randn(1, tokens, dim, device="cuda", dtype=torch.bfloat16),
        "timestep": torch.full((1,), 0.5, device="cuda", dtype=torch.bfloat16),
        "guidance": None,
        "encoder_hidden_states": embeds,
        "txt_ids": torch.zeros(1, TEXT, 4, dtype=torch.int64, device="cuda"),
        "img_ids": torch.zeros(1, tokens, 4, dtype=torch.int64, device="cuda"),
        "joint_attention_kwargs": None,
        "return_dict": False,
    }
    torch.cuda.synchronize()
    raised: str | None = None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        try:
            with torch.inference_mode():
                pipe.transformer(**call)
        except CompiledRequired as e:
            raised = f"{e.refusal.code}: {e.refusal.detail}"[:300]
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"raised": raised, "cuda_kernels": len(kernels), "kernel_names": kernels[:10]}


IMPORTS = {  # what a serving process imports, step by step
    "diffusers": "import torch, diffusers",
    "pipeline": "import torch, diffusers; diffusers.Flux2KleinPipeline",
}
WATCHED = ("torch._dynamo", "torch._inductor", "sympy", "transformers", "sklearn", "scipy")
"""Modules named in the profile whatever their depth: who pulls them in is the question."""


def importtime() -> dict[str, Any]:
    """Cumulative import time (`-X importtime`) of each step in `IMPORTS`: per package, the largest
    cumulative time of any of its modules (the package's own import, or a submodule imported later
    by another package: `torch` can be `torch._dynamo` pulled in by diffusers), ranked; and the
    `WATCHED` modules wherever they were first imported."""
    out: dict[str, Any] = {}
    for step, code in IMPORTS.items():
        argv = [sys.executable, "-X", "importtime", "-c", code]
        proc = subprocess.run(argv, capture_output=True, text=True)
        top: dict[str, int] = {}
        watched: dict[str, int] = {}
        for line in proc.stderr.splitlines():
            if not line.startswith("import time:") or "|" not in line:
                continue
            _, cumulative, name = (p.strip() for p in line.removeprefix("import time:").split("|"))
            if not cumulative.isdigit():
                continue
            root = name.split(".")[0]
            top[root] = max(top.get(root, 0), int(cumulative))
            if name in WATCHED:
                watched[name] = int(cumulative)
        ranked = sorted(top.items(), key=lambda kv: -kv[1])[:15]
        out[step] = {
            "code": code,
            "cumulative_ms": {k: round(v / 1000, 1) for k, v in ranked},
            "watched_ms": {k: round(v / 1000, 1) for k, v in watched.items()},
        }
    return out


def run_all(work: Path, out_json: Path, phases: list[str], args: argparse.Namespace) -> None:
    """`phases` in turn (`setup` first when asked or not done), `args` the command line's
    archives, commit, `--selector` and `--lanes`."""
    commit = args.commit
    results: dict[str, Any] = {}
    work.mkdir(parents=True, exist_ok=True)
    if "setup" in phases or not (work / "manifest-bf16.json").exists():
        results["setup"] = setup(work, args.archive_out, args.lanes_archive, args.selector, args.lanes)
        _write(out_json, results, commit)
    for name in [p for p in phases if p != "setup"]:
        if name == "importtime":
            results[name] = importtime()
        else:
            env = dict(os.environ)
            if name.startswith("compile_cold"):
                for sub in ("inductor", "triton"):
                    shutil.rmtree(work / sub, ignore_errors=True)
            env["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor")
            env["TRITON_CACHE_DIR"] = str(work / "triton")
            proc = subprocess.run(
                [sys.executable, __file__, "phase", name, str(work)], capture_output=True, text=True, env=env
            )
            lines = proc.stdout.strip().splitlines()
            results[name] = (
                json.loads(lines[-1])
                if proc.returncode == 0 and lines
                else {"failed": proc.returncode, "stderr": proc.stderr[-3000:]}
            )
        print(name, json.dumps(results[name])[:400], flush=True)
        _write(out_json, results, commit)


def _write(out_json: Path, results: dict[str, Any], commit: str | None) -> None:
    write_result(out_json, "pipeline_gpu", results, packages=("diffusers",), torch=True, commit=commit)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("all", "phase", "weights"))
    ap.add_argument("rest", nargs="+")
    ap.add_argument("--phases", default=",".join(("setup", *PATHS)))
    ap.add_argument("--archive-out", type=Path)
    ap.add_argument("--lanes-archive", type=Path, default=RESULTS / LANES_ARCHIVE)
    ap.add_argument(
        "--selector",
        action="store_true",
        help="serve both transformers and the decoder from --lanes-archive's workspace (as committed)",
    )
    ap.add_argument("--lanes", default="", help="TOML lines added to the lanes workspace's lanes table")
    commit_option(ap)
    args = ap.parse_args()
    if args.what == "weights":
        print(json.dumps(weights(Path(args.rest[0]))))
    elif args.what == "phase":
        print(json.dumps(phase(args.rest[0], Path(args.rest[1]))))
    else:
        work, out_json = Path(args.rest[0]), Path(args.rest[1])
        run_all(work, out_json, args.phases.split(","), args)


if __name__ == "__main__":
    main()
