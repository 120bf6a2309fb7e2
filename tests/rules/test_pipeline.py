"""A stock diffusers pipeline served from the store in one call (`adopt_pipeline`): the
transformer and the VAE decoder of a tiny FLUX.2 [klein] pipeline, minted on the CPU as the
pipeline calls them (tests/zoo/zoo_pipelines.py), attached to the pipeline's own modules.

Real parts throughout: a real mint of both modules, the CLI's serving manifest (schema 3), the
stock `Flux2KleinPipeline` with random weights, nothing downloaded."""

from __future__ import annotations

import copy
import io
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from cgbuild_rules.adopt.copies import Unserved
from cgbuild_rules.adopt.refusal import CompiledRequired
from cgbuild_rules.pipeline import AttachError, CopyRefused, adopt_pipeline, warm_inputs
from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModel
from support.cli import cli
from support.pipelines import (
    flux2_klein_inputs,
    flux2_klein_pipeline,
    sdxl_inputs,
    sdxl_pipeline,
    zoo_pipe_config,
)
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

    # A copy has no eager path that computes right either: it refuses, naming the fix
    clone = copy.deepcopy(pipe)
    with pytest.raises(CompiledRequired, match="adopt the copy") as info:
        _run(clone, "latent")
    assert info.value.refusal.code == "copy-not-adopted" and info.value.label == "zoo-pipe/transformer@fp8"
    assert ran == []  # the copied pre-hook appends here too: nothing of the copy ran

    # A transformer of another class put in its place is refused by name, never run eager
    pipe.transformer = _Other(**zoo_pipe_config()["transformer"]).eval()
    pipe.transformer.x_embedder.register_forward_pre_hook(lambda *_: ran.append(1))
    with pytest.raises(CompiledRequired) as info:
        _run(served, "latent")
    assert info.value.refusal.code == "module-replaced" and "is now a _Other" in info.value.refusal.detail
    assert ran == []


class _Other(Flux2Transformer2DModel):  # type: ignore[misc]
    """Another class than the one adopted, computing the same."""


def test_copies_of_a_served_pipeline_run_eager_and_the_original_stays_served(
    served_ws: tuple[Path, dict[str, Any]],
) -> None:
    """deepcopy, a pickle round trip and torch.save of a served pipeline or module: the router and
    its package are not copied; the copy is the plain pipeline (eager, exactly eager's output) and
    the original still serves every call compiled."""
    ws, _ = served_ws
    pipe = flux2_klein_pipeline(seed=5)
    want = _run(pipe, "np")
    served = adopt_pipeline(pipe, ws / "manifest.json", store=Store(ws / ".cgbuild" / "store"))
    saved = io.BytesIO()
    torch.save(pipe, saved)
    saved.seek(0)
    copies = [copy.deepcopy(pipe), pickle.loads(pickle.dumps(pipe)), torch.load(saved, weights_only=False)]
    alone = io.BytesIO()  # a served module on its own
    torch.save(pipe.transformer, alone)
    alone.seek(0)
    copies[0].transformer = copy.deepcopy(pickle.loads(pickle.dumps(torch.load(alone, weights_only=False))))
    for clone in copies:
        assert isinstance(clone.transformer.__dict__["forward"], Unserved)
        assert isinstance(clone.vae.__dict__["decode"], Unserved)
        assert clone.transformer is not pipe.transformer
        assert (_run(clone, "np") == want).all()  # eager, bit for bit
    got = _run(served, "np")
    assert served.counters == {"transformer": {"compiled": 2}, "vae.decode": {"compiled": 1}}
    assert rel_rms(torch.as_tensor(got), torch.as_tensor(want)) < TOLERANCE
    with pytest.raises(CopyRefused, match=r"copy served\.pipe"):
        copy.deepcopy(served)

    # A copy is adopted like any pipeline; released, it is the plain pipeline
    again = adopt_pipeline(copies[1], ws / "manifest.json", store=Store(ws / ".cgbuild" / "store"))
    _run(again, "np")
    assert again.counters == {"transformer": {"compiled": 2}, "vae.decode": {"compiled": 1}}
    again.release()
    assert "forward" not in copies[1].transformer.__dict__ and "decode" not in copies[1].vae.__dict__


