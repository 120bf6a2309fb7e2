"""The fused QK RMSNorm + rotary embedding op (`cgbuild_rules.qk_rope`), on a machine without a GPU.

- Under Triton's CPU interpreter (with the GPU's fp32 → bf16 rounding, `support.triton_child`)
  the op is held to diffusers' own path (`attn.norm_q` … then `apply_rotary_emb`) on real FLUX.2
  attention modules with random weights: a double-stream `Flux2Attention` (7 text tokens, their
  own norms, then 7 × 9 image tokens: 70, not a multiple of the 32-token block) and a
  single-stream `Flux2ParallelSelfAttention` (45 tokens), q and k read in place from the
  projections' outputs. Bound: every element within one bf16 ulp of the reference; the two
  round at the same two points, and the interpreter measures 0. (On a GPU, `rsqrt.approx` and
  another summation order may move the norm's rounding by one ulp, which the rotation can carry
  into a near-zero output: hold a GPU run to one ulp of the row's magnitude.) Each guard is
  shown to matter on these inputs: the reference with eps dropped, with the norms' weights
  ignored, with text and image weights swapped, with rotate-half pairing (diffusers' other real
  variant) or with sin's sign flipped lies many ulps away. Head 1's projections are scaled down
  so its mean square is of eps's order.
- The kernel compiles for sm_90 with Triton's own compiler, both variants, without spills.
- `torch.export` keeps the op as one node, and the op refuses inputs the kernel is not built for.
- benchmarks/attention_gpu.py's `--tiny --only qk_rope` rehearsal runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from cgbuild_rules import qk_rope
from support.triton_child import run

pytest.importorskip("triton")
pytest.importorskip("diffusers")

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "attention_gpu.py"

ACCURACY = textwrap.dedent(
    """
    import copy, json
    import torch
    from support.triton_child import gpu_rounding
    gpu_rounding()
    from diffusers.models.embeddings import apply_rotary_emb
    from diffusers.models.transformers.transformer_flux2 import (
        Flux2Attention, Flux2ParallelSelfAttention, Flux2PosEmbed)
    from cgbuild_rules import qk_rope

    torch.manual_seed(0)
    HEADS, D, TEXT, ROWS, COLS = 2, 128, 7, 7, 9

    def ulps(got, want):
        spacing = 2.0 ** (torch.frexp(want.float())[1] - 8).float()
        return float(((got.float() - want.float()).abs() / spacing).max())

    def rotary(text):
        grid = torch.meshgrid(torch.arange(ROWS), torch.arange(COLS), indexing="ij")
        image = torch.stack([torch.zeros(ROWS * COLS), grid[0].flatten(), grid[1].flatten(),
                             torch.zeros(ROWS * COLS)], -1)
        words = torch.stack([torch.zeros(text)] * 3 + [torch.arange(text)], -1)
        return Flux2PosEmbed(2000, [32, 32, 32, 32])(torch.cat([words, image]).float())

    def randomized(attn, projections):
        for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            if hasattr(attn, name):
                torch.nn.init.normal_(getattr(attn, name).weight, 1.0, 0.5)
        with torch.no_grad():
            for weight, groups in projections(attn):
                weight.view(groups, HEADS, D, -1)[:, 1] *= 0.05
        return attn.bfloat16()

    def joint():
        attn = Flux2Attention(256, HEADS, D, added_kv_proj_dim=256, eps=1e-3)
        projections = lambda a: [(p.weight, 1) for p in (a.to_q, a.to_k, a.add_q_proj, a.add_k_proj)]
        attn = randomized(attn, projections)
        hidden = torch.randn(2, ROWS * COLS, 256).bfloat16()
        words = torch.randn(2, TEXT, 256).bfloat16()
        heads = lambda x: x.unflatten(-1, (HEADS, D))
        qk = heads(attn.to_q(hidden)), heads(attn.to_k(hidden))
        return attn, qk, (heads(attn.add_q_proj(words)), heads(attn.add_k_proj(words))), rotary(TEXT)

    def single():
        attn = Flux2ParallelSelfAttention(256, HEADS, D, eps=1e-3, mlp_ratio=2.0)
        attn = randomized(attn, lambda a: [(a.to_qkv_mlp_proj.weight[: 2 * HEADS * D], 2)])
        projected = attn.to_qkv_mlp_proj(torch.randn(1, ROWS * COLS - 18, 256).bfloat16())
        q, k, _ = projected[..., : 3 * HEADS * D].unflatten(-1, (-1, HEADS, D)).unbind(-3)
        return attn, (q, k), None, tuple(x[18:] for x in rotary(0))

    def broken(attn, qk, text, cos_sin):
        def edited(edit):
            other = copy.deepcopy(attn)
            edit(other)
            return qk_rope.reference(other, *qk, cos_sin, text)

        def no_eps(a):
            for m in a.modules():
                if isinstance(m, torch.nn.RMSNorm):
                    m.eps = 0.0

        def no_weight(a):
            for m in a.modules():
                if isinstance(m, torch.nn.RMSNorm):
                    m.weight.data.fill_(1.0)

        def swapped(a):
            a.norm_q, a.norm_added_q = a.norm_added_q, a.norm_q
            a.norm_k, a.norm_added_k = a.norm_added_k, a.norm_k

        out = {"eps": edited(no_eps), "weight": edited(no_weight),
               "sin_sign": qk_rope.reference(attn, *qk, (cos_sin[0], -cos_sin[1]), text)}
        if text:
            out["text_weight"] = edited(swapped)
        normed = [attn.norm_q(x) for x in qk]
        if text:
            added = attn.norm_added_q(text[0]), attn.norm_added_k(text[1])
            normed = [torch.cat([t, x], 1) for t, x in zip(added, normed)]
        rotate_half = lambda x: apply_rotary_emb(x, cos_sin, use_real_unbind_dim=-2, sequence_dim=1)
        out["rotate_half"] = [rotate_half(x).transpose(1, 2) for x in normed]
        return out

    result = {}
    with torch.no_grad():
        for name, case in (("joint", joint), ("single", single)):
            attn, qk, text, cos_sin = case()
            got = qk_rope.apply(attn, *qk, cos_sin, text)
            want = qk_rope.reference(attn, *qk, cos_sin, text)
            result[name] = {
                "shape": list(got[0].shape),
                "strided": not qk[0].is_contiguous(),
                "ulps": [ulps(g, w) for g, w in zip(got, want)],
                "broken": {b: min(ulps(x, w) for x, w in zip(xs, want))
                           for b, xs in broken(attn, qk, text, cos_sin).items()},
            }
    print(json.dumps(result))
    """
)

COMPILE = textwrap.dedent(
    """
    import json, re
    import triton
    from triton.backends.compiler import GPUTarget
    from cgbuild_rules import qk_rope
    names = ["q", "k", "q_text", "k_text", "q_weight", "k_weight", "q_text_weight", "k_text_weight",
             "cos", "sin", "q_out", "k_out"]
    sig = {n: "*fp32" if n in ("cos", "sin") else "*bf16" for n in names}
    sig |= {n: "i32" for n in ("N", "T", "H", "stride_b", "stride_s", "stride_h", "text_stride_b",
                               "text_stride_s", "text_stride_h")}
    sig |= {"eps": "fp32", "D": "constexpr", "BS": "constexpr", "TEXT": "constexpr"}
    # what a launch with klein's tensors specializes: 16-byte aligned pointers, strides of 16s
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if n in names or "stride" in n}
    out = {}
    for text in (True, False):
        consts = {"D": qk_rope.HEAD_DIM, "BS": qk_rope.BLOCK_S, "TEXT": text}
        src = triton.compiler.ASTSource(fn=qk_rope.kernel(), signature=sig, constexprs=consts, attrs=aligned)
        done = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": qk_rope.NUM_WARPS})
        ptx = done.asm["ptx"]
        out[f"text={text}"] = {
            "loads": sorted(set(re.findall(r"ld\\.global(?:\\.\\w+)*\\.v\\d\\.b\\d+", ptx))),
            "stores": sorted(set(re.findall(r"st\\.global(?:\\.\\w+)*\\.v\\d\\.b\\d+", ptx))),
            "spills": ".local" in ptx,
        }
    print(json.dumps(out))
    """
)


def test_op_under_the_interpreter_matches_diffusers_norm_and_rotary_within_one_bf16_ulp() -> None:
    result = run(ACCURACY, interpret=True)
    assert result["joint"]["shape"] == [2, 2, 70, 128]
    assert result["single"]["shape"] == [1, 2, 45, 128]
    assert result["single"]["strided"], "q and k are read in place from the fused projection"
    for case in result.values():
        assert max(case["ulps"]) <= 1.0, case
        for guard, distance in case["broken"].items():
            assert distance > 4.0, (guard, case)  # the inputs tell each broken formula apart
    assert set(result["joint"]["broken"]) == {"eps", "weight", "sin_sign", "text_weight", "rotate_half"}


def test_kernel_compiles_for_sm90_with_vector_loads_and_stores_and_no_spills() -> None:
    result = run(COMPILE, interpret=False)
    for variant in ("text=True", "text=False"):
        r = result[variant]
        assert not r["spills"], r
        assert "st.global.v4.b32" in r["stores"], r  # 8 bf16 channels a store
        assert any(".v4.b32" in load for load in r["loads"]), r


class Norms(torch.nn.Module):
    """The four RMSNorms of a double-stream FLUX.2 attention, under diffusers' names."""

    def __init__(self, eps_q: float = 1e-6, eps_k: float = 1e-6) -> None:
        super().__init__()
        self.norm_q, self.norm_added_q = torch.nn.RMSNorm(128, eps_q), torch.nn.RMSNorm(128, eps_q)
        self.norm_k, self.norm_added_k = torch.nn.RMSNorm(128, eps_k), torch.nn.RMSNorm(128, eps_k)


