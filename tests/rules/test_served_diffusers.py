"""Diffusion transformers served as the diffusers pipelines call them: compiled and right, or
refused by name and served eager, never compiled and wrong.

Each test is a call that once came back compiled and off from eager (the SD3 pipeline's
stride-0 `timestep`, a transposed or sliced Wan text embedding, a module built with another
`eps` or head split than the artifact's): the layout guard (`fit`, which copies an input into
its traced layout) or the configuration guard (`config-drift`, at adopt, and the per-call watch)
must catch it. Each also checks that the case matters: the package reading the input as traced
without the copy, or the artifact's own configuration, computes something else than eager.

Mints `//zoo-dit:cpu` (a tiny `SD3Transformer2DModel` and `WanTransformer3DModel`, two compiles).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from cgbuild_rules.adopt import adopt
from cgbuild_rules.adopt.contract import fit
from diffusers import SD3Transformer2DModel, WanTransformer3DModel
from support.zoo import artifact, minted, rel_rms, served_module

from cgbuild.protocol.contract import CallContract
from cgbuild.store.seal import read_metadata

pytestmark = pytest.mark.slow
SD3 = "//zoo-dit/sd3/8x8-t4-b2@fp32:cpu"
WAN = "//zoo-dit/wan/8x8-t4-b1@fp32:cpu"


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The diffusion-transformer zoo minted: two compiles."""
    return minted(tmp_path_factory, "zoo-dit", {"sd3": SD3, "wan": WAN})[0]


def tolerance(path: Path) -> float:
    return float(read_metadata(path)["verify"]["tolerance"]["float32"])


def output(module: Callable[..., Any], kwargs: dict[str, Any]) -> torch.Tensor:
    """The sample a pipeline reads: `transformer(..., return_dict=False)[0]`."""
    with torch.no_grad():
        (sample,) = module(**kwargs)
    return sample


def as_traced_unchecked(x: torch.Tensor) -> torch.Tensor:
    """What a package reads for `x` when handed it as is: its storage, from its offset, with the
    contiguous strides it was traced with."""
    stride, step = [], 1
    for size in reversed(x.shape):
        stride.insert(0, step)
        step *= size
    return x.as_strided(x.shape, stride)


def sd3_timestep(kwargs: dict[str, Any]) -> torch.Tensor:
    """The SD3 pipeline's step: `t` is a 0-d view into the scheduler's `timesteps`, and the
    transformer gets `t.expand(latent_model_input.shape[0])` (stride 0)."""
    timesteps = torch.tensor([1000.0, 750.0, 500.0])
    return timesteps[1].expand(kwargs["timestep"].shape[0])


def wan_transposed(kwargs: dict[str, Any]) -> torch.Tensor:
    e = kwargs["encoder_hidden_states"]
    return e.transpose(1, 2).contiguous().transpose(1, 2)


def wan_sliced(kwargs: dict[str, Any]) -> torch.Tensor:
    e = kwargs["encoder_hidden_states"]
    return torch.cat([e, torch.randn_like(e)], dim=-1)[..., : e.shape[-1]]


@pytest.mark.parametrize(
    ("label", "name", "view"),
    [
        pytest.param(SD3, "timestep", sd3_timestep, id="sd3-timestep-expanded"),
        pytest.param(
            SD3,
            "hidden_states",
            lambda kw: kw["hidden_states"].contiguous(memory_format=torch.channels_last),
            id="sd3-hidden-states-channels-last",
        ),
        pytest.param(WAN, "encoder_hidden_states", wan_transposed, id="wan-text-transposed"),
        pytest.param(WAN, "encoder_hidden_states", wan_sliced, id="wan-text-feature-slice"),
    ],
)
def test_an_input_laid_out_as_a_pipeline_hands_it_is_served_on_a_copy(
    ws: Path, label: str, name: str, view: Callable[[dict[str, Any]], torch.Tensor]
) -> None:
    path = artifact(ws, label)
    m, _, kwargs = served_module(ws, label)
    served = adopt(path, m, strict=True)
    x = view(kwargs)
    assert not x.is_contiguous()
    call = {**kwargs, name: x}
    want = output(m, call)
    misread = output(m, {**kwargs, name: as_traced_unchecked(x)})
    assert rel_rms(misread, want) > 10 * tolerance(path), "read as traced, this layout is another input"
    assert rel_rms(output(served, call), want) < tolerance(path)
    assert served.counters == {"compiled": 1, "restrided": 1}
    assert rel_rms(output(served, {**kwargs, name: x.contiguous()}), want) < tolerance(path)
    assert served.counters == {"compiled": 2, "restrided": 1}  # the traced layout is not copied


def test_a_batch_of_one_expanded_timestep_is_copied_only_for_alignment(ws: Path) -> None:
    """Wan's pipeline passes `t.expand(1)`: stride 0 on a dimension of one is the traced layout,
    so the first step is served as is; a later step starts 4 bytes into `timesteps`, off the
    alignment compiled kernels may assume, and is copied."""
    path = artifact(ws, WAN)
    m, _, kwargs = served_module(ws, WAN)
    served = adopt(path, m, strict=True)
    timesteps = torch.tensor([1000.0, 500.0])
    assert timesteps.data_ptr() % 16 == 0
    for step, counters in enumerate([{"compiled": 1}, {"compiled": 2, "restrided": 1}]):
        call = {**kwargs, "timestep": timesteps[step].expand(1)}
        assert rel_rms(output(served, call), output(m, call)) < tolerance(path)
        assert served.counters == counters


