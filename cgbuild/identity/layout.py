"""The `layout` key axis: quant(topology), identified by a digest pair.

TOPOLOGY is which tensors a module has (name, dtype, shape), read mechanically from a reference
checkpoint's safetensors HEADER (never its data) or, when no reference is declared, from the
traced module's own state dict. Both sources render the same canonical rows, so a reference that
agrees with the traced module gives the same digest as the trace. QUANT RULE is a versioned record
whose convention facts are its identity: the digest covers the facts alone, never the name or the
version number, so renaming a rule or bumping its display version moves nothing while changing
what its bytes mean moves every key that uses it. Display names
(`flux2-klein.transformer@1+int8-rowwise@1`) are for people and never parsed.

A rule may have a floor: the smallest sm whose hardware can run its matmul, and a capability
check of the toolchain's torch on that sm (`scaled_mm_rowwise`). Both are decided here, without
torch, so a plan says `blocked` before anything is traced or compiled; a mint on a real device
probes the kernel as well (`cgbuild_rules.quant.probe`).

This module never imports torch: the torch side of every rule (the module transform that
produces the emitted tensors) lives in `cgbuild_rules.quant`, keyed by the same names.
"""

from __future__ import annotations

import functools
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cgbuild.core import fs, jsonfile
from cgbuild.core.canon import digest
from cgbuild.core.codes import Code
from cgbuild.core.errors import UserError
from cgbuild.core.platform import device_of, sm_number
from cgbuild.identity.keys import LAYOUT, Axis

TOPOLOGY_SCHEME = 1
QUANT_SCHEME = "cgbuild.quant/2"
INDEX_SUFFIX = ".safetensors.index.json"


