"""Is an artifact's sealed metadata well-formed enough to read? Checked before adopt or inspect reads it.

Sealed metadata comes from a file anyone could have written: every field adopt or `cgbuild
inspect` interprets (the host facts, the call contract, the constant and layout tables, the
lanes block, the graph and toolchain summaries, the covered facets, the configuration record) is
checked for its shape here, so a malformed artifact is one named refusal (`bad-metadata`, naming
the field) everywhere it is read, instead of an AttributeError at load, a TypeError on the first
call, or a traceback from inspect. Written by hand rather than with a schema library: it is a few
dozen checks, the serving process gains no dependency, and each refusal names the field. The
call contract is checked by its parse (`cgbuild.protocol.contract`), with the same field checks
(`cgbuild.core.fields`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from cgbuild.config.dims import Range
from cgbuild.core.fields import Malformed, each, natural, naturals, need, obj, string
from cgbuild.lanes import Switches
from cgbuild.protocol.contract import CallContract

_VERSION = re.compile(r"\d{1,6}(\.\d{1,6}){0,5}")


def _constant(value: Any, where: str) -> None:
    row = obj(value, where)
    string(row.get("fqn"), f"{where}.fqn")
    string(row.get("dtype"), f"{where}.dtype")
    naturals(row.get("shape"), f"{where}.shape")
    naturals(row.get("stride"), f"{where}.stride")
    each(row.get("aliases"), f"{where}.aliases", string)


def _layout_row(value: Any, where: str) -> None:
    need(isinstance(value, list) and len(value) == 3, where, "not [name, dtype, shape]")
    string(value[0], f"{where}[0]")
    string(value[1], f"{where}[1]")
    naturals(value[2], f"{where}[2]")


def _lanes(value: Any, where: str) -> None:
    block = obj(value, where, optional=True)
    if not block.get("axes"):
        return
    switches = Switches.parse(block, where)
    verdict = obj(block.get("verdict"), f"{where}.verdict")
    string(verdict.get("winner"), f"{where}.verdict.winner")
    need(
        verdict.get("binding") is None or isinstance(verdict["binding"], str),
        f"{where}.verdict.binding",
        "not a string",
    )
    peaks = obj(verdict.get("peaks"), f"{where}.verdict.peaks", optional=True)
    for lane, peak in peaks.items():
        natural(peak, f"{where}.verdict.peaks.{lane}")
    each(verdict.get("fallback"), f"{where}.verdict.fallback", string)
    carried = set(switches.carried())
    for lane in [verdict["winner"], *peaks, *(verdict.get("fallback") or [])]:
        need(lane in carried, f"{where}.verdict", f"names lane {lane!r}, which the axes do not carry")
    need(not peaks or verdict["winner"] in peaks, f"{where}.verdict.winner", "has no recorded peak")


def _facet(value: Any, where: str) -> None:
    row = obj(value, where)
    for name in ("shape", "graph_class"):
        string(row.get(name), f"{where}.{name}", optional=True)
    for name in ("batch", "text_len", "frames", "pixel_frames"):
        if isinstance(row.get(name), dict):  # a declared range
            need(Range.from_json(row[name]) is not None, f"{where}.{name}", "not a range {min, max}")
        else:
            natural(row.get(name), f"{where}.{name}", optional=True)
    each(row.get("guidance"), f"{where}.guidance", string)


def _bool(value: Any, where: str) -> None:
    need(isinstance(value, bool), where, "not a boolean")


def _module_row(value: Any, where: str, traced: bool) -> None:
    """A submodule's configuration and, in a record that has it, the structure it was traced with."""
    row = obj(value, where)
    string(row.get("class"), f"{where}.class")
    obj(row.get("hyper"), f"{where}.hyper", optional=True)
    if not traced:
        return
    string(row.get("forward"), f"{where}.forward")
    hooks = row.get("hooks")
    need(isinstance(hooks, list) and len(hooks) == 2, f"{where}.hooks", "not [forward hooks, pre-hooks]")
    naturals(hooks, f"{where}.hooks")
    _bool(row.get("override"), f"{where}.override")
    _bool(row.get("training"), f"{where}.training")
    each(row.get("shadows"), f"{where}.shadows", string, optional=False)


def _module(value: Any, where: str) -> None:
    block = obj(value, where, optional=True)
    obj(block.get("config"), f"{where}.config", optional=True)
    traced = "global_hooks" in block  # records sealed before the traced structure have neither
    if traced:
        _bool(block["global_hooks"], f"{where}.global_hooks")
    for fqn, row in obj(block.get("tree"), f"{where}.tree", optional=True).items():
        _module_row(row, f"{where}.tree.{fqn or '(root)'}", traced)


def metadata_problem(meta: Mapping[str, Any]) -> str | None:
    """The first field adopt would misread, as `field: why`, or None when every one has its shape."""
    try:
        checked(meta)
    except Malformed as e:
        return str(e)
    return None


def checked(meta: Mapping[str, Any]) -> CallContract:
    """Every field's check, in one order (the first wrong one is `Malformed`, naming it); the
    call contract is checked by being parsed, so it is returned for `cgbuild.store.sealed`."""
    for name in ("key", "kind", "sm", "torch"):
        string(meta.get(name), name)
    host = obj(meta.get("host"), "host", optional=True)
    obj(host.get("isa"), "host.isa", optional=True)
    obj(host.get("cxx"), "host.cxx", optional=True)
    for lib, version in obj(host.get("runtime"), "host.runtime", optional=True).items():
        need(
            isinstance(version, str) and bool(_VERSION.fullmatch(version)),
            f"host.runtime.{lib}",
            "not a version",
        )
    graph = obj(meta.get("graph"), "graph")
    string(meta.get("device"), "device", optional=True)
    string(meta.get("stamp"), "stamp", optional=True)
    string(meta.get("cgbuild"), "cgbuild", optional=True)
    string(graph.get("digest"), "graph.digest")
    natural(graph.get("nodes"), "graph.nodes", optional=True)
    toolchain = obj(meta.get("toolchain"), "toolchain")
    string(toolchain.get("fold"), "toolchain.fold")
    obj(toolchain.get("components"), "toolchain.components", optional=True)
    each(meta.get("facets"), "facets", _facet)
    for name, block in obj(meta.get("axes"), "axes", optional=True).items():
        obj(block, f"axes.{name}")
    contract = CallContract.from_json(graph.get("contract"), "graph.contract")
    constants = obj(meta.get("constants"), "constants", optional=True)
    each(constants.get("state"), "constants.state", _constant)
    each(
        constants.get("literal"),
        "constants.literal",
        lambda v, w: string(obj(v, w).get("fqn"), f"{w}.fqn"),
    )
    layout = obj(meta.get("layout"), "layout", optional=True)
    each(layout.get("tensors"), "layout.tensors", _layout_row)
    string(layout.get("stamp"), "layout.stamp", optional=True)
    obj(layout.get("rule"), "layout.rule", optional=True)
    _lanes(meta.get("lanes"), "lanes")
    _module(meta.get("module"), "module")
    return contract
