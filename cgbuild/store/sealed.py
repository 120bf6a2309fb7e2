"""An artifact's sealed metadata as frozen values, parsed once (`parse`).

The metadata comes from a file anyone could have written: `parse` runs the field checks of
`cgbuild.store.metadata` (a malformed field is `Malformed`, naming it) and only then builds the
values adopt, `inspect` and the store read, so no reader indexes the raw document. The call
contract is parsed by that check (`cgbuild.protocol.contract`), the lanes block into a
`cgbuild.lanes.LaneBlock`. The configuration record, whose meaning belongs to the serving
side, is carried as the checked mapping and interpreted there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cgbuild.lanes import LaneBlock
from cgbuild.protocol.contract import CallContract
from cgbuild.store.metadata import checked


@dataclass(frozen=True)
class Host:
    """What the serving host must provide: the ISA level the host code was built for, the host
    compiler's family (a package's wrapper links against torch's C++ ABI) and runtime libraries."""

    isa: Mapping[str, Any]
    cxx: Mapping[str, Any]
    runtime: Mapping[str, str]

    @property
    def cxx_family(self) -> str | None:
        family = self.cxx.get("family")
        return str(family) if family else None


@dataclass(frozen=True)
class Constant:
    """A state tensor the package binds: its name, dtype, shape and strides as traced, and the
    other names it was tied to at mint."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    aliases: tuple[str, ...]


@dataclass(frozen=True)
class Layout:
    """The layout's tensor table as sealed: (name, safetensors dtype, shape) rows."""

    stamp: str | None
    rule: str | None
    tensors: tuple[tuple[str, str, tuple[int, ...]], ...]


@dataclass(frozen=True)
class Sealed:
    """What an artifact says of itself."""

    key: str
    kind: str
    sm: str
    torch: str
    device: str | None
    stamp: str | None
    host: Host
    cgbuild: str | None
    """The cgbuild version that sealed it (forensics)."""
    graph_digest: str
    nodes: int | None
    contract: CallContract
    """What the program takes and returns (`cgbuild_rules.adopt.contract` fits a call to it)."""
    toolchain_fold: str
    toolchain: Mapping[str, Any]
    facets: tuple[Mapping[str, Any], ...]
    axes: Mapping[str, Mapping[str, Any]]
    state: tuple[Constant, ...]
    literals: tuple[str, ...]
    """FQNs of the trace-baked literals the package binds."""
    layout: Layout | None
    lanes: LaneBlock | None
    """The lanes block (axes, selector, verdict), None when the artifact carries no lane."""
    module: Mapping[str, Any] | None
    """The configuration record (`cgbuild_rules.configured`, `cgbuild_rules.traced`), None when
    the artifact was sealed before it."""
    doc: Mapping[str, Any]
    """The whole document, for `inspect --json`."""

    @property
    def constant_fqns(self) -> set[str]:
        return {c.fqn for c in self.state} | set(self.literals)

    @property
    def lane_switches(self) -> set[str]:
        """FQNs of one-hot lane switches (artifacts sealed before the lane selector)."""
        rows = self.lanes.switches.axes if self.lanes else ()
        return {r.fqn for r in rows if r.fqn}


def parse(meta: Mapping[str, Any]) -> Sealed:
    """The sealed metadata's values; `Malformed` naming the first field that has the wrong shape."""
    contract = checked(meta)
    host = meta.get("host") or {}
    graph = meta["graph"]
    constants = meta.get("constants") or {}
    module = meta.get("module")
    return Sealed(
        key=meta["key"],
        kind=meta["kind"],
        sm=meta["sm"],
        torch=meta["torch"],
        device=meta.get("device"),
        stamp=meta.get("stamp"),
        host=Host(host.get("isa") or {}, host.get("cxx") or {}, host.get("runtime") or {}),
        cgbuild=meta.get("cgbuild"),
        graph_digest=graph["digest"],
        nodes=graph.get("nodes"),
        contract=contract,
        toolchain_fold=meta["toolchain"]["fold"],
        toolchain=meta["toolchain"],
        facets=tuple(meta.get("facets") or ()),
        axes=meta.get("axes") or {},
        state=tuple(
            Constant(
                r["fqn"], r["dtype"], tuple(r["shape"]), tuple(r["stride"]), tuple(r.get("aliases") or ())
            )
            for r in constants.get("state") or ()
        ),
        literals=tuple(r["fqn"] for r in constants.get("literal") or ()),
        layout=_layout(meta.get("layout")),
        lanes=LaneBlock.parse(meta.get("lanes")),
        module=module if isinstance(module, Mapping) else None,
        doc=meta,
    )


def _layout(block: Mapping[str, Any] | None) -> Layout | None:
    if not block or not block.get("tensors"):
        return None
    rule = (block.get("rule") or {}).get("name")
    rows = tuple((name, dtype, tuple(shape)) for name, dtype, shape in block["tensors"])
    return Layout(block.get("stamp"), str(rule) if rule else None, rows)
