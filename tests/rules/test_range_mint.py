"""Declared ranges, torch side: one program for every frame count in `frames = {min, max}`,
named by its label, checked by the mint at both ends and inside, served compiled inside the range
and eager, named, outside it; an entry that ignores a declared dimension is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from cgbuild_rules import dims
from cgbuild_rules.adopt import adopt_manifest
from cgbuild_rules.adopt.contract import distance
from support.cli import cli, last_json
from support.zoo import ZOO, manifested, rel_rms, served_module

from cgbuild.protocol.contract import CallContract
from cgbuild.store.local import Store

LABEL = "//zoo-video/wan-range/8x8-f2..4-t4-b1@fp32:cpu"
RANGE = {"min": 2, "max": 4}
PIXEL_RANGE = {"min": 5, "max": 13}
"""What the zoo's Cgfile declares (`pixel_frames`): WanPipeline's num_frames for 2 to 4 latent frames."""


@pytest.fixture(scope="module")
def ranged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    return manifested(tmp_path_factory, "zoo-video/wan-range", {"range": LABEL})


@pytest.mark.slow
def test_plan_why_inspect_and_the_manifest_show_the_range(ranged: tuple[Path, dict[str, Any]]) -> None:
    ws, doc = ranged
    (target,) = json.loads(cli(ws, "plan", "//zoo-video/wan-range", "--json").stdout)["targets"]
    assert (target["label"], target["status"], target["envelope"]["frames"]) == (LABEL, "fresh", RANGE)
    assert target["envelope"]["pixel_frames"] == PIXEL_RANGE  # what the Cgfile declares
    assert f"{LABEL}  {target['key'][:12]}" in cli(ws, "plan", "//zoo-video/wan-range", "--all").stdout
    assert "[pixel frames 5..13]" in cli(ws, "plan", "//zoo-video/wan-range", "--all").stdout
    assert "'frames': {'min': 2, 'max': 4}" in cli(ws, "why", LABEL).stdout
    covers = "covers      8x8 frames 2..4 (pixel frames 5..13) batch 1 text 4"
    assert covers in cli(ws, "inspect", LABEL).stdout
    (entry,) = doc["modules"]["wan-range"]["entries"]
    assert (entry["graph_class"], entry["envelope"]["frames"]) == ("8x8-f2..4-t4-b1", RANGE)
    assert entry["envelope"]["pixel_frames"] == PIXEL_RANGE


@pytest.mark.slow
def test_declaring_the_modules_own_frames_instead_keeps_the_label_and_key(
    ranged: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """The pipeline's count is a way to declare the module's, not an identity of its own: the same
    class declared as `frames` plans the same label, the same key, fresh from the same artifact."""
    ws, _ = ranged
    (was,) = json.loads(cli(ws, "plan", "//zoo-video/wan-range", "--json").stdout)["targets"]
    own = tmp_path / "own"
    shutil.copytree(ws, own)
    cgfile = (own / "Cgfile").read_text()
    assert "pixel_frames = { min = 5, max = 13 }" in cgfile
    (own / "Cgfile").write_text(
        cgfile.replace("pixel_frames = { min = 5, max = 13 }", "frames = { min = 2, max = 4 }")
    )
    (now,) = json.loads(cli(own, "plan", "//zoo-video/wan-range", "--json").stdout)["targets"]
    assert (now["label"], now["key"], now["status"]) == (was["label"], was["key"], "fresh")


@pytest.mark.slow
def test_the_mint_checked_both_ends_and_inside(ranged: tuple[Path, dict[str, Any]]) -> None:
    ws, _ = ranged
    record = json.loads(cli(ws, "inspect", LABEL, "--json").stdout)["mint_record"]
    checked = record["result"]["verify"]
    assert sorted(row["frames"] for row in checked) == [2, 3, 4]
    assert all(row["rel_rms"] <= row["tolerance"] for row in checked)


@pytest.mark.slow
def test_a_call_inside_the_range_is_compiled_and_one_outside_eager_and_named(
    ranged: tuple[Path, dict[str, Any]],
) -> None:
    ws, doc = ranged
    module, _, kwargs = served_module(ws, LABEL)
    served = adopt_manifest(doc, {"wan-range": module}, store=Store(ws / ".cgbuild" / "store"))["wan-range"]
    for frames in (2, 3, 4, 1, 5):
        call = {**kwargs, "hidden_states": torch.randn(1, 4, frames, 8, 8)}
        with torch.no_grad():
            got, want = served(**call)[0], type(module).forward(module, **call)[0]
        assert rel_rms(got, want) < 1e-4
        if frames in (1, 5):
            why = served.last_reason
            assert why is not None and why.code == "out-of-envelope"
            assert "8x8-f2..4-t4-b1" in why.detail and "(symbol-range)" in why.detail
    assert served.counters == {"compiled": 3, "eager:out-of-envelope": 2}


@pytest.mark.slow
def test_a_program_wrong_at_an_end_of_its_range_fails_its_mint(tmp_path: Path) -> None:
    """`skew` is right at the traced size and wrong at 4 frames: only the check at the range's
    end finds it, and the mint fails typed instead of storing it."""
    ws = tmp_path / "ws"
    shutil.copytree(ZOO, ws, ignore=shutil.ignore_patterns(".cgbuild", "__pycache__"))
    proc = cli(ws, "mint", "//zoo-skew:cpu", "--json")
    assert proc.returncode == 1
    (failed,) = last_json(proc)["failed"]
    assert failed["code"] == "verify-mismatch" and failed["retryable"] is False
    assert failed["detail"].startswith("the call at frames=4: output 0: relative RMS error")
    (target,) = json.loads(cli(ws, "plan", "//zoo-skew", "--json").stdout)["targets"]
    assert target["status"] == "mint"


MISDECLARED = """
[family.zoo-bad]
entry = "zoo_models:build"
sources = ["zoo_models.py"]
skus = ["cpu"]
layouts = ["fp32"]
config = { dynamic_batch = [2, 16] }