@dataclass(frozen=True)
class QuantRule:
    """One quant rule. `facts` is the whole identity; `name` and `version` are for display."""

    name: str
    version: int
    facts: dict[str, Any]

    @property
    def display(self) -> str:
        return f"{self.name}@{self.version}"

    @functools.cached_property
    def digest(self) -> str:
        return digest({"scheme": QUANT_SCHEME, "facts": self.facts})

    @property
    def compute(self) -> tuple[str, ...]:
        """Compute dtypes (torch names) the rule allows; the first is the default when it is the only one."""
        return tuple(self.facts["compute"])

    @property
    def dtype(self) -> str | None:
        """The compute dtype when the rule fixes it (plain rules), else None: the layout says."""
        return self.compute[0] if len(self.compute) == 1 else None

    @property
    def transforms(self) -> bool:
        """Whether the rule rewrites modules before the trace (every rule but `plain.*`): such a
        rule must have a transform in `cgbuild_rules.quant`, or it would key plain weights."""
        return bool(self.facts["eligible"] != "none")

    @property
    def compiled_only(self) -> bool:
        """The rule quantizes activations (W8A8): its module's eager path computes another thing."""
        return bool(self.facts["activations"] != "unquantized")

    @property
    def min_sm(self) -> str | None:
        return self.facts.get("min_sm")

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(self.facts["devices"])

    @property
    def lanes(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Lane axes the rule's own modules switch on: axis → value → needs (docs/lanes.md).

        They are facts: which kernels the rule may compile in is part of what its layout means.
        A family opts in by declaring the axis in `[family.<name>.lanes]`; only targets of a
        layout with this rule carry it.
        """
        return dict(self.facts.get("lanes") or {})

    @property
    def tolerance(self) -> str | None:
        """The verification tolerance (relative RMS, compiled vs eager of this rule), when the
        rule states one in place of the compute dtype's."""
        stated = self.facts.get("tolerance")
        return str(stated["rel_rms"]) if stated else None


def _plain(element: str, compute: str) -> dict[str, Any]:
    return {
        "element": element,
        "compute": [compute],
        "eligible": "none",
        "emits": [],
        "scale": "none",
        "packing": "none",
        "activations": "unquantized",
        "matmul": "as traced",
        "min_sm": None,
        "devices": ["cpu", "cuda"],
        "capability": None,
    }


# Both quantized rules quantize the same modules and emit the same two tensors per module; they
# differ in element type, in what happens to activations and in the matmul. Scales are fp32 in
# both: one scale per output row costs 4 bytes per row (nothing next to the row's `in` bytes),
# keeps a bf16 checkpoint's scales exact for an fp32 compute and is what torch._scaled_mm takes.
_ELIGIBLE = {"module": "torch.nn.Linear", "weight_rank": 2, "dims_multiple_of": 16}

INT8_ROWWISE: dict[str, Any] = {
    "element": "I8",
    "compute": ["float32", "bfloat16", "float16"],
    "eligible": _ELIGIBLE,
    "emits": [["{fqn}.weight", "I8", "[out, in]"], ["{fqn}.weight_scale", "F32", "[out]"]],
    "scale": {
        "dtype": "F32",
        "granularity": "per-output-row",
        "value": "absmax(row) / 127, floored at the smallest normal fp32",
        "zero_point": "none (symmetric)",
    },
    "rounding": "round half to even, clamp to [-127, 127]",
    "packing": "none (row-major, one byte per element)",
    "activations": "unquantized",
    "matmul": "dequantize in graph: "
    "linear(x, (weight.to(float32) * weight_scale[:, None]).to(compute), bias)",
    "min_sm": None,
    "devices": ["cpu", "cuda"],
    "capability": None,
}

FP8_ROWWISE: dict[str, Any] = {
    "element": "F8_E4M3",
    "compute": ["bfloat16"],
    "eligible": _ELIGIBLE,
    "emits": [["{fqn}.weight", "F8_E4M3", "[out, in]"], ["{fqn}.weight_scale", "F32", "[out]"]],
    "scale": {
        "dtype": "F32",
        "granularity": "per-output-row",
        "value": "absmax(row) / 448, floored at the smallest normal fp32",
        "zero_point": "none (symmetric)",
    },
    "rounding": "clamp to [-448, 448], then round to nearest float8_e4m3fn",
    "packing": "none (row-major, one byte per element)",
    "activations": "dynamic per row of x, in graph: fp32 scale absmax(row) / 448 floored at 1e-12, "
    "x clamped to [-448, 448] and cast to float8_e4m3fn",
    "matmul": "lane fp8-gemm: scaled-mm = torch._scaled_mm(x_fp8, weight.t(), scale_a=[M, 1], "
    "scale_b=weight_scale[None, :], out_dtype=compute) + bias; triton = one Triton GEMM "
    "(cgbuild::fp8_rowwise_linear_v1) that divides, clamps and casts x per row as it loads it, "
    "scales by both row scales and adds the bias in its epilogue; the same scales and rounding "
    "either way; no dequantize fallback",
    "min_sm": "sm_89",
    "devices": ["cuda"],
    "capability": "scaled_mm-rowwise",
    "lanes": {
        "fp8-gemm": {"scaled-mm": {}, "triton": {"device": "cuda", "triton": True, "min_sm": 89}},
    },
    # e4m3 keeps 3 mantissa bits: rounding x and w each costs ~3.6% rms per element, and the
    # measured klein-4B output is 5.2% (artifact) to 5.6% (eager) off fp32, 4.2% compiled vs
    # eager (docs/layouts.md). 8% clears that by ~2x; a wrong kernel (an unscaled operand, a
    # transposed weight) is off by 50% and more.
    "tolerance": {"metric": "rel-rms", "against": "eager of this rule, same lane", "rel_rms": "8e-2"},
}

QUANT_RULES: dict[str, QuantRule] = {
    r.name: r
    for r in (
        QuantRule("plain.bf16", 1, _plain("BF16", "bfloat16")),
        QuantRule("plain.fp16", 1, _plain("F16", "float16")),
        QuantRule("plain.fp32", 1, _plain("F32", "float32")),
        QuantRule("int8-rowwise", 1, INT8_ROWWISE),
        QuantRule("fp8-rowwise", 1, FP8_ROWWISE),
    )
}


def compute_dtype(rule: QuantRule, declared: str | None) -> str:
    """The compute dtype of a layout: the rule's own, or the declared one if the rule allows it.

    Raises ValueError with a sentence for the Cgfile error.
    """
    allowed = rule.compute
    if declared is None:
        if rule.dtype is None:
            raise ValueError(
                f"quant rule '{rule.name}' computes in {' or '.join(allowed)}: declare the layout's dtype"
            )
        return rule.dtype
    if declared not in allowed:
        raise ValueError(f"quant rule '{rule.name}' computes in {' or '.join(allowed)}, not {declared}")
    return declared


# ---- floors: the sm a rule needs, and what the toolchain's torch can run there --------------------
# First torch release whose CUDA build runs torch._scaled_mm with row-wise scales on an sm, from
# torch's own history: a CUTLASS row-wise kernel for sm_90 (2024, torch 2.5); built for sm_89 from
# torch 2.7 but launched on the wrong stream until 2.12 (hangs when called from a side stream:
# AOTInductor calls on the caller's stream, so older torch is refused on sm_89); sm_100 builds
# from 2.8 and sm_120 from 2.9. Unlisted sms are refused: fail toward `blocked`, never toward a
# mint that cannot run. A mint on a device also probes the kernel itself.
SCALED_MM_ROWWISE_FIRST_TORCH: dict[int, tuple[int, int]] = {
    89: (2, 12),
    90: (2, 5),
    100: (2, 8),
    120: (2, 9),
}
_VERSION = re.compile(r"^(\d+)\.(\d+)")


def torch_release(version: str) -> tuple[int, int] | None:
    m = _VERSION.match(version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def scaled_mm_rowwise(torch_version: str, sm: str) -> tuple[bool, str]:
    """Can this torch run row-wise-scaled fp8 `torch._scaled_mm` on this sm? A pure function of the
    two facts, so a plan on a machine without a GPU answers it; (supported, why)."""
    number = sm_number(sm)
    release = torch_release(torch_version)
    if number is None:
        return False, f"row-wise scaled_mm is a CUDA kernel; {sm} is not a CUDA architecture"
    if release is None:
        return False, f"cannot read a torch release from {torch_version!r}"
    first = SCALED_MM_ROWWISE_FIRST_TORCH.get(number)
    if first is None:
        known = ", ".join(f"sm_{n}" for n in sorted(SCALED_MM_ROWWISE_FIRST_TORCH))
        return False, f"no record of a row-wise scaled_mm kernel for {sm} (known: {known})"
    if release < first:
        return False, (
            f"torch {torch_version} has no usable row-wise scaled_mm on {sm} "
            f"(first usable: torch {first[0]}.{first[1]})"
        )
    return True, f"torch {torch_version} runs row-wise scaled_mm on {sm}"


CAPABILITIES = {"scaled_mm-rowwise": scaled_mm_rowwise}


def floor_refusal(rule: QuantRule, sm: str, torch_version: str | None) -> tuple[Code, str] | None:
    """(reason code, detail) when a target of this rule on this sm must not be minted, else None.

    `layout-below-sm-floor`: the device kind or the sm is below what the rule's matmul needs (a
    fact of the rule). `layout-toolchain-unsupported`: the sm is high enough but the toolchain's
    torch has no kernel for it there. An unknown torch decides nothing here (the graph is
    unknown then anyway, and a mint probes the device).
    """
    device = device_of(sm)
    if device not in rule.devices:
        return Code.LAYOUT_BELOW_SM_FLOOR, (
            f"{rule.display} runs only on {' and '.join(rule.devices)}; {sm} targets are never minted"
        )
    floor = rule.min_sm
    number, need = sm_number(sm), sm_number(floor) if floor else None
    if need is not None and number is not None and number < need:
        return Code.LAYOUT_BELOW_SM_FLOOR, f"{rule.display} needs {floor} or newer; {sm} is below its floor"
    check = CAPABILITIES.get(rule.facts.get("capability") or "")
    if check is not None and torch_version is not None:
        ok, why = check(torch_version, sm)
        if not ok:
            return Code.LAYOUT_TOOLCHAIN_UNSUPPORTED, f"{rule.display}: {why}"
    return None


# ---- topology -------------------------------------------------------------------------------------
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


def layout_identity(topology: str, quant: QuantRule) -> dict[str, str]:
    """The layout axis's identity block: the digest pair, and nothing else."""
    return {"topology": topology, "quant": quant.digest}


def layout_stamp(family: str, component: str, quant: QuantRule) -> str:
    """`<family>.<component>@<topology scheme>+<rule>@<version>`: for people, never parsed."""
    return f"{family}.{component}@{TOPOLOGY_SCHEME}+{quant.display}"


def layout_axis(family: str, component: str, quant: QuantRule, topology: str, source: str) -> Axis:
    """The layout axis; its identity holds digests only."""
    return LAYOUT.axis(
        {
            **layout_identity(topology, quant),
            "stamp": layout_stamp(family, component, quant),
            "topology_source": source,
            "quant_rule": quant.display,
        }
    )
