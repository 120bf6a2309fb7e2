"""A stock `Flux2KleinPipeline` served from artifacts an entry traced in ANOTHER convention than
the pipeline's call: the FLUX.2 example's transformer (positions, ids of shape (N, 4), a tensor
back) against the pipeline's keywords, (B, N, 4) ids and `return_dict=False`. The entry's `CALLS`
adapter, carried by the manifest, is what routes it; without it every call is served eager.

Real parts: the example workspace's tiny family minted on the CPU, the CLI's manifest, the stock
pipeline with random weights of its own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from cgbuild_rules.pipeline import adopt_pipeline
from support.cli import cli
from support.pipelines import flux2_klein_inputs, flux2_klein_pipeline
from support.zoo import rel_rms

from cgbuild.config import cgfile
from cgbuild.config.calls import CallAdapter
from cgbuild.core.errors import UserError
from cgbuild.store.local import Store

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flux2_klein"
LABEL = "//flux2-klein-tiny/transformer/64x64-t8-b1@fp32:cpu"
TOLERANCE = 1e-4  # fp32 compiled against eager, as the mint verifies it
FLUX2 = "diffusers.models.transformers.transformer_flux2"


@pytest.fixture(scope="module")
def served_ws(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    ws = tmp_path_factory.mktemp("klein-calls") / "ws"
    shutil.copytree(EXAMPLE, ws, ignore=shutil.ignore_patterns(".cgbuild", "__pycache__"))
    # as the klein lanes on sm_90: the entry's processors, routed through a lane switch, traced
    # in the stock processors' place, with the configuration record on
    with (ws / "Cgfile").open("a") as f:
        f.write('\n[family.flux2-klein-tiny.lanes]\nattention = ["flash", "math"]\n')
    proc = cli(ws, "mint", LABEL, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    proc = cli(ws, "manifest", LABEL, "-o", str(ws / "manifest.json"))
    assert proc.returncode == 0, proc.stderr
    return ws, json.loads((ws / "manifest.json").read_text())


def _image(pipe: Any) -> torch.Tensor:
    embeds = flux2_klein_inputs(pipe)["prompt_embeds"]
    with torch.inference_mode():
        out = pipe(
            prompt_embeds=embeds,
            height=64,
            width=64,
            num_inference_steps=2,
            output_type="latent",
            generator=torch.Generator().manual_seed(3),
        ).images
    assert isinstance(out, torch.Tensor)
    return out


def test_the_manifest_carries_the_entrys_adapter(served_ws: tuple[Path, dict[str, Any]]) -> None:
    _, doc = served_ws
    assert doc["modules"]["transformer"]["call"] == {
        "passes": {"return_dict": False},
        "first_row": ["img_ids", "txt_ids"],
        "returns": "tuple",
        "traced_class": "flux2_entry.Flux2KleinTransformer",
        "substitutes": {
            "flux2_entry.JointAttnProcessor": f"{FLUX2}.Flux2AttnProcessor",
            "flux2_entry.ParallelAttnProcessor": f"{FLUX2}.Flux2ParallelSelfAttnProcessor",
        },
    }


def test_the_adapter_serves_every_denoiser_call_compiled(served_ws: tuple[Path, dict[str, Any]]) -> None:
    ws, _ = served_ws
    pipe = flux2_klein_pipeline(seed=5)  # the tiny family's transformer config, weights of its own
    want = _image(pipe)
    served = adopt_pipeline(pipe, ws / "manifest.json", store=Store(ws / ".cgbuild" / "store"))
    got = _image(served)
    # The entry traces `hidden_states` as the pipeline packs it (a transposed view): no call is
    # copied into another layout (`restrided`), none is served eager.
    assert served.counters["transformer"] == {"compiled": 2}, served.counters
    assert rel_rms(got, want) < TOLERANCE
    served.release()


def test_without_the_adapter_the_same_calls_run_eager_named(served_ws: tuple[Path, dict[str, Any]]) -> None:
    ws, doc = served_ws
    bare = json.loads(json.dumps(doc))
    del bare["modules"]["transformer"]["call"]
    pipe = flux2_klein_pipeline(seed=5)
    served = adopt_pipeline(pipe, bare, store=Store(ws / ".cgbuild" / "store"))
    _image(served)
    counters = served.counters["transformer"]
    assert counters.get("compiled", 0) == 0 and sum(counters.values()) == 2, counters
    served.release()


def _drifted_without(served_ws: tuple[Path, dict[str, Any]], field: str) -> Any:
    """A stock pipeline served by the manifest less one field of its adapter: every call eager,
    `config-drift`; the reason it last gave."""
    ws, doc = served_ws
    bare = json.loads(json.dumps(doc))
    del bare["modules"]["transformer"]["call"][field]
    served = adopt_pipeline(flux2_klein_pipeline(seed=5), bare, store=Store(ws / ".cgbuild" / "store"))
    _image(served)
    assert served.counters["transformer"] == {"eager:config-drift": 2}
    why = served.components["transformer"].adopted.last_reason
    served.release()
    return why


def test_the_traced_class_is_what_lets_the_pipelines_own_class_serve(
    served_ws: tuple[Path, dict[str, Any]],
) -> None:
    """The program's root is the entry's subclass: only the adapter's word lets the stock class in."""
    _drifted_without(served_ws, "traced_class")


