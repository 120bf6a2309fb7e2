"""Write a workspace's reference checkpoints from its own entries: `python -m cgbuild_rules.reference`.

A layout's `reference` is a safetensors checkpoint whose HEADERS give each component's topology.
The examples ship no checkpoints (weights are never downloaded and never enter a key): this
command builds every module of every family that uses such a layout through the entry's
`build()`, with real random weights (seed 0) on the CPU, applies the layout's quant rule (so an
int8 layout's reference holds int8 weights and fp32 scales, as a real quantized checkpoint
would), and writes `<reference>/<component>.safetensors` — or, with `--shard-mib`, a sharded
`<reference>/<component>/` folder with a `*.safetensors.index.json`, the way large checkpoints
are published. Same entry, same bytes: re-running rewrites nothing.

    python -m cgbuild_rules.reference -C examples/toy [--layout int8] [--shard-mib 1]

A module's weights do not depend on its graph class in these entries; the first graph class of
each module builds it. Two modules (of two families) that would write the same component of
one reference are refused: one file cannot hold two topologies.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from cgbuild_rules import trace
from safetensors.torch import save

from cgbuild.config import cgfile
from cgbuild.config.cgfile import Cgfile
from cgbuild.config.targets import Target, expand
from cgbuild.core import fs
from cgbuild.core.errors import UserError
from cgbuild.identity.topology import INDEX_SUFFIX
from cgbuild.protocol.trace import job_for


def _write_if_changed(path: Path, data: bytes) -> bool:
    if path.is_file() and path.read_bytes() == data:
        return False
    fs.write_atomic(path, data)
    return True


def state_tensors(target: Target, cg: Cgfile) -> dict[str, torch.Tensor]:
    """The module's state dict as the layout stores it: built for real on the CPU, quantized."""
    job = job_for(cg, target).with_id(target.label).to_json()
    job["spec"]["device"] = "cpu"
    built = trace.build(trace.parse_job(job), "real")
    return {k: v.detach().contiguous() for k, v in built.module.state_dict().items()}


def _shards(tensors: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """Greedy shards in name order, each at most `limit` bytes unless one tensor is larger."""
    out: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        n = tensors[name].numel() * tensors[name].element_size()
        if out[-1] and size + n > limit:
            out.append({})
            size = 0
        out[-1][name] = tensors[name]
        size += n
    return out


def write_component(
    reference: Path, component: str, tensors: dict[str, torch.Tensor], shard_bytes: int | None
) -> list[Path]:
    """Write one component; returns the files written or confirmed. Deterministic bytes."""
    if reference.suffix == ".safetensors":
        files = {reference: tensors}
    elif shard_bytes is None:
        files = {reference / f"{component}.safetensors": tensors}
    else:
        parts = _shards(tensors, shard_bytes)
        names = [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]
        folder = reference / component
        files = {folder / name: part for name, part in zip(names, parts, strict=True)}
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": {k: name for name, part in zip(names, parts, strict=True) for k in sorted(part)},
        }
        _write_if_changed(
            folder / f"model{INDEX_SUFFIX}", (json.dumps(index, indent=1, sort_keys=True) + "\n").encode()
        )
    for path, part in files.items():
        _write_if_changed(path, save(dict(sorted(part.items()))))
    return sorted(files)


def write_references(
    root: Path, layouts: Sequence[str] = (), shard_bytes: int | None = None
) -> list[dict[str, Any]]:
    """Write every declared reference of the workspace at `root` (or of the named layouts)."""
    cg = cgfile.load(root / "Cgfile")
    unknown = sorted(set(layouts) - set(cg.layouts))
    if unknown:
        raise UserError(f"no layout {unknown[0]!r} in the Cgfile", file=str(cg.path), field="layout")
    firsts: dict[tuple[str, str, str], Target] = {}
    for t in expand(cg):
        lay = cg.layouts[t.id.layout]
        if lay.reference is None or (layouts and lay.name not in layouts):
            continue
        firsts.setdefault((lay.name, t.id.family, t.id.module), t)
    owners: dict[tuple[Path, str], str] = {}
    written = []
    for (name, family, module), t in firsts.items():
        reference = cg.layouts[name].reference
        assert reference is not None
        where = (reference, t.module.component)
        if where in owners and owners[where] != f"{family}/{module}":
            raise UserError(
                f"layout '{name}': {family}/{module} and {owners[where]} would both write component "
                f"'{t.module.component}' of {reference}",
                file=str(cg.path),
                field=f"layout.{name}.reference",
            )
        owners[where] = f"{family}/{module}"
        tensors = state_tensors(t, cg)
        files = write_component(reference, t.module.component, tensors, shard_bytes)
        written.append(
            {
                "layout": name,
                "family": family,
                "module": module,
                "component": t.module.component,
                "files": [str(p) for p in files],
                "tensors": len(tensors),
                "bytes": sum(p.stat().st_size for p in files),
            }
        )
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cgbuild_rules.reference", description=__doc__.split("\n")[0]
    )
    parser.add_argument("-C", dest="root", default=".", help="the folder holding the Cgfile")
    parser.add_argument("--layout", action="append", default=[], help="only this layout (repeatable)")
    parser.add_argument("--shard-mib", type=float, default=None, help="write sharded folders with an index")
    args = parser.parse_args(argv)
    shard = int(args.shard_mib * (1 << 20)) if args.shard_mib else None
    try:
        written = write_references(Path(args.root), args.layout, shard)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for w in written:
        what = f"{w['layout']}: {w['family']}/{w['module']}"
        print(f"{what} → {', '.join(w['files'])} ({w['tensors']} tensors, {w['bytes']} bytes)")
    if not written:
        print("no layout of this Cgfile declares a reference", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
