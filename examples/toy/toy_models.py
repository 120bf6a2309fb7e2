"""Toy family: two tiny modules that trace and compile in seconds, for tests and CI.

Entry: `toy_models:build`. Config (all optional):
    hidden = 128          # mlp hidden width
    out = 10              # output features of both modules
    channels = 16         # conv channels
    dynamic_batch = [2, 16]   # mlp only: export the batch dimension as a symbol in [min, max]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

DEFAULTS: dict[str, Any] = {"hidden": 128, "out": 10, "channels": 16, "dynamic_batch": None}


class MLP(nn.Module):
    """Linear → GELU → Linear over the last (feature) dimension."""

    def __init__(self, features: int, hidden: int, out: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ConvNet(nn.Module):
    """conv → batchnorm → relu → strided conv → relu → global mean → linear."""

    def __init__(self, channels: int, out: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=2, padding=1)
        self.head = nn.Linear(channels, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv1(x)))
        x = torch.relu(self.conv2(x))
        return self.head(x.mean(dim=(2, 3)))


def build(spec: dict[str, Any]) -> tuple[Any, ...]:
    """mlp: input (batch, height, width), features = width. conv: input (batch, 3, height, width)."""
    config = dict(spec.get("config") or {})
    unknown = sorted(set(config) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown toy config keys {unknown} (known: {sorted(DEFAULTS)})")
    cfg = DEFAULTS | config
    batch, height, width = int(spec["batch"]), int(spec["height"]), int(spec["width"])
    if spec["module"] == "mlp":
        model: nn.Module = MLP(width, int(cfg["hidden"]), int(cfg["out"]))
        if cfg["dynamic_batch"] is not None:
            lo, hi = (int(v) for v in cfg["dynamic_batch"])
            # A size-1 example would be specialized away by export: trace with at least 2.
            example = min(max(batch, lo, 2), hi)
            dims = {"x": {0: torch.export.Dim("batch", min=lo, max=hi)}}
            return model, (torch.randn(example, height, width),), {}, dims
        return model, (torch.randn(batch, height, width),), {}
    if spec["module"] == "conv":
        model = ConvNet(int(cfg["channels"]), int(cfg["out"]))
        return model, (torch.randn(batch, 3, height, width),), {}
    raise ValueError(f"toy has modules 'mlp' and 'conv', not {spec['module']!r}")