def test_an_artifact_traced_on_a_broadcast_timestep_refuses_what_it_cannot_read(ws: Path) -> None:
    """An artifact sealed before the trace refused broadcast inputs may have traced SD3's
    `t.expand(B)` as the pipeline passes it (stride 0): its package reads one timestep for the
    whole batch. Only a call passing that broadcast, aligned, is read as traced; any other call
    cannot be copied into a stride-0 layout (the copy raised from the router once, at the
    pipeline's second step) and is refused `stride`, so it is served eager."""
    contract = json.loads(json.dumps(read_metadata(artifact(ws, SD3))["graph"]["contract"]))
    _, _, kwargs = served_module(ws, SD3)
    (spec,) = [i for i in contract["inputs"] if i["name"] == "timestep"]
    spec["leaves"][0]["stride"] = [0]  # as the stock pipeline's expanded timestep traces
    timesteps = torch.tensor([1000.0, 750.0, 500.0])
    assert timesteps.data_ptr() % 16 == 0
    first = timesteps[0].expand(kwargs["timestep"].shape[0])
    traced = CallContract.from_json(contract)
    why, leaves = fit(traced, (), {**kwargs, "timestep": first})
    assert why is None and any(leaf is first for leaf in leaves)  # read as traced: no copy
    for call in (sd3_timestep(kwargs), kwargs["timestep"]):  # the second step; distinct values
        why, _ = fit(traced, (), {**kwargs, "timestep": call})
        assert why is not None and why.code == "stride", why
        assert why.detail.startswith("timestep: cannot lay out [2] with traced strides [0] (overlapping")


def rebuilt(module: torch.nn.Module, cls: type[torch.nn.Module], **changes: Any) -> torch.nn.Module:
    """`module`'s class built with `changes` to its config (same tensor shapes), its weights loaded."""
    live = cls.from_config({**module.config, **changes}).eval()  # type: ignore[attr-defined]
    live.load_state_dict(module.state_dict(), strict=True)
    return live


@pytest.mark.parametrize(
    ("label", "cls", "changes", "detail"),
    [
        pytest.param(
            WAN, WanTransformer3DModel, {"eps": 1e-1}, "config eps 1e-06 → 0.1", id="wan-eps-1e-6-to-1e-1"
        ),
        pytest.param(
            SD3,
            SD3Transformer2DModel,
            {"num_attention_heads": 4, "attention_head_dim": 8},
            "config attention_head_dim 16 → 8",
            id="sd3-heads-2x16-to-4x8",
        ),
    ],
)
def test_a_module_configured_otherwise_than_the_artifact_is_refused_by_name(
    ws: Path, label: str, cls: type[torch.nn.Module], changes: dict[str, Any], detail: str
) -> None:
    """Every tensor keeps its shape, so only the configuration record tells the artifact (minted
    with the old value) from this module: `config-drift` at adopt and at every re-bind."""
    path = artifact(ws, label)
    original, _, kwargs = served_module(ws, label)
    live = rebuilt(original, cls, **changes)
    want = output(live, kwargs)
    assert rel_rms(output(original, kwargs), want) > 10 * tolerance(path)
    served = adopt(path, live)
    (refusal,) = served.refusals.values()
    assert refusal.code == "config-drift" and refusal.detail == detail
    torch.testing.assert_close(output(served, kwargs), want, rtol=0, atol=0)
    served.rebind()
    (refusal,) = served.refusals.values()
    assert refusal.code == "config-drift"
    torch.testing.assert_close(output(served, kwargs), want, rtol=0, atol=0)
    assert served.counters == {"eager:config-drift": 2}


def wan_norm_eps(m: torch.nn.Module) -> tuple[torch.nn.Module, str, Any]:
    return m.blocks[0].norm1, "eps", 1e-1  # type: ignore[index]


def sd3_heads(m: torch.nn.Module) -> tuple[torch.nn.Module, str, Any]:
    return m.transformer_blocks[0].attn, "heads", 4  # type: ignore[index]


@pytest.mark.parametrize(
    ("label", "where"),
    [pytest.param(WAN, wan_norm_eps, id="wan-norm1-eps"), pytest.param(SD3, sd3_heads, id="sd3-attn-heads")],
)
def test_a_hyperparameter_set_after_adopt_is_refused_until_restored(
    ws: Path, label: str, where: Callable[[torch.nn.Module], tuple[torch.nn.Module, str, Any]]
) -> None:
    """The same drift on a live submodule after adopt: the per-call watch sees the attribute move,
    the re-bind refuses it by name, and restoring it re-arms the artifact."""
    path = artifact(ws, label)
    m, _, kwargs = served_module(ws, label)
    served = adopt(path, m)
    owner, name, value = where(m)
    before = getattr(owner, name)
    setattr(owner, name, value)
    want = output(m, kwargs)
    torch.testing.assert_close(output(served, kwargs), want, rtol=0, atol=0)
    assert served.last_reason is not None and served.last_reason.code == "module-changed"
    assert f".{name} changed from {before!r} to {value!r}" in served.last_reason.detail
    assert "config-drift" in served.last_reason.detail
    setattr(owner, name, before)
    restored = output(m, kwargs)
    assert rel_rms(restored, want) > 10 * tolerance(path)
    assert rel_rms(output(served, kwargs), restored) < tolerance(path)
    assert served.counters == {"eager:module-changed": 1, "rebound": 1, "compiled": 1}
