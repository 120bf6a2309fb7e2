"""flux2-klein's `qk-norm` lane on the CPU: q's and k's norm and rotary embedding routed through a
switch whose `fused` value is `cgbuild::qk_norm_rope_v1` (rules/qk_rope.py).

- Under Triton's CPU interpreter (with the GPU's bf16 rounding, `support.triton_child`), a klein
  transformer of one double- and one single-stream block at klein's head dimension (128), its
  norms' weights random, computes with each value exactly what the stock module computes (the
  op rounds where diffusers' path rounds); with `fused` the op runs once per block.
- A `qk-norm` lane declared without the attention lane is refused by the entry (the switch
  lives in the attention processors).
- A family that declares no `qk-norm` traces the graph it traced before the axis existed
  (the tiny family's banked digest with `attention` lanes, below).
- Both values export into one program; declared on the CPU, the axis mints without its CUDA
  value (excluded by name) and the artifact serves compiled.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from support.cgfiles import FLUX2, flux2_workspace
from support.cli import cli, last_json
from support.triton_child import run

pytest.importorskip("triton")
pytest.importorskip("diffusers")


def config_128(heads: int) -> dict[str, Any]:
    """A klein transformer of one double- and one single-stream block at klein's head dimension."""
    return {
        "patch_size": 1,
        "in_channels": 8,
        "num_layers": 1,
        "num_single_layers": 1,
        "attention_head_dim": 128,
        "num_attention_heads": heads,
        "joint_attention_dim": 32,
        "timestep_guidance_channels": 32,
        "mlp_ratio": 2.0,
        "axes_dims_rope": [32, 32, 32, 32],
        "rope_theta": 2000,
        "guidance_embeds": False,
    }


def _entry() -> ModuleType:
    from cgbuild_rules.trace import load_entry

    return sys.modules[load_entry("flux2_entry:build", str(FLUX2)).__module__]


def _lanes_script() -> str:
    return textwrap.dedent(
        f"""
        import copy, json, sys
        import torch
        from support.triton_child import gpu_rounding
        gpu_rounding()
        from cgbuild_rules.trace import load_entry
        flux2_entry = sys.modules[load_entry("flux2_entry:build", {str(FLUX2)!r}).__module__]

        torch.manual_seed(0)
        stock = flux2_entry.Flux2KleinTransformer(**{config_128(2)!r})
        for name, p in stock.named_parameters():
            if ".norm_" in name:  # the norms' weights matter (ones would hide a skipped weight)
                torch.nn.init.normal_(p, 1.0, 0.5)
        stock = stock.bfloat16().requires_grad_(False)
        routed = copy.deepcopy(stock)
        flux2_entry.route(routed, ["flash"], ["unfused", "fused"])
        calls = []

        class Count(torch.overrides.TorchFunctionMode):  # each call of the fused op
            def __torch_function__(self, func, types, args=(), kwargs=None):
                calls.extend([1] if "qk_norm_rope_v1" in str(func) else [])
                return func(*args, **(kwargs or {{}}))

        img, txt = flux2_entry._position_ids(48, 64, 7)
        args = (torch.randn(1, 8, img.shape[0]).transpose(1, 2).bfloat16(),
                torch.randn(1, 7, 32).bfloat16(), torch.rand(1).bfloat16(), img, txt)
        rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())
        out = {{}}
        with torch.no_grad():
            want = stock(*args)
            for value in ("unfused", "fused"):
                routed.qk_norm_lane.set(value)
                with Count():
                    out[value] = routed(*args)
        print(json.dumps({{"unfused": rel(out["unfused"], want), "fused": rel(out["fused"], want),
                          "fused_calls": len(calls), "scale": float(want.float().norm())}}))
        """
    )


def test_each_qk_norm_value_computes_what_the_stock_module_computes() -> None:
    got = run(_lanes_script(), interpret=True)
    assert got["scale"] > 0
    assert got["unfused"] == 0.0, got  # the same ops as diffusers' processors, in the same order
    # the kernel rounds where diffusers' path rounds: bit for bit under the interpreter with the
    # GPU's casts (tests/rules/test_qk_rope.py); the op ran once per block (one of each stream)
    assert got["fused"] == 0.0 and got["fused_calls"] == 2, got


def test_a_qk_norm_lane_without_the_attention_lane_is_refused() -> None:
    spec = {
        "module": "transformer",
        "config": {"model": {"num_layers": 1, "num_single_layers": 1}},
        "text_len": 8,
        "height": 64,
        "width": 64,
        "batch": 1,
        "lanes": {"qk-norm": ["unfused"]},
    }
    with pytest.raises(ValueError, match="declare attention too"):
        _entry().build(spec)