def test_the_declared_substitutes_are_what_let_the_stock_processors_serve(
    served_ws: tuple[Path, dict[str, Any]],
) -> None:
    """The program was traced with the entry's processors: the stock one serves in their slot only
    because the adapter says they stand for it, and a processor of any other class is refused."""
    ws, _ = served_ws
    why = _drifted_without(served_ws, "substitutes")
    assert (
        why is not None
        and f"processor flux2_entry.JointAttnProcessor → {FLUX2}.Flux2AttnProcessor" in why.detail
    )
    pipe = flux2_klein_pipeline(seed=5)
    from diffusers.models.transformers.transformer_flux2 import Flux2AttnProcessor

    class Another(Flux2AttnProcessor):  # neither the entry's class nor the stock one it stands for
        pass

    pipe.transformer.transformer_blocks[0].attn.processor = Another()
    served = adopt_pipeline(pipe, ws / "manifest.json", store=Store(ws / ".cgbuild" / "store"))
    _image(served)
    assert served.counters["transformer"] == {"eager:config-drift": 2}
    served.release()


def test_a_value_the_adapter_does_not_serve_runs_eager(served_ws: tuple[Path, dict[str, Any]]) -> None:
    """`return_dict=True` asks for an output object the program does not make: eager, named."""
    ws, _ = served_ws
    pipe = flux2_klein_pipeline(seed=5)
    served = adopt_pipeline(pipe, ws / "manifest.json", store=Store(ws / ".cgbuild" / "store"))
    calls: list[dict[str, Any]] = []
    handle = pipe.transformer.register_forward_pre_hook(
        lambda _m, _a, kw: calls.append(dict(kw)), with_kwargs=True
    )
    _image(served)
    handle.remove()
    call = {**calls[0], "return_dict": True}
    with torch.inference_mode():
        out = pipe.transformer(**call)
    assert not isinstance(out, tuple)  # the module's own output object
    counters = served.counters["transformer"]
    assert counters["compiled"] == 2 and counters["eager:call-structure"] == 1, counters
    served.release()


