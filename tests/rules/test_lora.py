"""LoRA on a served SD3 transformer, the way diffusers users load, fuse, swap and drop adapters.

A package reads the tensors it was bound to: an unfused adapter (PEFT layers injected, the
weights moved to `*.base_layer.*`), a fuse that swaps storages (`safe_fusing=True`), an unfuse
with the adapter still active, or a new `nn.Parameter` once came back compiled with the base
model's (or the old) weights. Each test makes such a change and asserts that every call is either
compiled and within the artifact's verify tolerance of eager, or refused by name and served eager
(equal to eager), with the exact counters; and that the change moves eager by more than the
tolerance, so a compiled answer from the old binding would fail it.

Adapters are made here with peft itself (`add_adapter` on a copy, random nonzero `lora_B`) and
loaded through diffusers' own calls. Mints `//zoo-dit/sd3:cpu` (one compile).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from cgbuild_rules.adopt import Adopted, adopt
from diffusers import SD3Transformer2DModel
from peft import LoraConfig, inject_adapter_in_model
from peft.utils import get_peft_model_state_dict
from support.zoo import artifact, minted, rel_rms, served_module

from cgbuild.store.seal import read_metadata

pytestmark = pytest.mark.slow
SD3 = "//zoo-dit/sd3/8x8-t4-b2@fp32:cpu"
TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
HINT = "fuse_lora() then unload_lora()"
Call = tuple[SD3Transformer2DModel, dict[str, Any]]
"""A module and the keyword arguments it is called with."""


@pytest.fixture(scope="module")
def minted_sd3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The SD3 transformer minted (one compile): (workspace, its stored artifact)."""
    ws, _ = minted(tmp_path_factory, "zoo-dit/sd3", {"sd3": SD3})
    return ws, artifact(ws, SD3)


@pytest.fixture
def path(minted_sd3: tuple[Path, Path]) -> Path:
    return minted_sd3[1]


@pytest.fixture
def sd3(minted_sd3: tuple[Path, Path]) -> Call:
    """A serving process's SD3 transformer and the call the SD3 pipeline makes."""
    m, _, kwargs = served_module(minted_sd3[0], SD3)
    assert isinstance(m, SD3Transformer2DModel)
    return m, kwargs


def tolerance(path: Path) -> float:
    return float(read_metadata(path)["verify"]["tolerance"]["float32"])


def lora(module: SD3Transformer2DModel, seed: int, targets: list[str] = TARGETS) -> dict[str, torch.Tensor]:
    """A LoRA for `module` as a checkpoint holds it (`transformer.` prefix, as the pipeline's
    `load_lora_weights` reads it): made by peft on a copy, A and B random (B nonzero)."""
    torch.manual_seed(seed)
    donor = copy.deepcopy(module)
    donor.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=targets, init_lora_weights=False))
    return {f"transformer.{k}": v.detach().clone() for k, v in get_peft_model_state_dict(donor).items()}


