"""Video families: frames are an envelope facet, named in every label and facet, and a call is
routed by its frame count; an image family's labels and facets carry no frames."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from cgbuild_rules.adopt import adopt_manifest
from support.cli import cli
from support.zoo import ZOO, manifested, rel_rms, served_module

from cgbuild.config import cgfile
from cgbuild.config.targets import expand
from cgbuild.store.local import Store

LABELS = {f: f"//zoo-video/wan/8x8-f{f}-t4-b1@fp32:cpu" for f in (2, 3)}


def test_frames_name_the_graph_class_and_stay_out_of_image_labels() -> None:
    cg = cgfile.load(ZOO / "Cgfile")
    labels = {t.label: t for t in expand(cg)}
    assert set(LABELS.values()) <= set(labels)
    want = {"shape": "8x8", "frames": 3, "text_len": 4, "batch": 1, "guidance": []}
    assert labels[LABELS[3]].facet == want | {"pixel_frames": 9}  # the entry's PIXEL_FRAMES: 4 a frame
    image = labels["//zoo-dit/wan/8x8-t4-b1@fp32:cpu"]  # the same module declared without frames
    assert (
        "frames" not in image.facet and "pixel_frames" not in image.facet and image.graph_class.frames is None
    )


@pytest.fixture(scope="module")
def video(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    return manifested(tmp_path_factory, "zoo-video/wan", {str(f): label for f, label in LABELS.items()})


@pytest.mark.slow
def test_a_call_is_routed_by_its_frame_count(video: tuple[Path, dict[str, Any]]) -> None:
    ws, doc = video
    facets = [e["envelope"]["frames"] for e in doc["modules"]["wan"]["entries"]]
    assert sorted(facets) == [2, 3]
    module, _, kwargs = served_module(ws, LABELS[2])
    served = adopt_manifest(doc, {"wan": module}, store=Store(ws / ".cgbuild" / "store"))["wan"]
    for frames in (2, 3, 4):
        call = {**kwargs, "hidden_states": torch.randn(1, 4, frames, 8, 8)}
        with torch.no_grad():
            got, want = served(**call)[0], type(module).forward(module, **call)[0]
        assert rel_rms(got, want) < 1e-4
    assert served.counters == {"compiled": 2, "eager:out-of-envelope": 1}
    assert served.last_reason is not None and "8x8-f3-t4-b1" in served.last_reason.detail  # the closest


@pytest.mark.slow
def test_inspect_and_plan_show_the_frames(video: tuple[Path, dict[str, Any]]) -> None:
    ws, _ = video
    plan = json.loads(cli(ws, "plan", "//zoo-video/wan", "--json").stdout)
    assert {t["label"]: t["envelope"]["frames"] for t in plan["targets"]} == {v: k for k, v in LABELS.items()}
    out = cli(ws, "inspect", LABELS[3]).stdout
    assert "frames 3" in out
