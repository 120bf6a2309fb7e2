"""A stock diffusers pipeline served from the store in one call (`adopt_pipeline`): the
transformer and the VAE decoder of a tiny FLUX.2 [klein] pipeline, minted on the CPU as the
pipeline calls them (tests/zoo/zoo_pipelines.py), attached to the pipeline's own modules.

Real parts throughout: a real mint of both modules, the CLI's serving manifest (schema 3), the
stock `Flux2KleinPipeline` with random weights, nothing downloaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from cgbuild_rules.adopt.refusal import CompiledRequired
from cgbuild_rules.pipeline import AttachError, adopt_pipeline
from support.cli import cli
from support.pipelines import flux2_klein_inputs, flux2_klein_pipeline, sdxl_inputs, sdxl_pipeline
from support.zoo import minted, rel_rms

from cgbuild.protocol.manifest import SCHEMA, read_modules
from cgbuild.store.local import Store

pytestmark = pytest.mark.slow

LABELS = {
    "transformer": "//zoo-pipe/transformer/64x64-t8-b1@fp32:cpu",
    "vae.decode": "//zoo-pipe/vae.decode/64x64-b1@fp32:cpu",
}
TOLERANCE = 1e-4  # fp32, compiled against eager: both modules verify at this at mint


@pytest.fixture(scope="module")
def served_ws(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    ws, _ = minted(tmp_path_factory, "zoo-pipe", LABELS)
    proc = cli(ws, "manifest", "//zoo-pipe", "-o", str(ws / "manifest.json"))
    assert proc.returncode == 0, proc.stderr
    return ws, json.loads((ws / "manifest.json").read_text())


def _run(pipe: Any, output_type: str, inputs: dict[str, Any] | None = None, guidance: float = 1.0) -> Any:
    """Two steps at 64x64 (a distilled klein's prompt alone by default), the images as `output_type`."""
    if inputs is None:
        inputs = {"prompt_embeds": flux2_klein_inputs(pipe)["prompt_embeds"]}
    with torch.inference_mode():
        return pipe(
            **inputs,
            height=64,
            width=64,
            num_inference_steps=2,
            guidance_scale=guidance,
            output_type=output_type,
            generator=torch.Generator().manual_seed(3),
        ).images


def test_the_manifest_says_where_each_module_attaches(served_ws: tuple[Path, dict[str, Any]]) -> None:
    _, doc = served_ws
    assert doc["schema"] == SCHEMA
    modules = read_modules(doc)
    assert {name: m.serves for name, m in modules.items()} == {
        "transformer": "transformer",
        "vae.decode": "vae.decode",
    }
    (entry,) = modules["transformer"].entries
    assert entry.envelope == {"shape": "64x64", "text_len": 8, "batch": 1, "guidance": []}
    assert entry.compiled_only is False  # fp32: a plain layout falls back eager, named


def test_every_denoiser_call_and_the_decode_run_compiled_and_match_eager(
    served_ws: tuple[Path, dict[str, Any]],
) -> None:
    ws, _ = served_ws
    pipe = flux2_klein_pipeline(seed=5)  # weights of its own: bound, never the mint's
    want = {kind: _run(pipe, kind) for kind in ("latent", "np")}
    served = adopt_pipeline(pipe, ws / "manifest.json", store=Store(ws / ".cgbuild" / "store"))
    assert served.warmup()["not_compiled"] == {}
    got = {kind: _run(served, kind) for kind in ("latent", "np")}
    counters = served.counters
    # 2 steps a run, two runs, plus the warm-up's one call each; the decode only for "np"
    assert counters["transformer"] == {"compiled": 5}  # traced with the pipeline's strides: no copy
    assert counters["vae.decode"] == {"compiled": 2}
    assert rel_rms(torch.as_tensor(got["latent"]), torch.as_tensor(want["latent"])) < TOLERANCE
    assert rel_rms(torch.as_tensor(got["np"]), torch.as_tensor(want["np"])) < TOLERANCE
    # the pipeline kept its own modules: attributes it reads are theirs
    assert (
        type(pipe.transformer).__name__ == "Flux2Transformer2DModel" and pipe.vae.config.latent_channels == 2
    )
    served.release()
    _run(pipe, "latent")
    assert served.counters == {}  # released: the pipeline calls its own modules again
    assert "forward" not in pipe.transformer.__dict__ and "decode" not in pipe.vae.__dict__


def test_a_moved_pipeline_is_served_eager_by_name(served_ws: tuple[Path, dict[str, Any]]) -> None:
    """`pipe.to(dtype)` moves every weight: the artifacts no longer hold what the modules do, so
    each call is eager and says why; a plain layout never stops the pipeline."""
    ws, _ = served_ws
    pipe = flux2_klein_pipeline(seed=5)
    served = adopt_pipeline(pipe, ws / "manifest.json", store=Store(ws / ".cgbuild" / "store"))
    pipe.to(torch.float64)
    with torch.inference_mode():
        pipe(
            prompt_embeds=flux2_klein_inputs(pipe)["prompt_embeds"].double(),
            height=64,
            width=64,
            num_inference_steps=1,
            guidance_scale=1.0,
            output_type="latent",
        )
    (reason,) = served.counters["transformer"]
    assert reason.startswith("eager:") and served.components["transformer"].adopted.last_reason is not None


def test_a_pipeline_offloaded_to_the_cpu_is_served_compiled(served_ws: tuple[Path, dict[str, Any]]) -> None:
    """`enable_model_cpu_offload` wraps every module's forward in accelerate's hooks, which move
    its weights to the execution device before each call: the served modules follow (re-bound,
    counted) and every call still runs compiled, the image unchanged."""
    ws, _ = served_ws
    pipe = flux2_klein_pipeline(seed=5)
    want = _run(pipe, "np")
    served = adopt_pipeline(pipe, ws / "manifest.json", store=Store(ws / ".cgbuild" / "store"))
    pipe.enable_model_cpu_offload(device="cpu")
    got = _run(served, "np")
    counters = served.counters
    assert counters["transformer"]["compiled"] == 2 and counters["vae.decode"]["compiled"] == 1, counters
    assert not [k for c in counters.values() for k in c if k.startswith("eager")], counters
    assert rel_rms(torch.as_tensor(got), torch.as_tensor(want)) < TOLERANCE
    served.release()


def test_a_compiled_only_module_raises_instead_of_running_eager(
    served_ws: tuple[Path, dict[str, Any]],
) -> None:
    """A layout whose rule quantizes activations has no eager path: a call no artifact serves
    (here, an sm_90 fp8 entry on a CPU host) raises CompiledRequired before the module runs."""
    ws, doc = served_ws
    fp8 = json.loads(json.dumps(doc))
    for row in fp8["modules"]["transformer"]["entries"]:
        row.update(layout="fp8", sm="sm_90", compiled_only=True)
    pipe = flux2_klein_pipeline(seed=5)
    ran: list[int] = []
    pipe.transformer.x_embedder.register_forward_pre_hook(lambda *_: ran.append(1))  # its first layer
    served = adopt_pipeline(pipe, fp8, store=Store(ws / ".cgbuild" / "store"))
    with pytest.raises(CompiledRequired) as info:
        _run(served, "latent")
    err = info.value
    assert err.retryable and err.refusal.code == "wrong-sm" and err.label == "zoo-pipe/transformer@fp8"
    assert ran == []  # not even its first layer ran
    assert served.counters["transformer"] == {"refused:wrong-sm": 1}


def test_a_manifest_of_another_pipeline_is_the_callers_mistake(
    served_ws: tuple[Path, dict[str, Any]],
) -> None:
    ws, doc = served_ws
    other = json.loads(json.dumps(doc))
    other["modules"]["vae.decode"]["serves"] = "vae.decode_video"
    pipe = flux2_klein_pipeline(seed=5)
    with pytest.raises(AttachError, match="has no 'decode_video'"):
        adopt_pipeline(pipe, other, store=Store(ws / ".cgbuild" / "store"))
    # nothing stays attached after the refusal
    assert "forward" not in pipe.transformer.__dict__ and "decode" not in pipe.vae.__dict__


SDXL = {
    "unet": "//zoo-sdxl/unet/64x64-t8-b2@fp32:cpu",
    "vae.decode": "//zoo-sdxl/vae.decode/64x64-b1@fp32:cpu",
}


def test_an_sdxl_pipeline_under_guidance_is_served_compiled(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The UNet at batch 2 (classifier-free guidance), its size conditioning a dict of tensors,
    its timestep a 0-dim tensor by position; the decode of the SDXL VAE."""
    ws, _ = minted(tmp_path_factory, "zoo-sdxl", SDXL)
    assert cli(ws, "manifest", "//zoo-sdxl", "-o", str(ws / "manifest.json")).returncode == 0
    pipe = sdxl_pipeline(seed=5)

    want = {kind: _run(pipe, kind, sdxl_inputs(), 5.0) for kind in ("latent", "np")}
    served = adopt_pipeline(pipe, ws / "manifest.json", store=Store(ws / ".cgbuild" / "store"))
    assert served.warmup()["not_compiled"] == {}
    got = {kind: _run(served, kind, sdxl_inputs(), 5.0) for kind in ("latent", "np")}
    counters = served.counters
    assert counters["unet"]["compiled"] == 5 and counters["vae.decode"] == {"compiled": 2}
    assert not [k for c in counters.values() for k in c if k.startswith("eager")]
    # the pipeline expands its guidance inputs (the timestep, the size conditioning) as views: copied
    # into the traced layout, counted, never read as laid out otherwise
    assert set(counters["unet"]) <= {"compiled", "restrided"}
    for kind in ("latent", "np"):
        assert rel_rms(torch.as_tensor(got[kind]), torch.as_tensor(want[kind])) < TOLERANCE

    # An fp16 VAE with `force_upcast` (SDXL's own): the pipeline casts it to fp32 for the decode
    # and back after. The decode follows the weights each time (re-bound) and stays compiled.
    for p in (pipe, eager := sdxl_pipeline(seed=5)):
        p.vae.to(torch.float16)
    want_up = _run(eager, "np", sdxl_inputs(), 5.0)
    before = dict(served.counters["vae.decode"])
    got_up = _run(served, "np", sdxl_inputs(), 5.0)
    after = served.counters["vae.decode"]
    assert after["compiled"] == before["compiled"] + 1 and after.get("rebound", 0) > before.get("rebound", 0)
    assert pipe.vae.dtype == torch.float16  # cast back by the pipeline
    assert rel_rms(torch.as_tensor(got_up), torch.as_tensor(want_up)) < TOLERANCE
