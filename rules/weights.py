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

Onto a GPU, a checkpoint is read as its bytes, not tensor by tensor: safetensors' own loader
copies each tensor from the mapped file in pageable memory (7.22 GiB of klein-4B in 1.26 s on
the H200; 0.52 s here, side by side: benchmarks/results/cold_start_gpu_nolanes.json). A few
threads `pread` the data region into pinned staging buffers and copy them asynchronously into
ONE device allocation, and each tensor is a view of it at its header offset (an offset Triton's
16-byte pointer specialisation could not take gets a copy of its own). safetensors still
validates the header against the file before a byte is read.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cgbuild.identity.topology import SAFETENSORS_DTYPE, read_header

CheckpointPath = str | os.PathLike[str]
STAGE_BYTES = 32 << 20
"""One pinned staging buffer; each reading thread has two (one read into while one copies)."""
READERS = 4
ALIGN = 16
"""Device views start on this many bytes: Triton kernels specialise on 16-byte pointers."""
DTYPES = {code: getattr(torch, name) for name, code in SAFETENSORS_DTYPE.items()}
"""safetensors dtype codes → torch dtypes: the layout axis's own table, read backwards."""


def read_checkpoint(
    paths: CheckpointPath | Iterable[CheckpointPath], device: str | torch.device
) -> dict[str, Any]:
    """Every tensor of one or more safetensors files, on `device`: mapped by safetensors on the
    CPU; onto a GPU, one read of each file's bytes into one allocation (`read_onto`)."""
    from safetensors.torch import load_file

    files = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    tensors: dict[str, Any] = {}
    for path in files:
        if torch.device(device).type == "cpu":
            part = load_file(str(path), device="cpu")
        else:
            part = read_onto(path, device)
        clash = sorted(set(part) & set(tensors))
        if clash:
            raise ValueError(f"{path}: tensor {clash[0]!r} is also in an earlier file")
        tensors.update(part)
    return tensors


def read_onto(
    path: CheckpointPath, device: str | torch.device, readers: int = READERS, stage_bytes: int = STAGE_BYTES
) -> dict[str, torch.Tensor]:
    """One safetensors file's tensors as views of one `device` allocation holding its data
    region, read by `readers` threads through staging buffers of `stage_bytes` (pinned for a
    GPU). A file safetensors refuses is refused before anything is allocated."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu"):  # checks every offset against the file
        pass
    header = {k: v for k, v in read_header(Path(path)).items() if k != "__metadata__"}
    unknown = sorted({info["dtype"] for info in header.values()} - set(DTYPES))
    if unknown:
        raise ValueError(f"{path}: dtype {unknown[0]} is not one cgbuild reads")
    # safetensors refuses a file its tensors do not cover to the end: the data region ends there
    size = max((info["data_offsets"][1] for info in header.values()), default=0)
    start = os.path.getsize(path) - size
    blob = torch.empty(size, dtype=torch.uint8, device=torch.device(device))
    per_reader = -(-blob.numel() // max(1, readers))
    step = max(1, -(-per_reader // stage_bytes)) * stage_bytes  # whole stages per reader
    spans = [(lo, min(lo + step, blob.numel())) for lo in range(0, blob.numel(), step)]
    with ThreadPoolExecutor(max(1, len(spans))) as pool:
        list(pool.map(lambda span: _read_span(path, start, blob, span, stage_bytes), spans))
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        lo, hi = info["data_offsets"]
        view = blob[lo:hi] if lo % ALIGN == 0 else blob[lo:hi].clone()
        out[name] = view.view(DTYPES[info["dtype"]]).view(info["shape"])
    return out


def _read_span(
    path: CheckpointPath, start: int, blob: torch.Tensor, span: tuple[int, int], stage_bytes: int
) -> None:
    """Bytes [lo, hi) of the data region into `blob`, staged through two buffers in turn: the
    next read fills one while the device copies the other (its event says when it is free)."""
    cuda = blob.device.type == "cuda"
    stream = torch.cuda.Stream(blob.device) if cuda else None
    size = min(stage_bytes, span[1] - span[0])
    stages = [torch.empty(size, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
    free: list[Any] = [None, None]
    fd = os.open(path, os.O_RDONLY)
    try:
        pos, k = span[0], 0
        while pos < span[1]:
            n = min(size, span[1] - pos)
            if free[k] is not None:
                free[k].synchronize()
            view = stages[k].numpy().data[:n]
            at = start + pos
            while view.nbytes:
                got = os.preadv(fd, [view], at)
                if got <= 0:
                    raise ValueError(f"{path}: the file ends inside its data region")
                view, at = view[got:], at + got
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                blob[pos : pos + n].copy_(stages[k][:n], non_blocking=cuda)
                if stream is not None:
                    free[k] = torch.cuda.Event()
                    free[k].record(stream)
            pos, k = pos + n, 1 - k
        if stream is not None:
            stream.synchronize()
    finally:
        os.close(fd)


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