[family.zoo-bad.module.bnconv]
shapes = ["16x16"]
frames = [2]

[family.zoo-bad.module.wan]
shapes = ["8x8"]
text_lengths = { min = 2, max = 8 }

[family.zoo-bad.module.dynbatch]
shapes = ["1x16"]
batch_sizes = { min = 2, max = 8 }
"""


@pytest.mark.slow
def test_an_entry_that_ignores_a_declared_dimension_is_refused_at_its_line(tmp_path: Path) -> None:
    """Frames its entry never reads, a range its dims do not export, a range exported over other
    bounds: each target is blocked `dimension-mismatch` at the field's line, and the gate fails."""
    ws = tmp_path / "ws"
    shutil.copytree(ZOO, ws, ignore=shutil.ignore_patterns(".cgbuild", "__pycache__"))
    text = (ws / "Cgfile").read_text() + MISDECLARED
    (ws / "Cgfile").write_text(text)
    lines = text.splitlines()
    start = lines.index("[family.zoo-bad]")
    proc = cli(ws, "plan", "//zoo-bad", "--json", "--exit-code")
    assert proc.returncode == 1
    reasons = {t["module"]: t["reasons"][0] for t in json.loads(proc.stdout)["targets"]}
    expected = {
        "bnconv": ("frames = [2]", "frames", "declares frames, but the entry never reads spec['frames']"),
        "wan": (
            "text_lengths = { min = 2, max = 8 }",
            "text_lengths",
            "dims export no torch.export.Dim named 'text_len'",
        ),
        "dynbatch": ("batch_sizes = { min = 2, max = 8 }", "batch_sizes", "exports Dim 'batch' over 2..16"),
    }
    for module, (declaration, key, says) in expected.items():
        reason = reasons[module]
        field = f"family.zoo-bad.module.{module}.{key}"
        assert (reason["code"], reason["component"]) == ("dimension-mismatch", field)
        assert reason["detail"].startswith(f"Cgfile:{lines.index(declaration, start) + 1}: {field} declares")
        assert says in reason["detail"]


