"""Is an artifact's sealed metadata well-formed enough to read? Checked before adopt or inspect reads it.

Sealed metadata comes from a file anyone could have written: every field adopt or `cgbuild
inspect` interprets (the host facts, the call contract, the constant and layout tables, the
lanes block, the graph and toolchain summaries, the covered facets, the configuration record) is
checked for its shape here, so a malformed artifact is one named refusal (`bad-metadata`, naming
the field) everywhere it is read, instead of an AttributeError at load, a TypeError on the first
call, or a traceback from inspect. Written by hand rather than with a schema library: it is a few
dozen checks, the serving process gains no dependency, and each refusal names the field.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, cast

from cgbuild.config.dims import Range
from cgbuild.lanes import combinations

_VERSION = re.compile(r"\d{1,6}(\.\d{1,6}){0,5}")


class Malformed(ValueError):
    """One field of the sealed metadata has the wrong shape; the message names it."""


def _need(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise Malformed(f"{where}: {what}")


def _obj(value: Any, where: str, *, optional: bool = False) -> dict[str, Any]:
    if value is None and optional:
        return {}
    _need(isinstance(value, dict), where, "not an object")
    return cast(dict[str, Any], value)


def _list(value: Any, where: str, item: Callable[[Any, str], None], *, optional: bool = True) -> None:
    if value is None and optional:
        return
    _need(isinstance(value, list), where, "not a list")
    for i, v in enumerate(value):
        item(v, f"{where}[{i}]")


def _str(value: Any, where: str, *, optional: bool = False) -> None:
    _need(isinstance(value, str) or (optional and value is None), where, "not a string")


def _int(value: Any, where: str, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    _need(type(value) is int and value >= 0, where, "not a non-negative integer")


def _ints(value: Any, where: str) -> None:
    _list(value, where, _int, optional=False)


def _dim(value: Any, where: str) -> None:
    _need((type(value) is int and value >= 0) or isinstance(value, str), where, "not a size")


def _leaf(value: Any, where: str) -> None:
    if not isinstance(value, dict):
        _need(value is None or isinstance(value, (bool, int, float, str)), where, "not a tensor or constant")
        return
    _str(value.get("dtype"), f"{where}.dtype")
    _str(value.get("device"), f"{where}.device")
    _list(value.get("shape"), f"{where}.shape", _dim, optional=False)
    _list(value.get("stride"), f"{where}.stride", _dim)
    _need(
        value.get("stride") is None or len(value["stride"]) == len(value["shape"]),
        f"{where}.stride",
        "not one stride per dimension",
    )


def _input(value: Any, where: str) -> None:
    spec = _obj(value, where)
    _str(spec.get("name"), f"{where}.name")
    _need(isinstance(spec.get("keyword", False), bool), f"{where}.keyword", "not a boolean")
    _list(spec.get("leaves"), f"{where}.leaves", _leaf)


def _symbol(value: Any, where: str) -> None:
    sym = _obj(value, where)
    _str(sym.get("name"), f"{where}.name")
    for bound in ("min", "max"):
        _need(sym.get(bound) is None or type(sym.get(bound)) is int, f"{where}.{bound}", "not an integer")


def _constant(value: Any, where: str) -> None:
    row = _obj(value, where)
    _str(row.get("fqn"), f"{where}.fqn")
    _str(row.get("dtype"), f"{where}.dtype")
    _ints(row.get("shape"), f"{where}.shape")
    _ints(row.get("stride"), f"{where}.stride")
    _list(row.get("aliases"), f"{where}.aliases", _str)


def _layout_row(value: Any, where: str) -> None:
    _need(isinstance(value, list) and len(value) == 3, where, "not [name, dtype, shape]")
    _str(value[0], f"{where}[0]")
    _str(value[1], f"{where}[1]")
    _ints(value[2], f"{where}[2]")


def _lane_axis(value: Any, where: str) -> None:
    row = _obj(value, where)
    _str(row.get("axis"), f"{where}.axis")
    _list(row.get("values"), f"{where}.values", _str, optional=False)
    _need(bool(row["values"]), f"{where}.values", "empty")
    _need(row.get("fqn") is None or isinstance(row["fqn"], str), f"{where}.fqn", "not a string")


def _lane_switches(block: Mapping[str, Any], where: str) -> None:
    """Each axis of two or more values is switched one way: by the selector input (what a trace
    makes) or by its one-hot literal (artifacts sealed before), never neither (adopt would bind
    nothing and the program run its default) and never both."""
    selector = _obj(block.get("selector"), f"{where}.selector", optional=True)
    dims: list[str] = []
    if selector:
        _str(selector.get("input"), f"{where}.selector.input")
        _list(selector.get("axes"), f"{where}.selector.axes", _str, optional=False)
        _int(selector.get("base"), f"{where}.selector.base")
        dims = selector["axes"]
        _need(len(set(dims)) == len(dims), f"{where}.selector.axes", "repeat an axis")
    for i, row in enumerate(block["axes"]):
        switched = len(row["values"]) > 1
        ways = int(bool(row.get("fqn"))) + int(row["axis"] in dims)
        _need(ways == int(switched), f"{where}.axes[{i}]", "not switched by exactly one selector or one-hot")
    unknown = sorted(set(dims) - {row["axis"] for row in block["axes"]})
    _need(not unknown, f"{where}.selector.axes", f"names {unknown[0] if unknown else ''!r}, not an axis")


def _lanes(value: Any, where: str) -> None:
    block = _obj(value, where, optional=True)
    if not block.get("axes"):
        return
    _list(block["axes"], f"{where}.axes", _lane_axis)
    _lane_switches(block, where)
    verdict = _obj(block.get("verdict"), f"{where}.verdict")
    _str(verdict.get("winner"), f"{where}.verdict.winner")
    _need(
        verdict.get("binding") is None or isinstance(verdict["binding"], str),
        f"{where}.verdict.binding",
        "not a string",
    )
    peaks = _obj(verdict.get("peaks"), f"{where}.verdict.peaks", optional=True)
    for lane, peak in peaks.items():
        _int(peak, f"{where}.verdict.peaks.{lane}")
    _list(verdict.get("fallback"), f"{where}.verdict.fallback", _str)
    carried = set(combinations([(r["axis"], r["values"]) for r in block["axes"]]))
    for lane in [verdict["winner"], *peaks, *(verdict.get("fallback") or [])]:
        _need(lane in carried, f"{where}.verdict", f"names lane {lane!r}, which the axes do not carry")
    _need(not peaks or verdict["winner"] in peaks, f"{where}.verdict.winner", "has no recorded peak")


def _facet(value: Any, where: str) -> None:
    row = _obj(value, where)
    for name in ("shape", "graph_class"):
        _str(row.get(name), f"{where}.{name}", optional=True)
    for name in ("batch", "text_len", "frames", "pixel_frames"):
        if isinstance(row.get(name), dict):  # a declared range
            _need(Range.from_json(row[name]) is not None, f"{where}.{name}", "not a range {min, max}")
        else:
            _int(row.get(name), f"{where}.{name}", optional=True)
    _list(row.get("guidance"), f"{where}.guidance", _str)


def _bool(value: Any, where: str) -> None:
    _need(isinstance(value, bool), where, "not a boolean")


def _module_row(value: Any, where: str, traced: bool) -> None:
    """A submodule's configuration and, in a record that has it, the structure it was traced with."""
    row = _obj(value, where)
    _str(row.get("class"), f"{where}.class")
    _obj(row.get("hyper"), f"{where}.hyper", optional=True)
    if not traced:
        return
    _str(row.get("forward"), f"{where}.forward")
    hooks = row.get("hooks")
    _need(isinstance(hooks, list) and len(hooks) == 2, f"{where}.hooks", "not [forward hooks, pre-hooks]")
    _ints(hooks, f"{where}.hooks")
    _bool(row.get("override"), f"{where}.override")
    _bool(row.get("training"), f"{where}.training")
    _list(row.get("shadows"), f"{where}.shadows", _str, optional=False)


