"""The serving manifest: which sealed artifact serves which graph class of a module.

Written by `cgbuild manifest` (from a plan's fresh targets), read by
`cgbuild_rules.adopt.adopt_manifest` in the serving process, both through this module, so a field
cannot be written under one name and read under another.

`cgbuild.serving-manifest/3` holds, per module, where it attaches in a pipeline (`serves`) and
every layout and sm of it side by side, each entry with its envelope facet (what the graph class
covers: shape, text length, batch, guidance; frames for a video module; a declared range as
`{"min": 2, "max": 4}` in its dimension's place) and its layout rule's serving fact (`compiled_only`:
the rule quantizes activations, so no call may fall back to eager), and, where the entry traced
another convention than the pipeline's call, its `call` adapter (`cgbuild.config.calls`); the
serving process keeps the entries of its own device's sm and one layout:

    {"schema": "cgbuild.serving-manifest/3", "family": "flux2-klein",
     "modules": {"transformer": {"serves": "transformer", "entries": [
         {"graph_class": "1024x1024-t512-b1", "layout": "fp8", "sm": "sm_90", "key": "<key>",
          "stamp": "<topology>@1+<quant>@1", "compiled_only": true,
          "envelope": {"shape": "1024x1024", "text_len": 512, "batch": 1, "guidance": []}}]}}}

`cgbuild.serving-manifest/2` (still read) is the same without `serves` (the module's name), the
envelope and the serving fact (an entry then falls back eager, as before):

    {"schema": "cgbuild.serving-manifest/2", "family": "flux2-klein",
     "modules": {"transformer": [{"graph_class": "1024x1024-t512-b1", "layout": "bf16",
                                  "sm": "sm_90", "key": "<key>", "stamp": "<topology>@1+<quant>@1"},
                                 ...]}}

`cgbuild.serving-manifest/1` (module → graph class → key or artifact path) is still read; its
entries carry no layout and no sm, so every one is adopted, as before. A manifest is input from
disk: anything that is not one of the two shapes is a `BadManifest` naming the field.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from cgbuild.config.calls import CallAdapter, adapter_from_json
from cgbuild.config.dims import LETTER, Range
from cgbuild.config.labels import ATTRIBUTE_PATH

SCHEMA_V1 = "cgbuild.serving-manifest/1"
SCHEMA_V2 = "cgbuild.serving-manifest/2"
SCHEMA = "cgbuild.serving-manifest/3"
_FIELDS = ("graph_class", "layout", "sm", "key", "stamp")
_V3_FIELDS = (*_FIELDS, "envelope", "compiled_only")
_V3_MODULE = {"serves", "entries", "call"}
_ENVELOPE: dict[str, type | tuple[type, ...]] = {
    "shape": str,
    "text_len": (int, type(None)),
    "batch": int,
    "guidance": list,
}


class BadManifest(ValueError):
    """A manifest that is neither schema's shape; the message names the field."""


@dataclass(frozen=True)
class Entry:
    """One artifact for one graph class of a module. A v1 entry has no layout, sm or stamp:
    `None` means "not stated", and such an entry is kept whatever the device and layout."""

    graph_class: str
    key: str
    """A store key (resolved through the caller's store), or an artifact path without one."""
    layout: str | None = None
    sm: str | None = None
    stamp: str | None = None
    envelope: Mapping[str, Any] | None = None
    """The graph class's facet (v3): what the serving side may say of it without parsing a name."""
    compiled_only: bool | None = None
    """The layout's rule quantizes activations (v3; None: not stated, v1 and v2): a call no
    artifact serves must not run eager."""

    def to_json(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in _V3_FIELDS if getattr(self, f) is not None}


@dataclass(frozen=True)
class Module:
    """One module of a manifest: where it attaches in a pipeline, its entries, and how the
    pipeline's call maps to the traced one when the entry traced another convention (v3)."""

    serves: str
    entries: list[Entry]
    call: CallAdapter | None = None


def read(doc: Any) -> dict[str, list[Entry]]:
    """module → its entries, from any schema; raises `BadManifest` naming the bad field."""
    return {name: module.entries for name, module in read_modules(doc).items()}