def test_a_bad_calls_table_is_refused_with_its_file_and_line(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    shutil.copytree(EXAMPLE, ws, ignore=shutil.ignore_patterns(".cgbuild", "__pycache__"))
    entry = ws / "flux2_entry.py"
    source = entry.read_text()
    line = source.splitlines().index("CALLS = {") + 1
    entry.write_text(source.replace('"returns": "tuple"', '"returns": "dict"'))
    with pytest.raises(UserError) as caught:
        cgfile.load(ws / "Cgfile")
    assert (caught.value.file or "").endswith("flux2_entry.py")
    assert caught.value.line == line and "returns" in str(caught.value)


def test_the_adapter_is_outside_every_key(tmp_path: Path) -> None:
    """Dropping the adapter changes how calls reach the program, never the program: one key."""
    keys = []
    for drop in (False, True):
        ws = tmp_path / f"ws{int(drop)}"
        shutil.copytree(EXAMPLE, ws, ignore=shutil.ignore_patterns(".cgbuild", "__pycache__"))
        if drop:
            entry = ws / "flux2_entry.py"
            source = entry.read_text()
            start = source.index("CALLS = {")
            end = source.index("\n}\n", start) + 3
            entry.write_text(source[:start] + source[end:])
            assert cgfile.load(ws / "Cgfile").families["flux2-klein-tiny"].calls == {}
        else:
            calls = cgfile.load(ws / "Cgfile").families["flux2-klein-tiny"].calls
            assert isinstance(calls["transformer"], CallAdapter)
        plan = json.loads(cli(ws, "plan", LABEL, "--json").stdout)
        keys.append(plan["targets"][0]["key"])
    assert keys[0] == keys[1]


def test_a_model_stored_in_another_dtype_reports_the_dtype_its_program_computes_in(
    served_ws: tuple[Path, dict[str, Any]],
) -> None:
    """The pipeline casts the denoiser's input to `transformer.dtype`; with weights stored in
    float8 diffusers would say float8 and every call would reach the program in it."""
    ws, _ = served_ws
    pipe = flux2_klein_pipeline(seed=5)
    first, _ = next(iter(pipe.transformer.named_parameters()))  # where diffusers reads its dtype
    owner, _, attr = first.rpartition(".")
    embedder = pipe.transformer.get_submodule(owner)
    stored = getattr(embedder, attr).data.to(torch.float8_e4m3fn)
    setattr(embedder, attr, torch.nn.Parameter(stored, requires_grad=False))
    assert pipe.transformer.dtype == torch.float8_e4m3fn
    served = adopt_pipeline(pipe, ws / "manifest.json", store=Store(ws / ".cgbuild" / "store"))
    assert pipe.transformer.dtype == torch.float32  # the contract's: what the program computes in
    served.release()
    assert pipe.transformer.dtype == torch.float8_e4m3fn and not hasattr(embedder, "_diffusers_hook")


def test_a_model_whose_weights_say_its_dtype_is_left_as_it_is(served_ws: tuple[Path, dict[str, Any]]) -> None:
    ws, _ = served_ws
    pipe = flux2_klein_pipeline(seed=5)
    served = adopt_pipeline(pipe, ws / "manifest.json", store=Store(ws / ".cgbuild" / "store"))
    assert not any(hasattr(m, "_diffusers_hook") for m in pipe.transformer.modules())
    served.release()


def test_the_reported_dtype_is_in_place_before_the_artifacts_bind(
    served_ws: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hook wraps a submodule's forward: artifacts bound before it would see the module changed
    and serve nothing compiled. Here the model is said to report float8 (an fp8 layout's case,
    which needs a GPU to serve) while it holds the fp32 weights the artifact binds: the hook goes
    on, and every call is still served compiled."""
    import cgbuild_rules.pipeline as pipeline_api

    monkeypatch.setattr(pipeline_api, "_reported_dtype", lambda module: torch.float8_e4m3fn)
    ws, _ = served_ws
    pipe = flux2_klein_pipeline(seed=5)
    want = _image(pipe)
    served = adopt_pipeline(pipe, ws / "manifest.json", store=Store(ws / ".cgbuild" / "store"))
    assert [m for m in pipe.transformer.modules() if _casting(m)]
    got = _image(served)
    counters = served.counters["transformer"]
    assert counters.get("compiled") == 2 and not [k for k in counters if k.startswith("eager")], counters
    assert rel_rms(got, want) < TOLERANCE
    served.release()
    assert not [m for m in pipe.transformer.modules() if _casting(m)]  # a pipeline call adds a bare registry


def _casting(module: torch.nn.Module) -> bool:
    registry = module.__dict__.get("_diffusers_hook")
    return registry is not None and registry.get_hook("layerwise_casting") is not None