def _module(value: Any, where: str) -> None:
    block = _obj(value, where, optional=True)
    _obj(block.get("config"), f"{where}.config", optional=True)
    traced = "global_hooks" in block  # records sealed before the traced structure have neither
    if traced:
        _bool(block["global_hooks"], f"{where}.global_hooks")
    for fqn, row in _obj(block.get("tree"), f"{where}.tree", optional=True).items():
        _module_row(row, f"{where}.tree.{fqn or '(root)'}", traced)


def metadata_problem(meta: Mapping[str, Any]) -> str | None:
    """The first field adopt would misread, as `field: why`, or None when every one has its shape."""
    try:
        for name in ("key", "kind", "sm", "torch"):
            _str(meta.get(name), name)
        host = _obj(meta.get("host"), "host", optional=True)
        _obj(host.get("isa"), "host.isa", optional=True)
        _obj(host.get("cxx"), "host.cxx", optional=True)
        for lib, need in _obj(host.get("runtime"), "host.runtime", optional=True).items():
            _need(
                isinstance(need, str) and bool(_VERSION.fullmatch(need)),
                f"host.runtime.{lib}",
                "not a version",
            )
        graph = _obj(meta.get("graph"), "graph")
        _str(meta.get("device"), "device", optional=True)
        _str(meta.get("stamp"), "stamp", optional=True)
        _str(meta.get("cgbuild"), "cgbuild", optional=True)
        _str(graph.get("digest"), "graph.digest")
        _int(graph.get("nodes"), "graph.nodes", optional=True)
        toolchain = _obj(meta.get("toolchain"), "toolchain")
        _str(toolchain.get("fold"), "toolchain.fold")
        _obj(toolchain.get("components"), "toolchain.components", optional=True)
        _list(meta.get("facets"), "facets", _facet)
        for name, block in _obj(meta.get("axes"), "axes", optional=True).items():
            _obj(block, f"axes.{name}")
        contract = _obj(graph.get("contract"), "graph.contract")
        _list(contract.get("inputs"), "graph.contract.inputs", _input)
        names = [i["name"] for i in contract.get("inputs") or []]
        _need(len(names) == len(set(names)), "graph.contract.inputs", "names repeat")
        _list(contract.get("symbols"), "graph.contract.symbols", _symbol)
        outputs = _obj(contract.get("outputs"), "graph.contract.outputs", optional=True)
        _list(outputs.get("leaves"), "graph.contract.outputs.leaves", _leaf)
        constants = _obj(meta.get("constants"), "constants", optional=True)
        _list(constants.get("state"), "constants.state", _constant)
        _list(
            constants.get("literal"),
            "constants.literal",
            lambda v, w: _str(_obj(v, w).get("fqn"), f"{w}.fqn"),
        )
        layout = _obj(meta.get("layout"), "layout", optional=True)
        _list(layout.get("tensors"), "layout.tensors", _layout_row)
        _str(layout.get("stamp"), "layout.stamp", optional=True)
        _obj(layout.get("rule"), "layout.rule", optional=True)
        _lanes(meta.get("lanes"), "lanes")
        _module(meta.get("module"), "module")
    except Malformed as e:
        return str(e)
    return None
