"""Topology: which tensors a module has (name, dtype, shape), read mechanically from a reference
checkpoint's safetensors HEADER (never its data) or from the traced module's own state dict.

Both sources render the same canonical rows, so a reference that agrees with the traced module
gives the same digest as the trace. Every safetensors header cgbuild and its rules read comes
through `read_header`, bounded in size and depth.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cgbuild.core import fs, jsonfile
from cgbuild.core.canon import digest
from cgbuild.core.errors import UserError

TOPOLOGY_SCHEME = 1
INDEX_SUFFIX = ".safetensors.index.json"

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


def safetensors_dtype(torch_name: str) -> str:
    return SAFETENSORS_DTYPE.get(torch_name, torch_name.upper())


def topology_digest(tensors: list[list[Any]]) -> str:
    """Digest of a canonical topology: sorted [name, dtype code, shape] rows."""
    return digest({"scheme": f"cgbuild.topology/{TOPOLOGY_SCHEME}", "tensors": sorted(tensors)})


def from_trace(rows: list[list[Any]]) -> list[list[Any]]:
    """Trace topology rows ([fqn, torch dtype, shape]) in safetensors spelling."""
    return [[n, safetensors_dtype(d), list(s)] for n, d, s in rows]


HEADER_MAX_BYTES = 100 * 1024 * 1024
"""safetensors' own limit on a header's length."""
HEADER_MAX_DEPTH = 3
"""A safetensors header is {name: {dtype, shape: [...], data_offsets: [...]}} beside a
`__metadata__` map of strings: three deep. Deeper is no header, and would reach the parser's
recursion limit long before the size limit."""


def read_header(path: Path) -> dict[str, Any]:
    """The JSON header of one safetensors file, read directly: 8 bytes of little-endian length,
    then that many bytes of JSON, bounded in size and depth. A short or missing data region is
    fine (safetensors' own `safe_open` refuses one), so a reference can be a header-only stub of
    a huge checkpoint. Every header cgbuild and its rules read comes through here."""
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise UserError("not a safetensors file (shorter than 8 bytes)", file=str(path))
            (length,) = struct.unpack("<Q", head)
            if length > HEADER_MAX_BYTES:
                raise UserError(f"safetensors header of {length} bytes is implausible", file=str(path))
            raw = f.read(length)
    except OSError as exc:
        raise UserError(f"cannot read checkpoint: {exc.strerror}", file=str(path)) from None
    if len(raw) != length:
        raise UserError("safetensors header is truncated", file=str(path))
    header = jsonfile.decode(raw, str(path), "safetensors header", max_depth=HEADER_MAX_DEPTH)
    if not isinstance(header, dict):
        raise UserError("safetensors header is not a JSON object", file=str(path))
    return header


def _index_files(index: Path) -> tuple[list[Path], dict[str, str]]:
    """The shard files a `*.safetensors.index.json` names (relative to its folder), and its map."""
    data = jsonfile.load(str(index), "checkpoint index")
    try:
        weight_map = data["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map must map tensor names to file names")
    except (KeyError, TypeError) as exc:
        raise UserError(f"not a safetensors index: {exc}", file=str(index)) from None
    files = []
    for name in sorted(set(weight_map.values())):
        shard = index.parent / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise UserError(f"index names a shard outside its folder: {name!r}", file=str(index))
        if not shard.is_file():
            raise UserError(f"index names a missing shard {name!r}", file=str(index))
        files.append(shard)
    return files, weight_map


_SHARD = re.compile(r"-\d+-of-\d+$")


def variant_of(name: str) -> str | None:
    """The variant a `save_pretrained` file name carries: `model.fp16.safetensors`,
    `model.fp16-00001-of-00002.safetensors` and `model.safetensors.index.fp16.json` are `fp16`;
    `model.safetensors` and its shards and index carry none."""
    if name.endswith(".json"):
        tail = name.removesuffix(".json").partition(".safetensors.index")[2]
        return tail.removeprefix(".") or None
    stem = _SHARD.sub("", name.removesuffix(".safetensors"))
    return stem.rpartition(".")[2] if "." in stem else None


def _variant_files(folder: Path, variant: str | None) -> tuple[list[Path], Path | None]:
    """A component folder's files of ONE variant (None: the full files), never two merged: a
    `save_pretrained(variant="fp16")` folder holds both sets, each the whole component."""
    indexes = sorted(p for p in folder.glob("*.safetensors.index*.json") if variant_of(p.name) == variant)
    if len(indexes) > 1:
        raise UserError(
            f"{len(indexes)} index files of one variant; which shards belong to the component is ambiguous",
            file=str(folder),
        )
    if indexes:
        return _index_files(indexes[0])[0], indexes[0]
    files = sorted(p for p in folder.glob("*.safetensors") if variant_of(p.name) == variant)
    if not files:
        held = sorted({str(variant_of(p.name) or "full") for p in folder.glob("*.safetensors")})
        if held:
            want = f"variant '{variant}'" if variant else "full (variant-less) files"
            hint = "" if variant else f": declare the layout's variant (e.g. variant = '{held[0]}')"
            raise UserError(f"no {want} here; it holds {', '.join(held)}{hint}", file=str(folder))
    return files, None


def component_files(
    reference: Path, component: str, variant: str | None = None
) -> tuple[list[Path], Path | None]:
    """The safetensors files of one component and the index that named them, if any.

    Looked for in order: the reference itself when it is a file (an index or one checkpoint);
    `<ref>/<component>/` holding one `*.safetensors.index.json` (its shards) or else every
    `*.safetensors` in it (shards without an index); `<ref>/<component>.safetensors.index.json`;
    `<ref>/<component>.safetensors`. A folder's files are those of ONE variant: the full ones
    unless the layout names a `variant` (`*.fp16.safetensors`, `*.safetensors.index.fp16.json`,
    `<component>.fp16.safetensors`); never both merged.
    """
    if reference.is_file():
        if reference.name.endswith(INDEX_SUFFIX):
            return _index_files(reference)[0], reference
        return [reference], None
    if not reference.exists():
        raise UserError(
            "reference checkpoint does not exist (example references are written by "
            "`python -m cgbuild_rules.reference -C <Cgfile folder>`)",
            file=str(reference),
        )
    folder = reference / component
    if folder.is_dir():
        files, index = _variant_files(folder, variant)
        if files:
            return files, index
    dotted = f".{variant}" if variant else ""
    index = reference / f"{component}.safetensors.index{dotted}.json"
    if index.is_file():
        return _index_files(index)[0], index
    single = reference / f"{component}{dotted}.safetensors"
    if single.is_file():
        return [single], None
    raise UserError(
        f"reference checkpoint has no component '{component}'"
        f"{f' in variant {variant!r}' if variant else ''} (looked for {component}/*.safetensors, "
        f"{component}/*{INDEX_SUFFIX}, {component}{INDEX_SUFFIX} and {component}.safetensors)",
        file=str(reference),
    )


@dataclass(frozen=True)
class Reading:
    """How a reference checkpoint names one component's tensors, as its layout declares it
    (docs/layouts.md): a `save_pretrained` folder names the component's own tensors (`conv_in.weight`)
    where the entry's module, wrapping it, names them `unet.conv_in.weight` (`prefix`); it may
    hold several `variant`s; and it omits tensors tied to another (`tied`: omitted name → the
    name it shares storage with, checkpoint names, for writers that record no alias)."""

    prefix: str = ""
    variant: str | None = None
    tied: tuple[tuple[str, str], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"prefix": self.prefix, "variant": self.variant, "tied": [list(p) for p in self.tied]}

    @classmethod
    def from_json(cls, doc: Any) -> Reading:
        """The reading a mint request carries (absent in older requests: the plain reading)."""
        if not isinstance(doc, dict):
            return cls()
        tied = tuple((str(a), str(b)) for a, b in doc.get("tied") or ())
        return cls(str(doc.get("prefix") or ""), doc.get("variant"), tied)


_HEADER_CACHE: dict[tuple[str, ...], tuple[list[list[Any]], dict[str, str]]] = {}


def _header_rows(path: Path) -> tuple[list[list[Any]], dict[str, str]]:
    """A file's [name, dtype, shape] rows and the aliases its metadata records (safetensors'
    `save_model` drops a tied tensor and records `{dropped: kept}`), memoised by stat stamp."""
    sig = (str(path), *map(str, fs.stat_stamp(path) or ()))
    cached = _HEADER_CACHE.get(sig)
    if cached is None:
        header = read_header(path)
        rows = []
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                rows.append([name, str(info["dtype"]), [int(d) for d in info["shape"]]])
            except (KeyError, TypeError, ValueError):
                raise UserError(f"tensor {name!r} has no dtype/shape in the header", file=str(path)) from None
        meta = header.get("__metadata__")
        names = {r[0] for r in rows}
        aliases = {
            k: v
            for k, v in (meta.items() if isinstance(meta, dict) else ())
            if isinstance(v, str) and v in names and k not in names
        }
        cached = _HEADER_CACHE[sig] = (rows, aliases)
    return cached


def topology_from_reference(reference: Path, component: str, reading: Reading = Reading()) -> list[list[Any]]:
    """One component's topology rows from its checkpoint's headers, in the module's names.

    Shards are merged (one variant's: `reading.variant`). A tensor in two shards, or an index
    whose map disagrees with the shards' headers, is refused: the checkpoint does not say which
    tensors the component has. A tensor the checkpoint omits because it is tied to another (its
    metadata records it, or the layout declares it) gets the row of the tensor it is tied to:
    the module holds it under both names. Then `reading.prefix` is put before every name.
    """
    files, index = component_files(reference, component, reading.variant)
    rows: list[list[Any]] = []
    seen: dict[str, Path] = {}
    ties: dict[str, str] = {}
    for path in files:
        file_rows, aliases = _header_rows(path)
        ties.update(aliases)
        for row in file_rows:
            if row[0] in seen:
                raise UserError(f"tensor {row[0]!r} is in two shards ({seen[row[0]].name})", file=str(path))
            seen[row[0]] = path
            rows.append(row)
    if index is not None:
        weight_map = _index_files(index)[1]
        for name in sorted(set(weight_map) | set(seen)):
            where = seen.get(name)
            if where is None or weight_map.get(name) != where.name:
                raise UserError(
                    f"index and shards disagree on tensor {name!r} (index: {weight_map.get(name)}, "
                    f"shards: {where.name if where else 'absent'})",
                    file=str(index),
                )
    ties.update(reading.tied)
    by_name = {r[0]: r for r in rows}
    for dropped, kept in sorted(ties.items()):
        if dropped in by_name:
            continue
        if kept not in by_name:
            raise UserError(
                f"tensor {dropped!r} is tied to {kept!r}, which the checkpoint does not have",
                file=str(files[0] if files else reference),
            )
        rows.append([dropped, *by_name[kept][1:]])
    return [[reading.prefix + name, dtype, shape] for name, dtype, shape in rows]


def topology_mismatch(layout_rows: list[list[Any]], bound_rows: list[list[Any]]) -> str | None:
    """The first tensor (by name) on which a layout's topology and the traced module's tensors
    disagree, as a sentence; None when they are the same table.

    Equality both ways, not inclusion: adopt checks the live module against the whole layout
    table, so a tensor the checkpoint has and the module lacks would refuse every adopt too.
    """
    table = {name: (dtype, list(shape)) for name, dtype, shape in layout_rows}
    bound = {name: (dtype, list(shape)) for name, dtype, shape in bound_rows}
    for name in sorted(table.keys() | bound.keys()):
        have, traced = table.get(name), bound.get(name)
        if have == traced:
            continue
        if have is None or traced is None:
            sides = ["the traced module", "the layout's topology"]
            holder, lacker = sides if have is None else sides[::-1]
            return f"{name}: {holder} has it, {lacker} does not{_prefix_hint(table, bound)}"
        return f"{name}: layout has {have[0]}{have[1]}, the traced module {traced[0]}{traced[1]}"
    return None


def _prefix_hint(table: Mapping[str, Any], bound: Mapping[str, Any]) -> str:
    """When the two name sets are one prefix apart (a `save_pretrained` folder of the component a
    wrapper module holds as `unet`), a sentence saying which; else empty."""
    if not table or not bound:
        return ""
    names, traced = set(table), set(bound)
    first = min(traced)
    for p in sorted({first[: -len(n)] for n in names if first.endswith("." + n)}):
        if {p + n for n in names} == traced:
            return (
                f"; the names match after adding the prefix {p!r} to the checkpoint's "
                f"(declare it in the layout: prefix = {{ <component> = {p!r} }})"
            )
    first = min(names)
    for p in sorted({first[: -len(n)] for n in traced if first.endswith("." + n)}):
        if all(n.startswith(p) for n in names) and {n[len(p) :] for n in names} == traced:
            return (
                f"; the names match after stripping the prefix {p!r} from the checkpoint's "
                "(the reference holds more than this component: point it at the component's own files)"
            )
    return ""
