"""flux2-klein's lanes on the CPU: the attention switch through a real mint of the tiny config.

The flagship family declares `attention` (and the fp8 rule's `fp8-gemm`) for its GPU targets,
where the measurement lives (docs/lanes.md; benchmarks/results/klein_lanes_gpu.json). The same
entry serves a tiny config that runs on the CPU: here it declares `attention = ["flash", "math"]`,
the two values a CPU target builds (`cudnn` and `efficient` need CUDA), and one
`cgbuild mint` compiles both into one artifact, measures them, seals the verdict and records
the evidence; adopt re-fits it and each bound lane runs its own kernel.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from support.cgfiles import flux2_workspace
from support.cli import cli

from cgbuild.store.local import Store

ROOT = Path(__file__).resolve().parents[2]
FLUX = ROOT / "examples" / "flux2_klein"
LABEL = "//flux2-klein-tiny/transformer/64x64-t8-b1@fp32:cpu"
pytestmark = pytest.mark.slow


def _keys(ws: Path, selector: str) -> dict[str, str]:
    proc = cli(ws, "plan", selector, "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {t["label"]: t["key"] for t in json.loads(proc.stdout)["targets"] if t["key"]}


@pytest.fixture(scope="module")
def minted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    ws = flux2_workspace(tmp_path_factory.mktemp("lanes"), 'attention = ["math", "flash"]')
    proc = cli(ws, "mint", LABEL, "--json")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (minted,) = json.loads(proc.stdout.strip().splitlines()[-1])["minted"]
    inspect = json.loads(cli(ws, "inspect", LABEL, "--json").stdout)
    return {"ws": ws, "key": minted["key"], "inspect": inspect}


def test_the_mint_seals_both_attention_kernels_and_a_measured_verdict(minted: dict[str, Any]) -> None:
    lanes = minted["inspect"]["metadata"]["lanes"]
    # the entry's order (flash first, the reference), not the Cgfile's
    assert lanes["axes"] == [{"axis": "attention", "values": ["flash", "math"]}]
    assert lanes["selector"] == {"input": "_cgbuild_lanes", "axes": ["attention"], "base": 2}
    verdict = lanes["verdict"]
    assert verdict["candidates"] == ["flash", "math"]
    assert verdict["winner"] in ("flash", "math") and verdict["sku"]["name"] == "cpu"
    assert sorted(verdict["peaks"]) == ["flash", "math"]
    (runs,) = minted["inspect"]["lane_evidence"].values()
    (run,) = runs["runs"]
    assert sorted(run["measured"]) == ["flash", "math"]
    assert all(m["median_ns"] > 0 for m in run["measured"].values())
    assert run["numerics"]["attention"]["math"]["ok"] is True


def test_adopt_refits_and_each_bound_lane_runs_its_kernel(minted: dict[str, Any]) -> None:
    from cgbuild_rules import trace
    from cgbuild_rules.adopt import adopt
    from cgbuild_rules.lanes import set_lanes

    from cgbuild.config import cgfile
    from cgbuild.config.targets import expand
    from cgbuild.protocol.trace import job_for

    ws = minted["ws"]
    cg = cgfile.load(ws / "Cgfile")
    target = next(t for t in expand(cg) if t.label == LABEL)
    built = trace.build(trace.parse_job(job_for(cg, target).with_id("t").to_json()), "real")
    store = Store(ws / ".cgbuild" / "store")
    verdict = minted["inspect"]["metadata"]["lanes"]["verdict"]

    served = adopt(minted["key"], built.module, store=store)
    (fit,) = served.lanes.values()
    assert (fit.lane, fit.code) == (verdict["winner"], "lane-adopted")
    tiny = adopt(minted["key"], built.module, store=store, memory_bytes=1 << 20)
    (refit,) = tiny.lanes.values()
    assert refit.code == "lane-refit-no-fit"  # 1 MiB holds no lane: the smallest recorded peak

    with torch.no_grad():
        outputs = {}
        for lane in ("flash", "math"):
            pinned = adopt(minted["key"], built.module, store=store, lane=lane)
            outputs[lane] = pinned(*built.args)
            assert dict(pinned.counters) == {"compiled": 1}
            set_lanes(built.module, {"attention": lane})
            eager = built.module(*built.args)
            assert torch.allclose(outputs[lane], eager, rtol=1e-4, atol=1e-5)
    # On the CPU both lanes compile to the same arithmetic (torch decomposes its CPU flash kernel
    # for Inductor), so outputs cannot show which ran; the H200 mint shows it: each attention
    # lane of one artifact runs at its own speed (klein_lanes_gpu.json), and
    # tests/rules/test_lanes_mint.py proves the switch on lanes that compute different functions.
    assert torch.allclose(outputs["flash"], outputs["math"], rtol=1e-4, atol=1e-5)


def test_lanes_are_a_graph_change_and_the_fp8_rule_axis_moves_no_other_layout(tmp_path: Path) -> None:
    """Declaring the attention axis moves the tiny target's key (its program gains a switch);
    declaring the fp8 rule's axis moves no fp32 key (no fp8 layout: refused) and, with an fp8
    layout beside it, still moves no fp32 key: only the fp8 targets carry it."""
    plain = _keys(flux2_workspace(tmp_path / "a", ""), LABEL)
    laned = _keys(flux2_workspace(tmp_path / "b", 'attention = ["flash", "math"]'), LABEL)
    assert plain[LABEL] != laned[LABEL]

    ws = flux2_workspace(tmp_path / "c", 'attention = ["flash", "math"]\nfp8-gemm = ["scaled-mm", "triton"]')
    refused = cli(ws, "plan", LABEL)
    assert refused.returncode == 2
    assert "belongs to quant rule 'fp8-rowwise', which no layout of this family uses" in refused.stderr
    cgfile_path = ws / "Cgfile"  # the example declares [layout.fp8] for the flagship already
    text = cgfile_path.read_text()
    cgfile_path.write_text(text.replace('layouts = ["fp32", "int8"]', 'layouts = ["fp32", "int8", "fp8"]'))
    with_rule = _keys(ws, "//flux2-klein-tiny/transformer/64x64-t8-b1:cpu")
    assert with_rule[LABEL] == laned[LABEL]


def test_routed_attention_computes_what_diffusers_own_processors_compute() -> None:
    """The entry's processors are copies of diffusers' with the SDPA call behind the switch:
    every CPU lane of the routed model matches the unrouted diffusers model, and an attention
    mask (which no lane takes) is refused by name, not ignored."""
    import copy
    import sys

    from cgbuild_rules.lanes import set_lanes
    from cgbuild_rules.trace import load_entry

    from cgbuild.config import cgfile

    build = load_entry("flux2_entry:build", str(FLUX))
    flux2_entry = sys.modules[build.__module__]
    config = cgfile.load(FLUX / "Cgfile").families["flux2-klein-tiny"].config
    spec = {"module": "transformer", "config": config, "height": 64, "width": 64, "text_len": 8, "batch": 1}
    torch.manual_seed(0)
    plain, args, _ = build(spec)
    routed = copy.deepcopy(plain.eval())
    flux2_entry.route(routed, ["flash", "math"])
    with torch.no_grad():
        want = plain(*args)
        for lane in ("flash", "math"):
            set_lanes(routed, {"attention": lane})
            torch.testing.assert_close(routed(*args), want, rtol=1e-4, atol=1e-5)
    processor = next(m.processor for m in routed.modules() if isinstance(m, flux2_entry.Flux2Attention))
    q = torch.zeros(1, 4, 2, 16)
    with pytest.raises(ValueError, match="take no attention mask"):
        processor.attend(q, q, q, torch.ones(1, 1, 4, 4, dtype=torch.bool))
