"""A serving manifest adopted: each module's entries for this device's sm and one layout,
resolved through the store, armed as one `Adopted` per module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cgbuild_rules.adopt.artifact import load_artifact
from cgbuild_rules.adopt.bind import PLAIN, ConfigCheck, layout_refusal
from cgbuild_rules.adopt.host import device_sm, module_device
from cgbuild_rules.adopt.refusal import Refusal
from cgbuild_rules.adopt.router import Adopted
from cgbuild_rules.adopt.state import Artifact, Identity, Unloaded
from torch import nn

from cgbuild.core.codes import Code
from cgbuild.protocol.manifest import Entry as ManifestEntry
from cgbuild.protocol.manifest import read as read_manifest
from cgbuild.store.local import Store
from cgbuild.store.shared import SharedStore


def adopt_manifest(
    manifest: Mapping[str, Any],
    modules: Mapping[str, nn.Module],
    *,
    store: Store | SharedStore | None = None,
    memory_bytes: int | None = None,
    layouts: Mapping[str, str] | None = None,
) -> dict[str, Adopted]:
    """Adopt every graph class of every module a serving manifest names, in one call.

    The manifest (`cgbuild.protocol.manifest`: schema 2, or schema 1 read as before) may hold
    several sms and layouts of a module. Each module keeps the entries of its own device's sm
    (none: one `wrong-sm` refusal naming the sms the manifest has) and one layout: the one
    `layouts[module]` names, else the only one, else the one whose sealed tensor table matches
    the live module's tensors (none: `layout-mismatch`; several: `layout-ambiguous`, each naming
    the layouts: name one in `layouts`). Keys are resolved through `store` (without one, a key
    is read as an artifact path). Modules the manifest names but the caller does not pass are
    skipped; each returned `Adopted` routes a call to the class whose contract fits, else eager.
    Raises `BadManifest` (a ValueError) for a malformed manifest, ValueError for a layout named
    for a module or a layout the manifest does not have.
    """
    entries = read_manifest(manifest)
    layouts = dict(layouts or {})
    if unknown := sorted(set(layouts) - set(entries)):
        raise ValueError(f"layouts names {unknown[0]!r}, a module the manifest does not have")
    served: dict[str, Adopted] = {}
    for name, rows in entries.items():
        if name in modules:
            arts, _ = manifest_artifacts(name, rows, modules[name], store, memory_bytes, layouts.get(name))
            served[name] = Adopted(modules[name], arts)
    return served


def manifest_artifacts(
    name: str,
    rows: list[ManifestEntry],
    module: nn.Module,
    store: Store | SharedStore | None,
    memory_bytes: int | None,
    layout: str | None,
    config: ConfigCheck = PLAIN,
) -> tuple[list[Artifact], str | None]:
    """The artifacts one module serves from its manifest entries (its sm, one layout), and that
    layout when one was chosen; `config`: what the module's call adapter says of its classes."""
    here = device_sm(module_device(module))
    sms = sorted({r.sm for r in rows if r.sm})
    rows = [r for r in rows if r.sm in (None, here)]
    if not rows:
        detail = f"the manifest serves {name} on {', '.join(sms) or 'nothing'}, the module is on {here}"
        return [_refused(name, Code.WRONG_SM, detail)], layout
    by_layout: dict[str | None, list[ManifestEntry]] = {}
    for r in rows:
        by_layout.setdefault(r.layout, []).append(r)
    if layout is not None:
        if layout not in by_layout:
            have = ", ".join(sorted(str(k) for k in by_layout))
            raise ValueError(f"{name}: the manifest has no layout {layout!r} on {here} (it has {have})")
        by_layout = {layout: by_layout[layout]}
    loaded = {
        lay: _load_entries(group, module, store, memory_bytes, config) for lay, group in by_layout.items()
    }
    if len(loaded) == 1:
        ((only, arts),) = loaded.items()
        return arts, only
    misfit = {
        lay: _layout_misfit(arts, module) for lay, arts in sorted(loaded.items(), key=lambda kv: str(kv[0]))
    }
    fits = [lay for lay, why in misfit.items() if why is None]
    if len(fits) == 1:
        return loaded[fits[0]], fits[0]
    hint = f"name one with layouts={{{name!r}: ...}}"
    if fits:
        detail = f"layouts {', '.join(map(str, fits))} all match the module's tensors: {hint}"
        return [_refused(name, Code.LAYOUT_AMBIGUOUS, detail)], None
    tried = "; ".join(f"{lay}: {why}" for lay, why in misfit.items())
    detail = f"no layout of the manifest matches the module ({tried}); {hint}"
    return [_refused(name, Code.LAYOUT_MISMATCH, detail)], None


def _load_entries(
    rows: list[ManifestEntry],
    module: nn.Module,
    store: Store | SharedStore | None,
    memory_bytes: int | None,
    config: ConfigCheck,
) -> list[Artifact]:
    """One artifact per key (graph classes sharing a key share it, labelled by all of them)."""
    classes: dict[str, list[str]] = {}
    for r in sorted(rows, key=lambda r: r.graph_class):
        classes.setdefault(r.key, []).append(r.graph_class)
    return [
        load_artifact(
            key,
            module,
            store=store,
            label="+".join(names),
            memory_bytes=memory_bytes,
            config=config,
        )
        for key, names in classes.items()
    ]


def _layout_misfit(arts: list[Artifact], module: nn.Module) -> str | None:
    """Why this layout's artifacts do not match the live module's tensors (None: they do).

    Read from each artifact's sealed layout table (an artifact that could not be read matches
    nothing: its own refusal is the reason)."""
    readable = [a for a in arts if a.sealed is not None]
    if not readable:
        why = next((a.refusal for a in arts if a.refusal), None)
        return f"{why.code}: {why.detail}" if why else "no artifact"
    for art in readable:
        if refusal := layout_refusal(art.sealed.layout if art.sealed else None, module):
            return refusal.detail
    return None


def _refused(name: str, code: Code, detail: str) -> Artifact:
    """A stand-in for a module the manifest cannot serve here: the module serves eager, named."""
    return Artifact(Identity("", name, None), Unloaded(Refusal(code, detail)))
