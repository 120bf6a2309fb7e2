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
