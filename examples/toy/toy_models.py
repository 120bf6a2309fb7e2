"""Toy family: two tiny modules that trace and compile in seconds, for tests and CI.

Entry: `toy_models:build`. Config (all optional):
    hidden = 128          # mlp hidden width
    out = 10              # output features of both modules
    channels = 16         # conv channels
    dynamic_batch = [2, 16]   # mlp only: export the batch dimension as a symbol in [min, max]
    chunks = 16           # the `chunked` lane's number of output-feature blocks (at most)

Lanes (`LANES`, read by cgbuild without importing this file): one axis, `linear`, applied to every
plain `nn.Linear` of both modules (a layer a quant rule replaced runs its own forward):
- `baseline`: one `F.linear` (the reference);
- `chunked`: the weight's rows (output features) in up to `chunks` equal blocks, one matmul each, then a
  concatenation: more kernel launches and a second copy of the output, so slower and a little
  larger at these sizes; both run on the CPU, so CI measures a real verdict;
- `triton`: a Triton kernel registered with `torch.library.triton_op`; needs a CUDA device and
  triton, so on a CPU target it is not compiled in and never a candidate. AOTInductor compiles
  the kernel itself into the package; nothing of this file is needed to run it there.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from cgbuild_rules.lanes import LaneSwitch
from torch import nn

DEFAULTS: dict[str, Any] = {"hidden": 128, "out": 10, "channels": 16, "dynamic_batch": None, "chunks": 16}

LANES = {
    "linear": {
        "baseline": {},
        "chunked": {},
        "triton": {"device": "cuda", "triton": True},
    },
}


def baseline_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight, bias)


def chunked_linear(blocks: int) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The weight's rows in `blocks` EQUAL blocks (the caller picks a divisor): uneven blocks
    beside a Triton branch of the same torch.cond failed to export on torch 2.11 (a data-dependent
    guard), equal ones export."""

    def run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        parts = zip(weight.chunk(blocks, dim=0), bias.chunk(blocks, dim=0), strict=True)
        return torch.cat([F.linear(x, w, b) for w, b in parts], dim=-1)

    return run


@functools.cache
def triton_linear() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """`toy::triton_linear`, registered on first use (only a CUDA target with triton asks)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x, w, b, y, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(
                x + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0
            )
            bt = tl.load(
                w + rn[None, :] * K + rk[:, None], mask=(rn[None, :] < N) & (rk[:, None] < K), other=0.0
            )
            acc += tl.dot(a.to(tl.float32), bt.to(tl.float32), input_precision="ieee")
        acc += tl.load(b + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(
            y + rm[:, None] * N + rn[None, :],
            acc.to(y.dtype.element_ty),
            mask=(rm[:, None] < M) & (rn[None, :] < N),
        )

    @torch.library.triton_op("toy::triton_linear", mutates_args=())
    def op(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """rows [M, K] (contiguous) @ weight [N, K]^T + bias [N]."""
        m, k = rows.shape
        n = weight.shape[0]
        out = torch.empty((m, n), device=rows.device, dtype=rows.dtype)

        def grid(meta: dict[str, Any]) -> tuple[int, int]:
            return (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))

        torch.library.wrap_triton(kernel)[grid](
            rows, weight, bias, out, m, n, k, BLOCK_M=16, BLOCK_N=32, BLOCK_K=32
        )
        return out

    def run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        return op(rows, weight.contiguous(), bias.contiguous()).reshape(*x.shape[:-1], weight.shape[0])

    return run


class Lanes(nn.Module):
    """The family's lane switch(es): one `LaneSwitch` per axis, shared by every layer it covers."""

    def __init__(self, lanes: dict[str, list[str]] | None, chunks: int) -> None:
        super().__init__()
        self.linear = LaneSwitch("linear", (lanes or {}).get("linear") or ["baseline"])
        self.chunks = chunks
        self._impls: dict[str, Callable[..., torch.Tensor]] = {"baseline": baseline_linear}
        if "triton" in self.linear.values:
            self._impls["triton"] = triton_linear()

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """`layer(x)` through the linear lane when it is a plain Linear with a bias."""
        if type(layer) is nn.Linear and layer.bias is not None:
            blocks = math.gcd(layer.out_features, self.chunks)  # 128 → 16 blocks, 10 → 2
            impls = {**self._impls, "chunked": chunked_linear(blocks)}
            return self.linear.select(impls, x, layer.weight, layer.bias)
        return layer(x)


class MLP(nn.Module):
    """Linear → GELU → Linear over the last (feature) dimension."""

    def __init__(
        self,
        features: int,
        hidden: int,
        out: int,
        lanes: dict[str, list[str]] | None = None,
        chunks: int = 16,
    ) -> None:
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, out)
        self.lanes = Lanes(lanes, chunks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lanes.apply(self.fc2, self.act(self.lanes.apply(self.fc1, x)))


class ConvNet(nn.Module):
    """conv → batchnorm → relu → strided conv → relu → global mean → linear."""

    def __init__(
        self, channels: int, out: int, lanes: dict[str, list[str]] | None = None, chunks: int = 16
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=2, padding=1)
        self.head = nn.Linear(channels, out)
        self.lanes = Lanes(lanes, chunks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv1(x)))
        x = torch.relu(self.conv2(x))
        return self.lanes.apply(self.head, x.mean(dim=(2, 3)))


def build(spec: dict[str, Any]) -> tuple[Any, ...]:
    """mlp: input (batch, height, width), features = width. conv: input (batch, 3, height, width)."""
    config = dict(spec.get("config") or {})
    unknown = sorted(set(config) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown toy config keys {unknown} (known: {sorted(DEFAULTS)})")
    cfg = DEFAULTS | config
    batch, height, width = int(spec["batch"]), int(spec["height"]), int(spec["width"])
    lanes, chunks = spec.get("lanes"), int(cfg["chunks"])
    if spec["module"] == "mlp":
        model: nn.Module = MLP(width, int(cfg["hidden"]), int(cfg["out"]), lanes, chunks)
        if cfg["dynamic_batch"] is not None:
            lo, hi = (int(v) for v in cfg["dynamic_batch"])
            # A size-1 example would be specialized away by export: trace with at least 2.
            example = min(max(batch, lo, 2), hi)
            dims = {"x": {0: torch.export.Dim("batch", min=lo, max=hi)}}
            return model, (torch.randn(example, height, width),), {}, dims
        return model, (torch.randn(batch, height, width),), {}
    if spec["module"] == "conv":
        model = ConvNet(int(cfg["channels"]), int(cfg["out"]), lanes, chunks)
        return model, (torch.randn(batch, 3, height, width),), {}
    raise ValueError(f"toy has modules 'mlp' and 'conv', not {spec['module']!r}")