def _bf16(*shape: int) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.bfloat16)


@pytest.mark.parametrize("text", [0, 5])
def test_export_keeps_the_op_as_one_node(text: int) -> None:
    class Block(Norms):
        def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> Any:
            words = (q[:, :text], k[:, :text]) if text else None
            return qk_rope.apply(self, q[:, text:], k[:, text:], (cos, cos.flip(0)), words)

    program = torch.export.export(Block(), (_bf16(1, 40, 2, 128), _bf16(1, 40, 2, 128), torch.randn(40, 128)))
    calls = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert calls.count("cgbuild.qk_norm_rope_v1.default") == 1, calls
    own = [c for c in calls if not c.startswith(("aten.slice", "aten.alias", "aten.flip"))]
    # nothing of the norms, the concatenation or the rotation outside the op
    assert own == ["cgbuild.qk_norm_rope_v1.default", *["<built-in function getitem>"] * 2], calls


@pytest.mark.parametrize(
    ("q", "k", "words", "cos_rows", "refusal"),
    [
        ((1, 40, 2, 64), (1, 40, 2, 64), 0, 40, "head dim 128, not 64"),
        ((1, 40, 2, 128), (1, 40, 3, 128), 0, 40, "share one shape"),
        ((1, 40, 2, 128), (1, 40, 2, 128), 0, 41, r"cos and sin must be \[40, 128\]"),
        ((1, 40, 2, 128), (1, 40, 2, 128), 5, 45, r"text q and k must be \[1, T, 2, 128\]"),
        ((1, 40, 2, 128), (1, 2, 40, 128), 0, 40, "share strides"),
    ],
)
def test_the_op_refuses_inputs_the_kernel_is_not_built_for(
    q: tuple[int, ...], k: tuple[int, ...], words: int, cos_rows: int, refusal: str
) -> None:
    key = _bf16(*k).transpose(1, 2) if k[1] < k[2] else _bf16(*k)  # (1, 2, 40, 128): other strides
    text = (_bf16(1, words, 3, 128), _bf16(1, words, 3, 128)) if words else None
    cos = torch.randn(cos_rows, q[-1])
    with pytest.raises(ValueError, match=refusal):
        qk_rope.apply(Norms(), _bf16(*q), key, (cos, cos), text)


def test_the_norms_must_share_one_eps() -> None:
    q, cos = _bf16(1, 40, 2, 128), torch.randn(40, 128)
    with pytest.raises(ValueError, match="share one eps"):
        qk_rope.apply(Norms(eps_k=1e-5), q, q, (cos, cos))


def test_the_gpu_benchmark_rehearses_under_the_interpreter(tmp_path: Path) -> None:
    out = tmp_path / "qk_rope.json"
    command = [sys.executable, str(BENCHMARK), "--tiny", "--only", "qk_rope", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {(row["block"], row["impl"]): row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(b, i) for b in ("single", "joint") for i in ("qk_rope_op", "qk_rope_eager")}
    # the interpreter truncates to bf16 where the GPU rounds: about one ulp of error, not zero
    assert all(row["rel_vs_eager"] < 0.01 for row in rows.values()), rows