def test_a_torch_compiled_module_is_served_as_the_module_it_wraps(
    served_ws: tuple[Path, dict[str, Any]],
) -> None:
    """`pipe.transformer = torch.compile(pipe.transformer)` before adopt (or after): the module
    it wraps is served, the pipeline's attribute set back to it; `release()` puts the wrapper back."""
    ws, _ = served_ws
    pipe = flux2_klein_pipeline(seed=5)
    want = _run(pipe, "latent")
    module = pipe.transformer
    wrapper = torch.compile(module)
    pipe.transformer = wrapper
    served = adopt_pipeline(pipe, ws / "manifest.json", store=Store(ws / ".cgbuild" / "store"))
    assert pipe.transformer is module and served.components["transformer"].adopted.refusals == {}
    got = _run(served, "latent")
    pipe.transformer = torch.compile(pipe.transformer)  # wrapped after adopt: seen through alike
    _run(served, "latent")
    assert pipe.transformer is module
    assert served.counters["transformer"] == {"compiled": 4}
    assert rel_rms(torch.as_tensor(got), torch.as_tensor(want)) < TOLERANCE
    served.release()
    assert isinstance(pipe.transformer, type(wrapper)) and pipe.transformer._orig_mod is module


def test_a_second_adoption_is_refused_and_the_first_keeps_serving(
    served_ws: tuple[Path, dict[str, Any]],
) -> None:
    ws, _ = served_ws
    pipe = flux2_klein_pipeline(seed=5)
    store = Store(ws / ".cgbuild" / "store")
    served = adopt_pipeline(pipe, ws / "manifest.json", store=store)
    _run(served, "np")
    first = served.components["transformer"].adopted
    with pytest.raises(AttachError, match=r"already served \(by zoo-pipe/transformer@fp32.*release\(\)"):
        adopt_pipeline(pipe, ws / "manifest.json", store=store)
    assert pipe.transformer.__dict__["forward"] is first
    _run(served, "np")
    assert served.counters == {"transformer": {"compiled": 4}, "vae.decode": {"compiled": 2}}


def test_a_module_replaced_after_adopt_is_re_armed_or_named(served_ws: tuple[Path, dict[str, Any]]) -> None:
    """`pipe.transformer = other`: the next call sees it. A module of the adopted class that
    matches the artifacts is served compiled (counted `replaced`), and the module replaced runs
    as a plain module again; one of another class is served eager, counted `eager:module-replaced`."""
    ws, _ = served_ws
    pipe = flux2_klein_pipeline(seed=5)
    served = adopt_pipeline(pipe, ws / "manifest.json", store=Store(ws / ".cgbuild" / "store"))
    _run(served, "latent")
    replaced, replaced_router = pipe.transformer, served.components["transformer"].adopted
    eager = flux2_klein_pipeline(seed=5)  # the same pipeline, another transformer's weights
    eager.transformer = flux2_klein_pipeline(seed=6).transformer  # (the old ones' output differs)
    want = _run(eager, "latent")
    pipe.transformer = flux2_klein_pipeline(seed=6).transformer
    got = _run(served, "latent")
    assert served.counters["transformer"] == {"compiled": 4, "replaced": 1}
    assert rel_rms(torch.as_tensor(got), torch.as_tensor(want)) < TOLERANCE
    assert "forward" not in replaced.__dict__  # the package moved: the old module is plain again
    # and its router, called directly, no longer reaches the package (bound to the new weights)
    stale = replaced_router.artifacts[0]
    args, kwargs = warm_inputs(stale.contract, torch.device("cpu"))
    with torch.inference_mode():
        out, plain = replaced_router(*args, **kwargs), replaced(*args, **kwargs)
    assert torch.equal(out[0], plain[0]) and replaced_router.last_reason.code == "module-replaced"

    other = _Other(**zoo_pipe_config()["transformer"]).eval()
    other.load_state_dict(eager.transformer.state_dict())
    pipe.transformer = other
    got = _run(served, "latent")
    assert served.counters["transformer"] == {"compiled": 4, "replaced": 2, "eager:module-replaced": 2}
    assert served.components["transformer"].adopted.last_reason.code == "module-replaced"
    assert rel_rms(torch.as_tensor(got), torch.as_tensor(want)) < TOLERANCE


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
