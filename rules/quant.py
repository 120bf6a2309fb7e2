"""The torch side of the quant rules: module transforms that produce exactly the tensors a rule emits.

The records (facts, floors, identity) live in `cgbuild.identity.quantrule`; this module implements them and is
keyed by the same names. `convert(module, rule, dtype)` replaces every eligible `nn.Linear` (2-D
weight, both dimensions multiples of 16) by a quantized module IN PLACE of it, so the FQNs stay
the module's own (`<fqn>.weight`, `<fqn>.weight_scale`, `<fqn>.bias`): what a quantized checkpoint
carries, what the trace binds and what adopt checks. The trace applies it BEFORE export, so the
graph digest is the quantized program's.

The transform quantizes whatever weights the module holds: real random weights (mint
verification, reference checkpoints), fake tensors (digests) or meta tensors (weightless
compiles) alike, so one code path serves every build mode. A serving process uses the same
`convert` to give its live module the layout's tensors, then loads a quantized checkpoint into it
(or keeps the quantized values of the weights it had).

- `int8-rowwise`: int8 weight [out, in] + fp32 `weight_scale` [out] (absmax/127 per output row,
  symmetric). Dequantized IN the graph: (weight → fp32) × scale per row → compute dtype, then
  `linear`. Activations stay in the compute dtype. Runs wherever `linear` runs (CPU and CUDA).
- `fp8-rowwise`: float8_e4m3fn weight [out, in] + fp32 `weight_scale` [out] (absmax/448). Each
  call quantizes its activations per row (token) to float8_e4m3fn with an fp32 scale and runs
  `torch._scaled_mm` with row-wise scales (W8A8 on fp8 tensor cores, out in bf16). No dequantize
  fallback: a device the kernel cannot run on is refused at plan time and probed at mint.
  The rule owns the lane axis `fp8-gemm` (`scaled-mm`, or `triton`: `cgbuild_rules.fp8_gemm`, the
  activation quantization fused into the GEMM). When the spec's lanes carry it, `convert`
  registers ONE `LaneSwitch` (as `fp8_gemm` under the first converted Linear) and every converted
  Linear routes its matmul through it; without it the module is the plain `scaled-mm` program.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from cgbuild_rules.lanes import LaneSwitch
from torch import nn

from cgbuild.identity.quantrule import QUANT_RULES

MULTIPLE = 16
INT8_MAX = 127
FP8_MAX = 448.0  # largest finite float8_e4m3fn
ACT_SCALE_FLOOR = 1e-12


class QuantError(ValueError):
    """A rule cannot be applied as asked (unknown rule, compute dtype it does not allow)."""


def eligible(module: nn.Module) -> bool:
    """A plain `nn.Linear` whose weight is 2-D with both dimensions multiples of 16."""
    if not isinstance(module, nn.Linear):
        return False
    w = module.weight
    return w.dim() == 2 and w.shape[0] % MULTIPLE == 0 and w.shape[1] % MULTIPLE == 0


def quantize_rows(weight: torch.Tensor, element: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(quantized weight, fp32 scale per output row) for int8 or float8_e4m3fn, symmetric absmax."""
    w = weight.detach().to(torch.float32)
    qmax = INT8_MAX if element == torch.int8 else FP8_MAX
    scale = (w.abs().amax(dim=1) / qmax).clamp_min(torch.finfo(torch.float32).tiny)
    q = w / scale[:, None]
    q = q.round().clamp(-INT8_MAX, INT8_MAX) if element == torch.int8 else q.clamp(-FP8_MAX, FP8_MAX)
    return q.to(element), scale


class _RowwiseLinear(nn.Module):
    """Shared storage of the row-wise rules: weight [out, in], weight_scale [out] fp32, bias."""

    element: torch.dtype

    def __init__(
        self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
    ):
        super().__init__()
        self.in_features = int(weight.shape[1])
        self.out_features = int(weight.shape[0])
        self.compute = dtype
        # Parameters (frozen) rather than buffers, as nn.Linear's own: the same FQNs, and
        # `module.to(device)` moves them while leaving the element types alone.
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype) -> _RowwiseLinear:
        q, scale = quantize_rows(linear.weight, cls.element)
        return cls(q, scale, linear.bias, dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, compute={self.compute}"
        )