class Check:
    """Serves one call through `served` and eager, and holds each to its verdict."""

    def __init__(self, served: Adopted, module: torch.nn.Module, kwargs: dict[str, Any], tol: float) -> None:
        self.served, self.module, self.kwargs, self.tol = served, module, kwargs, tol

    def eager(self) -> torch.Tensor:
        """The module's own forward (also when `served.install()` routes its calls through `served`)."""
        with torch.no_grad():
            return type(self.module).forward(self.module, **self.kwargs)[0]

    def compiled(self) -> torch.Tensor:
        """The call is served compiled (no refusal), within tolerance of eager."""
        before = self.served.counters["compiled"]
        with torch.no_grad():
            got = self.served(**self.kwargs)[0]
        want = self.eager()
        assert self.served.counters["compiled"] == before + 1, self.served.last_reason
        assert rel_rms(got, want) < self.tol
        return want

    def refused(self, code: str = "module-changed", *words: str) -> torch.Tensor:
        """The call is refused with `code` (its detail naming `words`) and served eager."""
        before = self.served.counters[f"eager:{code}"]
        with torch.no_grad():
            got = self.served(**self.kwargs)[0]
        want = self.eager()
        assert rel_rms(got, want) < self.tol
        assert self.served.counters[f"eager:{code}"] == before + 1, self.served.counters
        why = self.served.last_reason
        assert why is not None and why.code == code
        assert all(w in why.detail for w in words), why.detail
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        return want

    def differ(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """The change moved eager well past the tolerance: the old binding would be caught."""
        assert rel_rms(a, b) > 10 * self.tol


def serve(path: Path, sd3: Call) -> tuple[Adopted, SD3Transformer2DModel, Check]:
    m, kwargs = sd3
    served = adopt(path, m)
    assert served.refusals == {}
    return served, m, Check(served, m, kwargs, tolerance(path))


def test_an_unfused_lora_is_refused_by_name_until_fused_and_unloaded(path: Path, sd3: Call) -> None:
    """`load_lora_adapter` injects PEFT layers (weights under `*.base_layer.*`): compiled, the
    package would serve the base model. Refused, naming the fix, until `fuse_lora()` +
    `unload_lora()`, after which the next call re-binds by itself and serves the fused weights."""
    served, m, check = serve(path, sd3)
    base = check.compiled()
    m.load_lora_adapter(lora(m, seed=1))
    check.differ(check.refused("module-changed", "peft.tuners.lora.layer.Linear", HINT), base)
    m.fuse_lora()
    check.refused("module-changed", HINT)  # fused in place, but the adapter layers are still there
    m.unload_lora()
    check.differ(check.compiled(), base)
    assert served.counters == {"compiled": 2, "eager:module-changed": 2, "rebound": 1}


def test_the_pipeline_s_own_lora_calls_are_served_right(path: Path, sd3: Call) -> None:
    """`pipe.load_lora_weights` / `pipe.fuse_lora` / `pipe.unload_lora_weights` on an SD3
    pipeline whose transformer calls are served (`install()`): refused while unfused, compiled
    and fused after."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    served, m, check = serve(path, sd3)
    adapter = lora(m, seed=11)  # before install(): the installed forward holds the package, no deepcopy
    served.install()
    parts = ("vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "text_encoder_3")
    pipe = StableDiffusion3Pipeline(
        transformer=m,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        tokenizer_3=None,
        **dict.fromkeys(parts),
    )
    with torch.no_grad():
        base = pipe.transformer(**check.kwargs)[0]
    assert served.counters == {"compiled": 1}
    pipe.load_lora_weights(adapter)
    unfused = check.refused("module-changed", HINT)
    pipe.fuse_lora(components=["transformer"])
    pipe.unload_lora_weights()
    check.differ(check.compiled(), base)
    check.differ(unfused, base)
    assert served.counters == {"compiled": 2, "eager:module-changed": 1, "rebound": 1}


def test_fused_and_unloaded_before_the_next_call_serves_the_fused_weights(path: Path, sd3: Call) -> None:
    """The default `fuse_lora()` merges in place, and `unload_lora()` puts the very layers back:
    nothing the package reads moved, so no re-bind is needed, and the fused weights are served."""
    served, m, check = serve(path, sd3)
    base = check.compiled()
    ptr = m.transformer_blocks[0].attn.to_q.weight.data_ptr()
    m.load_lora_adapter(lora(m, seed=2))
    m.fuse_lora()
    m.unload_lora()
    assert m.transformer_blocks[0].attn.to_q.weight.data_ptr() == ptr
    check.differ(check.compiled(), base)
    assert served.counters == {"compiled": 2}


def test_safe_fusing_swaps_storages_and_the_next_call_re_binds(path: Path, sd3: Call) -> None:
    """`fuse_lora(safe_fusing=True)` merges into a copy (PEFT assigns `weight.data`): the package
    would still read the old storages; without `rebind()`, the next call re-binds to the new."""
    served, m, check = serve(path, sd3)
    base = check.compiled()
    ptr = m.transformer_blocks[0].attn.to_q.weight.data_ptr()
    m.load_lora_adapter(lora(m, seed=3))
    m.fuse_lora(safe_fusing=True)
    m.unload_lora()
    assert m.transformer_blocks[0].attn.to_q.weight.data_ptr() != ptr
    check.differ(check.compiled(), base)
    assert served.counters == {"compiled": 2, "rebound": 1}


def test_a_new_parameter_or_data_assignment_is_re_bound_by_the_next_call(path: Path, sd3: Call) -> None:
    served, m, check = serve(path, sd3)
    base = check.compiled()
    attn = m.transformer_blocks[0].attn
    attn.to_q.weight = torch.nn.Parameter(attn.to_q.weight.detach() * 2)
    swapped = check.compiled()
    check.differ(swapped, base)
    attn.to_v.weight.data = attn.to_v.weight.detach() * 3
    check.differ(check.compiled(), swapped)
    assert served.counters == {"compiled": 3, "rebound": 2}


def test_unfuse_with_the_adapter_still_active_is_refused(path: Path, sd3: Call) -> None:
    """After `fuse_lora()` + `unfuse_lora()` the base weights are back in place but the adapter
    is active again: eager is base + LoRA, the package would read the base alone."""
    served, m, check = serve(path, sd3)
    base = check.compiled()
    m.load_lora_adapter(lora(m, seed=4))
    m.fuse_lora()
    fused = check.refused("module-changed", HINT)
    m.unfuse_lora()
    check.differ(check.refused("module-changed", HINT), base)
    m.unload_lora()
    torch.testing.assert_close(check.compiled(), base, rtol=1e-4, atol=1e-5)  # unfused: the base again
    check.differ(fused, base)
    assert served.counters == {"compiled": 2, "eager:module-changed": 2, "rebound": 1}


def test_one_lora_swapped_for_another_serves_the_second_alone(path: Path, sd3: Call) -> None:
    """Fused A is taken out (`unfuse_lora`, `unload_lora`), B loaded, fused and unloaded: the
    calls between are refused, the one after is compiled and is B's model, not A's or A + B's."""
    served, m, check = serve(path, sd3)
    clean = copy.deepcopy(m)
    base = check.compiled()
    m.load_lora_adapter(lora(m, seed=5))
    m.fuse_lora()
    with_a = check.refused("module-changed", HINT)
    m.unfuse_lora()
    m.unload_lora()
    m.load_lora_adapter(lora(m, seed=6))
    m.fuse_lora()
    m.unload_lora()
    with_b = check.compiled()
    clean.load_lora_adapter(lora(clean, seed=6))
    clean.fuse_lora()
    clean.unload_lora()
    with torch.no_grad():
        torch.testing.assert_close(with_b, clean(**check.kwargs)[0], rtol=1e-4, atol=1e-5)
    check.differ(with_b, base)
    check.differ(with_b, with_a)
    assert served.counters == {"compiled": 2, "eager:module-changed": 1, "rebound": 1}


@pytest.mark.filterwarnings("ignore:Already found a `peft_config` attribute:UserWarning")
def test_disabled_enabled_and_weighted_adapters_are_served_eager(path: Path, sd3: Call) -> None:
    """`disable_lora`, `enable_lora`, `set_adapters` and `delete_adapters` switch what the
    injected layers compute; while they are injected every call is served eager, equal to it."""
    served, m, check = serve(path, sd3)
    base = check.compiled()
    m.load_lora_adapter(lora(m, seed=7), adapter_name="a")
    with_a = check.refused("module-changed", HINT)
    m.disable_lora()
    torch.testing.assert_close(check.refused("module-changed", HINT), base, rtol=1e-5, atol=1e-6)
    m.enable_lora()
    torch.testing.assert_close(check.refused("module-changed", HINT), with_a, rtol=0, atol=0)
    m.load_lora_adapter(lora(m, seed=8), adapter_name="b")
    m.set_adapters(["a", "b"], [0.5, 1.0])
    check.differ(check.refused("module-changed", HINT), with_a)
    m.delete_adapters(["a", "b"])
    check.refused("module-changed")  # empty PEFT layers: still not the tree the package was bound to
    m.unload_lora()
    torch.testing.assert_close(check.compiled(), base, rtol=0, atol=0)
    check.differ(with_a, base)
    assert served.counters == {"compiled": 2, "eager:module-changed": 5, "rebound": 1}


def test_peft_inject_adapter_in_model_is_refused(path: Path, sd3: Call) -> None:
    """peft's own `inject_adapter_in_model` on `to_q`/`to_v`, without diffusers."""
    served, m, check = serve(path, sd3)
    base = check.compiled()
    torch.manual_seed(9)
    config = LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_v"], init_lora_weights=False)
    inject_adapter_in_model(config, m)
    check.differ(check.refused("module-changed", "to_q", HINT), base)
    assert served.counters == {"compiled": 1, "eager:module-changed": 1}


def test_an_adapter_loaded_before_adopt_is_refused_and_re_armed_by_rebind(path: Path, sd3: Call) -> None:
    """Adopted with the adapter unfused, the artifact is refused before it loads (the module has
    no `to_k.weight`: it is `to_k.base_layer.weight`), naming the fix; after it, `rebind()`."""
    m, kwargs = sd3
    clean = copy.deepcopy(m)
    m.load_lora_adapter(lora(m, seed=10))
    served = adopt(path, m)
    (refusal,) = served.refusals.values()
    assert refusal.code == "layout-mismatch" and HINT in refusal.detail, refusal
    check = Check(served, m, kwargs, tolerance(path))
    unfused = check.refused("layout-mismatch", HINT)
    m.fuse_lora()
    m.unload_lora()
    served.rebind()
    assert served.refusals == {}
    torch.testing.assert_close(check.compiled(), unfused, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        check.differ(unfused, clean(**kwargs)[0])
    assert served.counters == {"eager:layout-mismatch": 1, "compiled": 1}
