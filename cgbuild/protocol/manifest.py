"""The serving manifest: which sealed artifact serves which graph class of a module.

Written by `cgbuild manifest` (from a plan's fresh targets), read by
`cgbuild_rules.adopt.adopt_manifest` in the serving process, both through this module, so a field
cannot be written under one name and read under another.

`cgbuild.serving-manifest/2` holds every layout and every sm of a module side by side; the
serving process keeps the entries of its own device's sm and one layout:

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

SCHEMA_V1 = "cgbuild.serving-manifest/1"
SCHEMA = "cgbuild.serving-manifest/2"
_FIELDS = ("graph_class", "layout", "sm", "key", "stamp")


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

    def to_json(self) -> dict[str, str]:
        return {f: getattr(self, f) for f in _FIELDS if getattr(self, f) is not None}


def read(doc: Any) -> dict[str, list[Entry]]:
    """module → its entries, from either schema; raises `BadManifest` naming the bad field."""
    if not isinstance(doc, Mapping):
        raise BadManifest(f"a manifest is a JSON object, not {type(doc).__name__}")
    schema = doc.get("schema")
    if schema not in (SCHEMA, SCHEMA_V1):
        raise BadManifest(f"schema: {schema!r} is neither {SCHEMA!r} nor {SCHEMA_V1!r}")
    modules = doc.get("modules")
    if not isinstance(modules, Mapping):
        raise BadManifest("modules: must be an object (module → its entries)")
    out: dict[str, list[Entry]] = {}
    for name, rows in modules.items():
        where = f"modules.{name}"
        if schema == SCHEMA_V1:
            if not isinstance(rows, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) and v for k, v in rows.items()
            ):
                raise BadManifest(f"{where}: must map each graph class to a key (v1)")
            out[name] = [Entry(cls, key) for cls, key in rows.items()]
            continue
        if not isinstance(rows, list):
            raise BadManifest(f"{where}: must be a list of entries")
        out[name] = [_entry(row, f"{where}[{i}]") for i, row in enumerate(rows)]
    return out


def _entry(row: Any, where: str) -> Entry:
    if not isinstance(row, Mapping):
        raise BadManifest(f"{where}: an entry is an object with {', '.join(_FIELDS)}")
    if extra := sorted(set(row) - set(_FIELDS)):
        raise BadManifest(f"{where}: unknown field {extra[0]!r} (an entry has {', '.join(_FIELDS)})")
    for name in _FIELDS:
        value = row.get(name)
        if name == "stamp" and value is None:
            continue
        if not isinstance(value, str) or not value:
            raise BadManifest(f"{where}.{name}: must be a non-empty string")
    return Entry(
        graph_class=row["graph_class"],
        key=row["key"],
        layout=row["layout"],
        sm=row["sm"],
        stamp=row.get("stamp"),
    )


def build(family: str, targets: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The v2 manifest of plan targets (each with `module`, `graph_class`, `layout`, `sm`, `key`,
    `stamp`), entries in a fixed order so one selection always writes the same bytes."""
    modules: dict[str, list[Entry]] = {}
    for t in targets:
        entry = Entry(t["graph_class"], t["key"], t["layout"], t["sm"], t.get("stamp") or None)
        modules.setdefault(t["module"], []).append(entry)
    return {
        "schema": SCHEMA,
        "family": family,
        "modules": {
            name: [
                e.to_json() for e in sorted(rows, key=lambda e: (e.graph_class, e.layout or "", e.sm or ""))
            ]
            for name, rows in sorted(modules.items())
        },
    }