class Int8RowwiseLinear(_RowwiseLinear):
    """`int8-rowwise`: dequantize in the graph, then `linear` in the compute dtype."""

    element = torch.int8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = (self.weight.to(torch.float32) * self.weight_scale[:, None]).to(self.compute)
        return F.linear(x, w, self.bias)


def _row_scale(rows: torch.Tensor) -> torch.Tensor:
    """fp32 [M, 1]: absmax(row) / 448, floored (the rule's activation scale)."""
    return (rows.abs().amax(dim=1, keepdim=True).to(torch.float32) / FP8_MAX).clamp_min(ACT_SCALE_FLOOR)


def _quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 rows [M, K] → (e4m3 rows, fp32 [M, 1] scales): the rule's activation quantization."""
    x_scale = _row_scale(rows)
    return (rows / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), x_scale


def scaled_mm_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *bias: torch.Tensor
) -> torch.Tensor:
    """`scaled-mm`: quantize x per row (its own kernel), then row-wise `torch._scaled_mm`, which
    takes row-major operands only (a pipeline's transposed hidden states are copied first)."""
    xq, x_scale = _quantize_rows(x.reshape(-1, x.shape[-1]).contiguous().to(torch.float32))
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale[None, :], out_dtype=x.dtype)
    if bias:
        out = out + bias[0]
    return out.reshape(*x.shape[:-1], weight.shape[0])