def test_reading_the_spec_any_way_counts_and_never_reading_frames_is_refused() -> None:
    spec = {"family": "f", "module": "m", "frames": 3}
    for read in (
        lambda s: s["frames"],
        lambda s: s.get("frames"),
        lambda s: "frames" in s,
        dict,
        lambda s: {**s},
        lambda s: list(s.items()),
    ):
        reads = dims.SpecReads(spec)
        read(reads)
        dims.check_read(spec, reads)
    with pytest.raises(dims.DimensionMismatch, match=r"family\.f\.module\.m\.frames declares frames") as e:
        dims.check_read(spec, dims.SpecReads(spec))
    assert e.value.field == "family.f.module.m.frames"
    dims.check_read({**spec, "frames": None}, dims.SpecReads(spec))  # an image module declares none


def test_a_derived_dim_counts_by_its_root() -> None:
    frames = torch.export.Dim("frames", min=2, max=4)
    spec = {"family": "f", "module": "m", "frames": 3, "ranges": {"frames": RANGE}}
    dims.check_exported(spec, {"x": {1: 2 * frames}, "y": None})
    with pytest.raises(dims.DimensionMismatch, match=r"over 2\.\.5"):
        dims.check_exported(spec, ({0: torch.export.Dim("frames", min=2, max=5)},))


def test_the_closest_class_is_the_one_whose_sizes_or_range_lie_nearest() -> None:
    leaf = {"dtype": "float32", "device": "cpu", "shape": [1, "S0", 8]}
    contract = CallContract.from_json(
        {"inputs": [{"name": "x", "keyword": False, "leaves": [leaf]}], "symbols": [{"name": "S0", **RANGE}]}
    )
    assert distance(contract, (torch.zeros(1, 3, 8),), {}) == 0
    assert distance(contract, (torch.zeros(1, 5, 8),), {}) == 1
    assert distance(contract, (torch.zeros(1, 1, 9),), {}) == 2
    assert distance(contract, (), {"x": torch.zeros(1, 3, 8)}) is None


PIXEL_FRAMES = {2: 5, 3: 9, 4: 13}
"""WanPipeline's `num_frames` counts pixel frames, 4 a latent frame after the first: the
transformer sees (num_frames - 1) // 4 + 1, which is what the module declares."""


def _wan_video(pipe: Any, num_frames: int) -> torch.Tensor:
    embeds = torch.randn(1, 4, pipe.transformer.config.text_dim, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        out = pipe(
            prompt_embeds=embeds,
            height=64,
            width=64,
            num_frames=num_frames,
            num_inference_steps=2,
            guidance_scale=1.0,  # no negative prompt: one transformer call a step
            output_type="latent",
            generator=torch.Generator().manual_seed(3),
        ).frames
    assert isinstance(out, torch.Tensor)
    return out


@pytest.mark.slow
def test_the_stock_wan_pipeline_is_served_compiled_at_every_frame_count_of_the_range(
    ranged: tuple[Path, dict[str, Any]],
) -> None:
    """A stock `WanPipeline` (no text encoder, no VAE: latents out), armed by `adopt_pipeline`: every
    transformer call at 5, 9 and 13 pixel frames (2 to 4 latent) compiled, the video as eager's;
    17 pixel frames (5 latent) is outside the range: eager, named with the class."""
    from cgbuild_rules.pipeline import adopt_pipeline
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    ws, doc = ranged
    module, _, _ = served_module(ws, LABEL)
    pipe = WanPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=None,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=module.eval(),
    )
    pipe.set_progress_bar_config(disable=True)
    want = {n: _wan_video(pipe, n) for n in (*PIXEL_FRAMES.values(), 17)}
    served = adopt_pipeline(pipe, doc, store=Store(ws / ".cgbuild" / "store"))
    for latent, pixel in PIXEL_FRAMES.items():
        got = _wan_video(served, pixel)
        assert got.shape[2] == latent
        assert rel_rms(got, want[pixel]) < 1e-4, pixel
    counters = served.counters["wan-range"]
    assert counters["compiled"] == 2 * len(PIXEL_FRAMES) and set(counters) <= {"compiled", "restrided"}
    assert rel_rms(_wan_video(served, 17), want[17]) < 1e-6  # eager: the module's own computation
    counters = served.counters["wan-range"]
    assert counters["eager:out-of-envelope"] == 2, counters
    reason = served.components["wan-range"].adopted.last_reason
    assert reason is not None and "8x8-f2..4-t4-b1" in reason.detail
    served.release()