def read_modules(doc: Any) -> dict[str, Module]:
    """module → where it attaches and its entries, from any schema (v1 and v2: each module
    attaches at its own name); raises `BadManifest` naming the bad field."""
    if not isinstance(doc, Mapping):
        raise BadManifest(f"a manifest is a JSON object, not {type(doc).__name__}")
    schema = doc.get("schema")
    if schema not in (SCHEMA, SCHEMA_V2, SCHEMA_V1):
        raise BadManifest(f"schema: {schema!r} is none of {SCHEMA!r}, {SCHEMA_V2!r}, {SCHEMA_V1!r}")
    modules = doc.get("modules")
    if not isinstance(modules, Mapping):
        raise BadManifest("modules: must be an object (module → its entries)")
    out: dict[str, Module] = {}
    for name, rows in modules.items():
        where = f"modules.{name}"
        if not isinstance(name, str) or not name:
            raise BadManifest(f"{where}: a module is named by a non-empty string")
        if schema == SCHEMA:
            if not isinstance(rows, Mapping) or not {"serves", "entries"} <= set(rows) <= _V3_MODULE:
                raise BadManifest(f"{where}: must be an object with 'serves', 'entries' (and 'call')")
            serves = rows["serves"]
            if not isinstance(serves, str) or not ATTRIBUTE_PATH.fullmatch(serves):
                raise BadManifest(f"{where}.serves: must be a pipeline attribute path, e.g. 'vae.decode'")
            entries = rows["entries"]
            if not isinstance(entries, list):
                raise BadManifest(f"{where}.entries: must be a list of entries")
            try:
                call = adapter_from_json(rows["call"], f"{where}.call") if "call" in rows else None
            except ValueError as e:
                raise BadManifest(str(e)) from None
            out[name] = Module(
                serves, [_entry(row, f"{where}.entries[{i}]", v3=True) for i, row in enumerate(entries)], call
            )
            continue
        if schema == SCHEMA_V1:
            if not isinstance(rows, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) and v for k, v in rows.items()
            ):
                raise BadManifest(f"{where}: must map each graph class to a key (v1)")
            out[name] = Module(name, [Entry(cls, key) for cls, key in rows.items()])
            continue
        if not isinstance(rows, list):
            raise BadManifest(f"{where}: must be a list of entries")
        out[name] = Module(name, [_entry(row, f"{where}[{i}]", v3=False) for i, row in enumerate(rows)])
    return out


def _entry(row: Any, where: str, *, v3: bool) -> Entry:
    known = _V3_FIELDS if v3 else _FIELDS
    if not isinstance(row, Mapping):
        raise BadManifest(f"{where}: an entry is an object with {', '.join(known)}")
    if extra := sorted(set(row) - set(known)):
        raise BadManifest(f"{where}: unknown field {extra[0]!r} (an entry has {', '.join(known)})")
    for name in _FIELDS:
        value = row.get(name)
        if name == "stamp" and value is None:
            continue
        if not isinstance(value, str) or not value:
            raise BadManifest(f"{where}.{name}: must be a non-empty string")
    envelope, compiled_only = (
        (_envelope(row.get("envelope"), where), row.get("compiled_only")) if v3 else (None, None)
    )
    if v3 and not isinstance(compiled_only, bool):
        raise BadManifest(f"{where}.compiled_only: must be true or false")
    return Entry(
        graph_class=row["graph_class"],
        key=row["key"],
        layout=row["layout"],
        sm=row["sm"],
        stamp=row.get("stamp"),
        envelope=envelope,
        compiled_only=compiled_only,
    )


def _envelope(value: Any, where: str) -> dict[str, Any]:
    """A facet: its four fields, and `frames` (an integer) for a video module's, with the
    pipeline's `pixel_frames` where the entry states its rule; a declared range's dimension
    holds `{"min": .., "max": ..}` instead."""
    video = {"frames", "pixel_frames"}
    if not isinstance(value, Mapping) or not set(_ENVELOPE) <= set(value) <= {*_ENVELOPE, *video}:
        raise BadManifest(f"{where}.envelope: must be an object with {', '.join(_ENVELOPE)} (and frames)")
    if "pixel_frames" in value and "frames" not in value:
        raise BadManifest(f"{where}.envelope.pixel_frames: stated without the module's frames")
    for name, kind in (*_ENVELOPE.items(), ("frames", int), ("pixel_frames", int)):
        ranged = name in LETTER or name == "pixel_frames"
        if ranged and isinstance(value.get(name), Mapping) and Range.from_json(dict(value[name])):
            continue
        if name in value and (not isinstance(value[name], kind) or isinstance(value[name], bool)):
            raise BadManifest(f"{where}.envelope.{name}: not what a facet holds")
    return dict(value)


def build(
    family: str,
    entries: Iterable[tuple[str, Entry]],
    serves: Mapping[str, str],
    calls: Mapping[str, CallAdapter] | None = None,
) -> dict[str, Any]:
    """The v3 manifest of (module, entry) pairs, with where each module attaches (`serves`, by
    module); entries in a fixed order so one selection always writes the same bytes."""
    modules: dict[str, list[Entry]] = {}
    for module, entry in entries:
        modules.setdefault(module, []).append(entry)
    order = lambda e: (e.graph_class, e.layout or "", e.sm or "")  # noqa: E731
    return {
        "schema": SCHEMA,
        "family": family,
        "modules": {
            name: {
                "serves": serves[name],
                "entries": [e.to_json() for e in sorted(rows, key=order)],
                **({"call": calls[name].to_json()} if calls and name in calls else {}),
            }
            for name, rows in sorted(modules.items())
        },
    }
