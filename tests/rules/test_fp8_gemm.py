"""The fp8-rowwise rule's `fp8-gemm` lane, on a machine without a GPU.

Two real checks of the Triton value (`cgbuild_rules.fp8_gemm`), each in a child process
(`support.triton_child`):

- the kernel compiles for sm_90 with Triton's own compiler (no GPU needed): fp8 `wgmma`
  instructions in its PTX. A kernel that only the interpreter accepts (it reads a plain Python
  global, say) fails here, as it failed on the H200 once;
- under Triton's CPU interpreter the kernel computes what `torch._scaled_mm` computes, whole and
  through the module's lane switch (an eager `torch.cond`, traced by dynamo). The inputs sit on
  the e4m3 grid after scaling (every row's absmax is 448 / 2^j), so no element is rounded: the
  interpreter's float→fp8 cast rounds some values just below a power of two down a whole binade,
  which the GPU does not, and exact inputs keep that out of the comparison.
"""

from __future__ import annotations

import textwrap

import pytest
from support.triton_child import run

pytest.importorskip("triton")

COMPILE = textwrap.dedent(
    """
    import json
    import triton
    from triton.backends.compiler import GPUTarget
    from cgbuild_rules import fp8_gemm
    sig = {"x": "*bf16", "x_scale": "*fp32", "w": "*fp8e4nv", "w_scale": "*fp32", "bias": "*bf16",
           "y": "*bf16", "M": "i32", "N": "i32", "K": "i32", "HAS_BIAS": "constexpr", "BM": "constexpr",
           "BN": "constexpr", "BK": "constexpr", "GM": "constexpr"}
    consts = {"HAS_BIAS": True, "BM": fp8_gemm.BLOCK_M, "BN": fp8_gemm.BLOCK_N, "BK": fp8_gemm.BLOCK_K,
              "GM": fp8_gemm.GROUP_M}
    src = triton.compiler.ASTSource(fn=fp8_gemm.kernel(), signature=sig, constexprs=consts)
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": fp8_gemm.NUM_WARPS, "num_stages": fp8_gemm.NUM_STAGES})
    lines = out.asm["ptx"].splitlines()
    fp8_mma = sum("wgmma.mma_async" in line and "e4m3.e4m3" in line for line in lines)
    print(json.dumps({"wgmma_e4m3": fp8_mma, "cubin": len(out.asm["cubin"])}))
    """
)

INTERPRET = textwrap.dedent(
    """
    import json
    import torch
    from torch import nn
    from cgbuild_rules import quant
    from cgbuild_rules.lanes import set_lanes

    torch.manual_seed(0)
    M, K, N = 40, 96, 48  # none a multiple of the 128 tiles: every mask is exercised

    def exact_rows(m, k):
        grid = torch.randn(m, k).mul(64).clamp(-448, 448).to(torch.float8_e4m3fn).float()
        grid[:, 0] = 448.0
        return (grid / 2.0 ** torch.arange(m).remainder(4)[:, None]).to(torch.bfloat16)

    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())
    out = {}
    for bias in (True, False):
        lin = nn.Linear(K, N, bias=bias).to(torch.bfloat16)
        model, done = quant.convert(nn.Sequential(lin, nn.GELU()), "fp8-rowwise", torch.bfloat16,
                                    {"fp8-gemm": ["scaled-mm", "triton"]})
        q = model[0]
        x = exact_rows(M, K)
        ops = (x, q.weight, q.weight_scale, *((q.bias,) if bias else ()))
        with torch.no_grad():
            want = quant.scaled_mm_linear(*ops)
            got = quant.triton_linear(*ops)
            default = model(x.reshape(2, 20, K))
            set_lanes(model, {"fp8-gemm": "triton"})
            switched = model(x.reshape(2, 20, K))
        out[f"bias={bias}"] = {
            "kernel_vs_scaled_mm": rel(got, want),
            "switch_default_vs_scaled_mm": rel(default.reshape(M, N), torch.nn.functional.gelu(want)),
            "switch_triton_vs_kernel": rel(switched.reshape(M, N), torch.nn.functional.gelu(got)),
            "switch_fqn": [n for n, m in model.named_modules() if type(m).__name__ == "LaneSwitch"],
        }
    print(json.dumps(out))
    """
)


def test_kernel_compiles_for_sm90_with_fp8_tensor_core_instructions() -> None:
    result = run(COMPILE, interpret=False)
    assert result["wgmma_e4m3"] > 0
    assert result["cubin"] > 0


def test_kernel_and_lane_switch_compute_what_scaled_mm_computes() -> None:
    result = run(INTERPRET, interpret=True)
    for case in ("bias=True", "bias=False"):
        r = result[case]
        # fp32 accumulation in another order and one bf16 rounding of the output: ~1e-3
        assert r["kernel_vs_scaled_mm"] < 5e-3, r
        assert r["switch_default_vs_scaled_mm"] < 5e-3, r  # the switch holds scaled-mm by default
        assert r["switch_triton_vs_kernel"] < 1e-6, r  # bound to triton, the module runs the kernel
        assert r["switch_fqn"] == ["0.fp8_gemm"]  # one switch, under the first quantized Linear


def test_the_lane_implementations_are_exactly_the_rules_declared_values() -> None:
    from cgbuild_rules import quant

    from cgbuild.identity.quantrule import QUANT_RULES

    declared = QUANT_RULES["fp8-rowwise"].lanes["fp8-gemm"]
    assert set(quant.FP8_GEMM) == set(declared)
    assert {value for axis, value in quant.SETUP if axis == "fp8-gemm"} <= set(declared)


@pytest.mark.parametrize(
    ("values", "words"), [(["scaled-mm", "cutlass"], "unknown"), (["triton", "triton"], "duplicate")]
)
def test_a_trace_spec_naming_a_lane_value_the_rule_lacks_is_refused_by_the_rule(
    values: list, words: str
) -> None:
    """The spec's lanes reach `convert` from a trace job: an unknown or repeated value is the
    rule's named refusal (the trace rule's `entry-error`), never a KeyError during export."""
    import torch
    from cgbuild_rules import quant
    from torch import nn

    with pytest.raises(quant.QuantError, match=rf"fp8-gemm: {words} lane value '(cutlass|triton)'"):
        quant.convert(nn.Sequential(nn.Linear(32, 16)), "fp8-rowwise", torch.bfloat16, {"fp8-gemm": values})