def triton_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *bias: torch.Tensor
) -> torch.Tensor:
    """`triton`: the row scales, then one fused GEMM (`cgbuild_rules.fp8_gemm`; `convert`
    registered the op: a `torch.cond` branch is traced by dynamo, even eagerly, and must only call it)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    b = bias[0] if bias else x.new_empty(0)
    op = torch.ops.cgbuild.fp8_rowwise_linear_v1
    out: torch.Tensor = op(rows, _row_scale(rows).reshape(-1), weight, weight_scale, b)
    return out.reshape(*x.shape[:-1], weight.shape[0])


FP8_GEMM = {"scaled-mm": scaled_mm_linear, "triton": triton_linear}
"""The `fp8-gemm` lane's implementations, by value (the rule's record lists the same values)."""


def _register_fp8_gemm_op() -> None:
    from cgbuild_rules.fp8_gemm import op

    op()  # registers cgbuild::fp8_rowwise_linear_v1


SETUP = {("fp8-gemm", "triton"): _register_fp8_gemm_op}
"""(axis, value) → what must run before a switch carrying that value is built (a custom op to
register: a `torch.cond` branch may only call it)."""


class Fp8RowwiseLinear(_RowwiseLinear):
    """`fp8-rowwise`: per-row fp8 activations × fp8 weights on fp8 tensor cores.

    The matmul goes through the `fp8-gemm` switch when `convert` attached one (held by reference:
    the switch is registered once, under the first converted Linear), else `scaled-mm`.
    """

    element = torch.float8_e4m3fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.compute)
        operands = (x, self.weight, self.weight_scale, *(() if self.bias is None else (self.bias,)))
        lane: LaneSwitch | None = self.__dict__.get("lane")
        if lane is None:
            return scaled_mm_linear(*operands)
        return cast(torch.Tensor, lane.select(FP8_GEMM, *operands))


MODULES: dict[str, type[_RowwiseLinear]] = {
    "int8-rowwise": Int8RowwiseLinear,
    "fp8-rowwise": Fp8RowwiseLinear,
}


def convert(
    module: nn.Module, rule: str, dtype: torch.dtype, lanes: Mapping[str, Sequence[str]] | None = None
) -> tuple[nn.Module, list[str]]:
    """Apply `rule` to `module` (in place where possible); returns (module, FQNs quantized).

    Plain rules change nothing. The root itself is replaced when it is an eligible Linear, which
    is why the (possibly new) module is returned. `lanes` (a trace spec's) gives the values of the
    rule's own lane axes to compile in; a serving process passes none (adopt binds the artifact's
    switch; the module's eager fallback then runs the axis's first value).
    """
    record = QUANT_RULES.get(rule)
    if record is None:
        raise QuantError(f"unknown quant rule {rule!r} (known: {', '.join(sorted(QUANT_RULES))})")
    name = str(dtype).removeprefix("torch.")
    if name not in record.compute:
        raise QuantError(f"quant rule {rule!r} computes in {' or '.join(record.compute)}, not {name}")
    if not record.transforms:
        return module, []
    cls = MODULES.get(rule)
    if cls is None:
        raise QuantError(
            f"quant rule {rule!r} rewrites modules but has no transform here (rules/quant.py MODULES)"
        )
    chosen = {axis: list((lanes or {}).get(axis) or []) for axis in record.lanes}
    for axis, values in chosen.items():
        unknown = [v for v in values if v not in record.lanes[axis]]
        if unknown or len(set(values)) != len(values):
            bad = unknown[0] if unknown else next(v for v in values if values.count(v) > 1)
            raise QuantError(
                f"{axis}: {'unknown' if unknown else 'duplicate'} lane value {bad!r} "
                f"(quant rule {rule!r} provides: {', '.join(record.lanes[axis])})"
            )
    done: list[str] = []
    if eligible(module):
        module, done = cls.from_linear(module, dtype), [""]  # type: ignore[arg-type]
    else:
        for fqn, child in list(module.named_modules()):
            if fqn and eligible(child):
                parent_name, _, attr = fqn.rpartition(".")
                parent = module.get_submodule(parent_name) if parent_name else module
                setattr(parent, attr, cls.from_linear(child, dtype))
                done.append(fqn)
    for axis, values in chosen.items():
        if values and done:
            for value in values:
                SETUP.get((axis, value), lambda: None)()
            _attach(module, done, LaneSwitch(axis, values))
    return module, done


def _attach(module: nn.Module, done: list[str], switch: LaneSwitch) -> None:
    """Register `switch` once, under the first quantized module (not the root: a Sequential root
    calls every child), and hand it to every quantized module (`done`) by reference."""
    quantized = [module.get_submodule(fqn) for fqn in done]
    quantized[0].add_module(switch.axis.replace("-", "_"), switch)
    for child in quantized:
        child.__dict__["lane"] = switch


def probe(rule: str, device: torch.device | str) -> tuple[bool, str]:
    """Run the rule's kernel once on a real device and compare it with its emulation in fp32.

    For rules without a device-specific kernel there is nothing to probe. Used by the mint on
    the card itself: the plan's floor is a reading of torch's history; this is the measurement.
    """
    record = QUANT_RULES[rule]
    if record.facts.get("capability") != "scaled_mm-rowwise":
        return True, f"{record.display} has no device-specific kernel"
    dev = torch.device(device)
    try:
        gen = torch.Generator().manual_seed(0)
        lin = nn.Linear(64, 32, dtype=torch.float32)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(32, 64, generator=gen))
            lin.bias.copy_(torch.randn(32, generator=gen))
        q = Fp8RowwiseLinear.from_linear(lin, torch.bfloat16).to(dev)
        x = torch.randn(16, 64, generator=gen).to(dev, torch.bfloat16)
        with torch.no_grad():
            got = q(x).float()
            q_rows, x_scale = _quantize_rows(x.float())
            xq = q_rows.float() * x_scale
            w = q.weight.float() * q.weight_scale[:, None]
            want = xq @ w.t() + q.bias.float()  # type: ignore[union-attr]
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    except Exception as e:  # the kernel is missing or refuses this device
        why = " ".join(str(e).split())[:300]
        return False, f"torch._scaled_mm row-wise failed on {dev}: {type(e).__name__}: {why}"
    err = float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())
    if not err < 2e-2:
        return False, f"torch._scaled_mm row-wise on {dev} is off its emulation by rel-rms {err:.3g}"
    return True, f"torch._scaled_mm row-wise ran on {dev} (rel-rms {err:.2g} against emulation)"
