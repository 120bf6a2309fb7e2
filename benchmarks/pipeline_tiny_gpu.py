"""The tiny FLUX.2 [klein] pipeline of the serving zoo, served from the store on a GPU.

Mints the zoo's `zoo-pipe` family (its transformer and VAE decoder, traced as the pipeline calls
them) for this machine's sm, writes the serving manifest, arms a stock `Flux2KleinPipeline` with
`adopt_pipeline` and reports: how each component's calls were served (every one compiled, or the
reasons), the image's error against the eager pipeline, the warm-up, and the steady per-image
latency of both (CUDA-event medians, side by side in one process). A tiny model: the numbers say
that the path works on the card and what it costs per call, not what a klein-4B image costs.

    python benchmarks/pipeline_tiny_gpu.py --out benchmarks/results/pipeline_tiny_gpu.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from harness import cgbuild, commit_option, cuda_timed, scratch, write_result

ROOT = Path(__file__).resolve().parents[1]
ZOO = ROOT / "tests" / "zoo"
sys.path.insert(0, str(ROOT / "tests"))  # the zoo pipeline's builder, shared with its CPU test


def _workspace(ws: Path, sm: str) -> None:
    """The zoo copied, its `zoo-pipe` family declared for one SKU of this machine's sm."""
    shutil.copytree(ZOO, ws, ignore=shutil.ignore_patterns(".cgbuild", "__pycache__"))
    text = (ws / "Cgfile").read_text()
    head, family = text.split("[family.zoo-pipe]\n", 1)
    body, rest = family.split("\n[family.", 1) if "\n[family." in family else (family, "")
    body = body.replace('skus = ["cpu"]', 'skus = ["card"]', 1)
    head = head.replace("[sku.cpu]", f'[sku.card]\nsm = "{sm}"\nmemory_gib = 80\n\n[sku.cpu]', 1)
    (ws / "Cgfile").write_text(head + "[family.zoo-pipe]\n" + body + ("\n[family." + rest if rest else ""))


def measure(ws: Path, steps: int, reps: int) -> dict[str, Any]:
    import torch
    from cgbuild_rules.adopt.host import device_sm
    from cgbuild_rules.pipeline import adopt_pipeline
    from support.pipelines import flux2_klein_inputs, flux2_klein_pipeline

    from cgbuild.store.local import Store

    sm = device_sm(torch.device("cuda"))
    _workspace(ws, sm)
    t = time.perf_counter()
    mint = cgbuild(ws, "mint", f"//zoo-pipe:{sm}", "--json", check=False)
    minted = json.loads(mint.stdout.strip().splitlines()[-1])
    mint_s = time.perf_counter() - t
    # a component whose mint failed is left out of the manifest: the pipeline calls it eager
    fresh = sorted({label.split("/")[3] for m in minted["minted"] for label in m["labels"]})
    if not fresh:
        raise SystemExit(f"nothing minted: {minted['failed']}")
    selector = f"//zoo-pipe/{fresh[0]}:{sm}" if len(fresh) == 1 else f"//zoo-pipe:{sm}"
    cgbuild(ws, "manifest", selector, "-o", str(ws / "manifest.json"))
    pipe = flux2_klein_pipeline(seed=5).to("cuda")
    embeds = flux2_klein_inputs(pipe)["prompt_embeds"].cuda()

    def image(target: Any) -> torch.Tensor:
        with torch.inference_mode():
            out = target(
                prompt_embeds=embeds,
                height=64,
                width=64,
                num_inference_steps=steps,
                guidance_scale=1.0,
                output_type="pt",
                generator=torch.Generator("cuda").manual_seed(3),
            ).images
        return torch.as_tensor(out)

    want = image(pipe)
    eager_s = cuda_timed(lambda: image(pipe), reps=reps, warmup=2)
    t = time.perf_counter()
    served = adopt_pipeline(pipe, ws / "manifest.json", store=Store(ws / ".cgbuild" / "store"))
    arm_s = time.perf_counter() - t
    warm = served.warmup()
    got = image(served)
    served_s = cuda_timed(lambda: image(served), reps=reps, warmup=2)
    error = float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())
    return {
        "sm": sm,
        "steps": steps,
        "reps": reps,
        "mint": {"seconds": round(mint_s, 1), "minted": len(minted["minted"]), "failed": minted["failed"]},
        "arm_s": round(arm_s, 3),
        "warmup": warm,
        "counters": served.counters,
        "image_rel_rms_vs_eager": error,
        "image_ms": {"eager": round(eager_s * 1e3, 3), "served": round(served_s * 1e3, 3)},
        "served_over_eager": round(served_s / eager_s, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "pipeline_tiny_gpu.json"
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--reps", type=int, default=10)
    commit_option(parser)
    args = parser.parse_args()
    with scratch("cgbuild-pipeline-") as tmp:
        numbers = measure(tmp / "ws", args.steps, args.reps)
    doc = write_result(
        args.out, "pipeline_tiny_gpu", numbers, packages=("diffusers",), torch=True, commit=args.commit
    )
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