TINY = "//flux2-klein-tiny/transformer/64x64-t8-b1@fp32:cpu"
TINY_TORCH = "2.13.0"
TINY_ATTENTION_DIGEST = "bb15214a70173f90179a1eaaddf2c35694af8e17b69eb00d1a5311ccd81bf16f"
"""The tiny family's graph with `attention = ["flash", "math"]`, planned with the entry before the
`qk-norm` axis existed (torch 2.13.0, CPU): the processors' own path must trace op for op as then,
or every key of a family that declares no `qk-norm` would move."""


def _plan_digest(tmp_path: Path, lanes: str) -> str:
    (target,) = last_json(cli(flux2_workspace(tmp_path, lanes), "plan", TINY, "--json"))["targets"]
    return str(target["axes"]["graph"]["digest"])


def test_no_qk_norm_declared_traces_the_graph_of_before_the_axis(tmp_path: Path) -> None:
    import torch

    if torch.__version__.split("+")[0] != TINY_TORCH:
        pytest.skip(f"the banked digest was traced with torch {TINY_TORCH}, this is {torch.__version__}")
    assert _plan_digest(tmp_path / "a", 'attention = ["flash", "math"]') == TINY_ATTENTION_DIGEST
    declared = _plan_digest(tmp_path / "b", 'attention = ["flash", "math"]\nqk-norm = ["unfused"]')
    assert declared != TINY_ATTENTION_DIGEST  # a declared axis is the program's: it traces through the switch


def test_both_values_export_into_one_program_and_the_unfused_one_runs_on_the_cpu() -> None:
    """The switch's two values in one `torch.export` program (a `torch.cond` per block, the op a
    node of the `fused` branch); the program, run with the `unfused` selector on the CPU, computes
    what the stock module does (the `fused` branch, CUDA's, is never entered there)."""
    import copy

    import torch
    from cgbuild_rules import lanes

    flux2_entry = _entry()
    torch.manual_seed(0)
    stock = flux2_entry.Flux2KleinTransformer(**config_128(1)).bfloat16().requires_grad_(False)
    routed = copy.deepcopy(stock)
    flux2_entry.route(routed, ["flash"], ["unfused", "fused"])
    img, txt = flux2_entry._position_ids(32, 48, 5)
    args = (
        torch.randn(1, 8, img.shape[0]).transpose(1, 2).bfloat16(),
        torch.randn(1, 5, 32).bfloat16(),
        torch.rand(1).bfloat16(),
        img,
        txt,
    )
    program = lanes.export(routed, args, {}, sel=lanes.selector_of(routed))
    ops = [
        str(n.target)
        for m in program.graph_module.modules()
        if isinstance(m, torch.fx.GraphModule)
        for n in m.graph.nodes
        if n.op == "call_function"
    ]
    assert ops.count("cgbuild.qk_norm_rope_v1.default") == 2, ops  # one per block, in its branch
    assert ops.count("cond") == 2, ops  # one torch.cond a block
    with torch.no_grad():
        got = program.module()(*args, **{lanes.SELECTOR: lanes.selector_of(routed)})
        assert torch.equal(got, stock(*args))


@pytest.mark.slow
def test_a_declared_qk_norm_mints_without_its_cuda_value_and_serves_compiled(tmp_path: Path) -> None:
    """Declared on the CPU, the axis keeps `unfused` and seals `fused` as excluded by name; the
    artifact adopts onto the module the entry builds and serves every call compiled, as eager."""
    import torch
    from cgbuild_rules import trace
    from cgbuild_rules.adopt import adopt

    from cgbuild.config import cgfile
    from cgbuild.config.targets import expand
    from cgbuild.protocol.trace import job_for
    from cgbuild.store.local import Store

    ws = flux2_workspace(tmp_path, 'attention = ["flash"]\nqk-norm = ["unfused", "fused"]')
    (minted,) = last_json(cli(ws, "mint", TINY, "--json"))["minted"]
    lanes = last_json(cli(ws, "inspect", TINY, "--json"))["metadata"]["lanes"]
    assert {"axis": "qk-norm", "values": ["unfused"]} in lanes["axes"]
    assert lanes["excluded"] == {"qk-norm.fused": "not-buildable: needs a cuda device"}
    cg = cgfile.load(ws / "Cgfile")
    target = next(t for t in expand(cg) if t.label == TINY)
    built = trace.build(trace.parse_job(job_for(cg, target).with_id("t").to_json()), "real")
    served = adopt(minted["key"], built.module, store=Store(ws / ".cgbuild" / "store"), strict=True)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(served(*built.args), built.module(*built.args), rtol=1e-4, atol=1e-5)
    assert dict(served.counters) == {"compiled": 2}
