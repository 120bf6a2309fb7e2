"""A serving worker's weights: a safetensors checkpoint read straight onto the device, and the
entry's module built around it without initialising (or even allocating) weights of its own.

Random initialisation of a 4 B-parameter model costs ~10 s and is thrown away the moment real
weights load. `module_from_checkpoint` instead runs the entry under the same contexts the trace
rule uses for literals: parameters and persistent buffers are sent to the meta device as they
are registered (no memory, no init), while non-persistent buffers and tensor attributes (rotary
tables, position ids: values the program bakes in) are computed for real on the target device.
The checkpoint's tensors are then ASSIGNED to the module (`load_state_dict(assign=True)`): the
module holds the very tensors `read_checkpoint` put on the device, no copy. A tensor the module
expects and the checkpoint lacks stays on meta, and that is refused by name: serving it would
fail on the first call.

An entry needs nothing special for this: it builds its module as it always does; cgbuild owns
the device and dtype contexts (docs/adopt.md, "Serving from a checkpoint").
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

CheckpointPath = str | os.PathLike[str]


def read_checkpoint(
    paths: CheckpointPath | Iterable[CheckpointPath], device: str | torch.device
) -> dict[str, Any]:
    """Every tensor of one or more safetensors files, read straight onto `device` (no CPU copy
    for CUDA: safetensors maps the file and copies each tensor to the device once)."""
    from safetensors.torch import load_file

    files = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    tensors: dict[str, Any] = {}
    for path in files:
        part = load_file(str(path), device=str(device))
        clash = sorted(set(part) & set(tensors))
        if clash:
            raise ValueError(f"{path}: tensor {clash[0]!r} is also in an earlier file")
        tensors.update(part)
    return tensors


def write_checkpoint(module: nn.Module, path: CheckpointPath) -> Path:
    """The module's state dict as one safetensors file (tied tensors once, under their first name)."""
    from safetensors.torch import save_model

    save_model(module, str(path))
    return Path(path)


def module_from_checkpoint(
    job: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], device: str | torch.device
) -> nn.Module:
    """The entry's module for `job` (a trace job: `cgbuild.protocol.trace.TraceJob.to_json()`),
    weights assigned from `tensors`, literals computed on `device`; nothing initialised."""
    from cgbuild_rules import trace  # the trace rule imports torch.export: only a build pays for it

    parsed = trace.parse_job({**job, "spec": {**job["spec"], "device": torch.device(device).type}})
    fn = trace.load_entry(parsed.entry, parsed.root)
    with trace.default_dtype(parsed.dtype), torch.no_grad(), trace.weights_on_meta(), torch.device(device):
        module = trace.call_entry(fn, parsed.spec, parsed.quant).module
    missing, unexpected = module.load_state_dict(dict(tensors), strict=False, assign=True)
    if unexpected:
        raise ValueError(f"the checkpoint has tensors the module does not: {sorted(unexpected)[:5]}")
    still_meta = [name for name, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if still_meta:
        raise ValueError(
            f"the checkpoint lacks tensors the module needs: {sorted(still_meta)[:5]}"
            + (" (tied weights are saved once: re-tie them in the entry)" if missing else "")
        )
    return module.eval()
