"""A serving worker's module from a checkpoint: read to the device, assigned (no copy, no init),
literals computed; the same outputs as the module the entry builds with its own weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cgbuild_rules import trace, weights

from cgbuild.config import cgfile
from cgbuild.config.targets import expand
from cgbuild.protocol.trace import job_for

ROOT = Path(__file__).resolve().parents[2]


def _job(example: str, label: str) -> dict:
    cg = cgfile.load(ROOT / "examples" / example / "Cgfile")
    target = next(t for t in expand(cg) if t.label == label)
    return job_for(cg, target).with_id(label).to_json()


@pytest.mark.parametrize(
    ("example", "label"),
    [
        ("toy", "//toy/conv/32x32-b2@fp32:cpu"),
        ("flux2_klein", "//flux2-klein-tiny/transformer/64x64-t8-b1@fp32:cpu"),
    ],
)
def test_module_from_checkpoint_matches_the_entrys_own(tmp_path: Path, example: str, label: str) -> None:
    job = _job(example, label)
    real = trace.build(trace.parse_job(job), "real")
    path = weights.write_checkpoint(real.module, tmp_path / "w.safetensors")
    tensors = weights.read_checkpoint(path, "cpu")
    module = weights.module_from_checkpoint(job, tensors, "cpu")
    state = module.state_dict()
    # assigned, not copied: the module holds the checkpoint's own tensors
    assert all(state[name].data_ptr() == t.data_ptr() for name, t in tensors.items())
    with torch.no_grad():
        want, got = real.module(*real.args, **real.kwargs), module(*real.args, **real.kwargs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_checkpoint_missing_a_tensor_is_refused_by_name(tmp_path: Path) -> None:
    job = _job("toy", "//toy/mlp/8x64-b1@fp32:cpu")
    real = trace.build(trace.parse_job(job), "real")
    tensors = {k: v for k, v in real.module.state_dict().items() if not k.endswith("bias")}
    with pytest.raises(ValueError, match=r"lacks tensors the module needs: .*bias"):
        weights.module_from_checkpoint(job, tensors, "cpu")
    extra = {**real.module.state_dict(), "stray.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"stray\.weight"):
        weights.module_from_checkpoint(job, extra, "cpu")
