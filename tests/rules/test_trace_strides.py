"""The compile traces the inputs the entry laid out: `empty` mode's zero inputs keep the entry's
strides. A pipeline hands its transformer a transposed view; a program traced on contiguous zeros
reads that view's memory as if it were contiguous (a 1.5 relative error, measured)."""

from __future__ import annotations

from pathlib import Path

import torch
from cgbuild_rules import trace

from cgbuild.config import cgfile
from cgbuild.config.targets import expand
from cgbuild.protocol.trace import job_for

ZOO = Path(__file__).resolve().parents[1] / "zoo"
LABEL = "//zoo-pipe/transformer/64x64-t8-b1@fp32:cpu"


def test_empty_mode_inputs_keep_the_entrys_strides() -> None:
    cg = cgfile.load(ZOO / "Cgfile")
    target = next(t for t in expand(cg) if t.label == LABEL)
    job = trace.parse_job(job_for(cg, target).with_id(LABEL).to_json())
    layouts = {}
    for mode in ("fake", "empty", "real"):
        built = trace.build(job, mode)  # type: ignore[arg-type]
        hidden = built.kwargs["hidden_states"]
        layouts[mode] = (tuple(hidden.shape), hidden.stride())
    assert layouts["empty"] == layouts["real"] == layouts["fake"]
    assert torch.empty(layouts["real"][0]).stride() != layouts["real"][1]  # the view is not contiguous


BROADCAST_ENTRY = """
import torch
from torch import nn


def expanded(spec):
    t = torch.rand(())  # as diffusers passes a timestep: t.expand(batch)
    return Timed(), (torch.randn(spec["batch"], 4),), {"t": t.expand(spec["batch"])}


class Timed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x, t):
        return self.fc(x) * t[:, None]
"""


def test_an_expanded_entry_input_is_refused_by_name(tmp_path: Path) -> None:
    """A stride-0 dimension longer than one would compile a program that reads one element along
    it: only a caller passing that same broadcast could be served. The trace refuses it and tells
    the author what to pass; stride 0 on a dimension of one (`t.expand(1)`) is any layout."""
    from support.jobs import make_job

    (tmp_path / "broadcast_entry.py").write_text(BROADCAST_ENTRY)
    refused = trace.run_job(make_job(entry="broadcast_entry:expanded", root=tmp_path, batch=2))
    assert not refused["ok"] and refused["code"] == "entry-error", refused
    assert refused["detail"].startswith("entry input t [2] has stride 0 on dimension 0")
    assert "`.contiguous()` or `.clone()`" in refused["detail"]
    assert trace.run_job(make_job(entry="broadcast_entry:expanded", root=tmp_path, batch=1))["ok"]
