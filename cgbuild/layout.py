"""The `layout` key axis: quant(topology), identified by a digest pair.

TOPOLOGY is which tensors a module has (name, dtype, shape), read mechanically from a reference
checkpoint's safetensors HEADER (never its data) or, when no reference is declared, from the
traced module's own state dict. QUANT RULE is a versioned record whose convention facts are its
identity. Display names (`flux2-klein.transformer@1+plain.bf16@1`) are for people and never parsed:
only the digests enter the key, so renaming a family moves nothing.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .canon import digest
from .errors import UserError

TOPOLOGY_SCHEME = 1


@dataclass(frozen=True)
class QuantRule:
    name: str
    version: int
    dtype: str  # element dtype of the traced module (torch dtype name)
    facts: dict[str, Any]

    @property
    def display(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def digest(self) -> str:
        return digest({"scheme": "cgbuild.quant/1", "version": self.version, "facts": self.facts})


def _plain(element: str) -> dict[str, Any]:
    return {"element": element, "scales": "none", "packing": "none", "eligible": "all", "min_sm": None}


QUANT_RULES: dict[str, QuantRule] = {
    r.name: r
    for r in (
        QuantRule("plain.bf16", 1, "bfloat16", _plain("BF16")),
        QuantRule("plain.fp32", 1, "float32", _plain("F32")),
    )
}

# torch dtype names as the trace reports them → safetensors dtype codes as headers spell them.
SAFETENSORS_DTYPE = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


def topology_digest(tensors: list[list[Any]]) -> str:
    """Digest of a canonical topology: sorted [name, dtype code, shape] rows."""
    return digest({"scheme": f"cgbuild.topology/{TOPOLOGY_SCHEME}", "tensors": sorted(tensors)})


def from_trace(rows: list[list[Any]]) -> list[list[Any]]:
    """Trace topology rows ([fqn, torch dtype, shape]) in safetensors spelling."""
    return [[n, SAFETENSORS_DTYPE.get(d, d.upper()), list(s)] for n, d, s in rows]


def read_header(path: Path) -> dict[str, Any]:
    """The JSON header of one safetensors file, read directly (a short data region is fine)."""
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise UserError("not a safetensors file (shorter than 8 bytes)", file=str(path))
            (length,) = struct.unpack("<Q", head)
            if length > 100 * 1024 * 1024:
                raise UserError(f"safetensors header of {length} bytes is implausible", file=str(path))
            raw = f.read(length)
    except OSError as exc:
        raise UserError(f"cannot read checkpoint: {exc.strerror}", file=str(path)) from None
    if len(raw) != length:
        raise UserError("safetensors header is truncated", file=str(path))
    try:
        header = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise UserError(f"safetensors header is not JSON: {exc.msg}", file=str(path)) from None
    return header


def component_files(reference: Path, component: str) -> list[Path]:
    """The safetensors files of one component: `<ref>/<component>/*.safetensors`,
    `<ref>/<component>.safetensors`, or the reference itself when it is one file."""
    if reference.is_file():
        return [reference]
    folder = reference / component
    if folder.is_dir():
        files = sorted(folder.glob("*.safetensors"))
        if files:
            return files
    single = reference / f"{component}.safetensors"
    if single.is_file():
        return [single]
    raise UserError(
        f"reference checkpoint has no component '{component}' "
        f"(looked for {component}/*.safetensors and {component}.safetensors)",
        file=str(reference),
    )


def topology_from_reference(reference: Path, component: str) -> list[list[Any]]:
    rows: list[list[Any]] = []
    for path in component_files(reference, component):
        for name, info in read_header(path).items():
            if name == "__metadata__":
                continue
            rows.append([name, info["dtype"], list(info["shape"])])
    return rows


def layout_axis(
    family: str, component: str, quant: QuantRule, topology: str, source: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(identity, readable) blocks of the layout axis; identity holds digests only."""
    identity = {"topology": topology, "quant": quant.digest}
    stamp = f"{family}.{component}@{TOPOLOGY_SCHEME}+{quant.display}"
    readable = {**identity, "stamp": stamp, "topology_source": source, "quant_rule": quant.display}
    return identity, readable
