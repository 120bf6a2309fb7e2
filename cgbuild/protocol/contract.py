"""The call contract a program was traced with, as frozen values (`CallContract`).

What a caller passes (each input's leaves: a tensor's dtype, device, shape and strides, or the
constant the program baked), what it gets back, and the symbols its sizes range over. It comes
from sealed metadata anyone could have written, so `CallContract.from_json` checks every field
it builds (`Malformed`, naming the field): a shape or stride naming a symbol the contract does
not declare, a negative size, a tree nested past `DEPTH` or holding other leaves than its input
lists. The mint seals `to_json` of the trace's contract parsed here, so this module is the one
definition of the sealed shape; `to_json` writes exactly what the trace rule wrote.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import Any, TypeAlias

from cgbuild.core.fields import each, need, obj, string

Dim: TypeAlias = int | str
"""A size or stride: an integer, or an expression of the contract's symbols (`S0`, `2*S0`)."""
Baked: TypeAlias = bool | int | float | str | None
"""A leaf the program baked as a constant: a call must pass that value."""
Context: TypeAlias = "bool | int | str | tuple[Context, ...] | None"
Tree: TypeAlias = "str | tuple[str, Context, tuple[Tree, ...]]"
"""A pytree's nesting as traced: `*` for a leaf, else (type, context, children)."""

DEPTH = 32
"""How deep a tree or context may nest: far past any call a module takes, and short of the
interpreter's recursion limit, which a hostile file would otherwise reach."""
_NAME = re.compile(r"([A-Za-z_]\w*)\s*(\(?)")


@dataclass(frozen=True)
class Leaf:
    """A tensor leaf as traced."""

    dtype: str
    device: str
    shape: tuple[Dim, ...]
    stride: tuple[Dim, ...] | None = None
    """The strides it was traced with; None for an output, or an input sealed before strides
    were recorded (such inputs were traced contiguous)."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dtype": self.dtype, "device": self.device, "shape": list(self.shape)}
        return out if self.stride is None else {**out, "stride": list(self.stride)}


@dataclass(frozen=True)
class Input:
    """One parameter of the traced call, by the name the forward gives it."""

    name: str
    keyword: bool = False
    tree: Tree | None = None
    leaves: tuple[Leaf | Baked, ...] = ()

    @property
    def rank(self) -> int | None:
        """The rank of an input that is one tensor, else None."""
        leaf = self.leaves[0] if len(self.leaves) == 1 else None
        return len(leaf.shape) if isinstance(leaf, Leaf) else None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "keyword": self.keyword,
            "tree": _tree_json(self.tree),
            "leaves": [_leaf_json(v) for v in self.leaves],
        }


@dataclass(frozen=True)
class Symbol:
    """A size the program takes in a range (`min`, `max`: None where unbounded)."""

    name: str
    min: int | None = None
    max: int | None = None


@dataclass(frozen=True)
class Outputs:
    tree: Tree | None = None
    leaves: tuple[Leaf | Baked, ...] = ()


@dataclass(frozen=True)
class CallContract:
    """What a compiled program takes and returns."""

    inputs: tuple[Input, ...] = ()
    outputs: Outputs = field(default_factory=Outputs)
    symbols: tuple[Symbol, ...] = ()
    strides: tuple[tuple[str, tuple[Dim, ...]], ...] = ()
    """The inputs not traced contiguous, by leaf name, with their strides: what the graph digest
    holds of the layout, for `plan` and `why` to name."""

    @property
    def bounds(self) -> dict[str, tuple[int | None, int | None]]:
        return {s.name: (s.min, s.max) for s in self.symbols}

    def without(self, supplied: Collection[str]) -> CallContract:
        """The contract a caller's call is fitted to (and `cgbuild inspect` shows): this one
        without the inputs adopt passes itself (`supplied`, by name: the lane selector) and the
        symbols only they use, so a lanes artifact takes the module's own call and counts as
        static when only its selector has symbols."""
        kept = tuple(i for i in self.inputs if i.name not in supplied)
        dropped = _names([i for i in self.inputs if i.name in supplied]) - _names(kept)
        return replace(self, inputs=kept, symbols=tuple(s for s in self.symbols if s.name not in dropped))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "inputs": [i.to_json() for i in self.inputs],
            "outputs": {
                "tree": _tree_json(self.outputs.tree),
                "leaves": [_leaf_json(v) for v in self.outputs.leaves],
            },
            "symbols": [{"name": s.name, "min": s.min, "max": s.max} for s in self.symbols],
        }
        if self.strides:
            out["strides"] = {name: list(dims) for name, dims in self.strides}
        return out

    @staticmethod
    def from_json(value: Any, where: str = "contract") -> CallContract:
        """The contract of a JSON document; `Malformed` naming the first field that is wrong."""
        doc = obj(value, where)
        symbols = tuple(each(doc.get("symbols"), f"{where}.symbols", _symbol))
        declared = {s.name for s in symbols}
        inputs = tuple(each(doc.get("inputs"), f"{where}.inputs", lambda v, w: _input(v, w, declared)))
        names = [i.name for i in inputs]
        need(len(names) == len(set(names)), f"{where}.inputs", "names repeat")
        outs = obj(doc.get("outputs"), f"{where}.outputs", optional=True)
        out_leaves = tuple(
            each(outs.get("leaves"), f"{where}.outputs.leaves", lambda v, w: _leaf(v, w, None))
        )
        outputs = Outputs(_tree(outs.get("tree"), f"{where}.outputs", len(out_leaves)), out_leaves)
        laid = obj(doc.get("strides"), f"{where}.strides", optional=True)
        for name, dims in laid.items():
            _dims(dims, f"{where}.strides.{name}", declared)
        strides = tuple((name, tuple(dims)) for name, dims in laid.items())
        return CallContract(inputs, outputs, symbols, strides)


def _names(inputs: Collection[Input]) -> set[str]:
    """The symbols the tensor leaves of `inputs` name in their sizes and strides."""
    out: set[str] = set()
    for spec in inputs:
        for leaf in spec.leaves:
            if isinstance(leaf, Leaf):
                for d in [*leaf.shape, *(leaf.stride or ())]:
                    out.update(_symbols(d) if isinstance(d, str) else ())
    return out


def _symbols(dim: str) -> list[str]:
    """The names a rendered size uses as symbols (a name before `(` is a function: `Max(S0, 2)`)."""
    return [name for name, call in _NAME.findall(dim) if not call]


def _symbol(value: Any, where: str) -> Symbol:
    sym = obj(value, where)
    string(sym.get("name"), f"{where}.name")
    for bound in ("min", "max"):
        need(sym.get(bound) is None or type(sym.get(bound)) is int, f"{where}.{bound}", "not an integer")
    return Symbol(sym["name"], sym.get("min"), sym.get("max"))


def _dims(value: Any, where: str, declared: Collection[str] | None) -> None:
    """Sizes or strides: each a non-negative integer or an expression of declared symbols (an
    output's may name sizes the program makes itself: `declared` is None there)."""

    def dim(d: Any, at: str) -> None:
        need((type(d) is int and d >= 0) or isinstance(d, str), at, "not a size")
        unknown = (
            [n for n in _symbols(d) if n not in declared]
            if isinstance(d, str) and declared is not None
            else []
        )
        need(not unknown, at, f"names {unknown[0] if unknown else ''!r}, not a declared symbol")

    each(value, where, dim, optional=False)


def _leaf(value: Any, where: str, declared: Collection[str] | None) -> Leaf | Baked:
    if not isinstance(value, dict):
        need(value is None or isinstance(value, (bool, int, float, str)), where, "not a tensor or constant")
        return value  # type: ignore[no-any-return]
    string(value.get("dtype"), f"{where}.dtype")
    string(value.get("device"), f"{where}.device")
    _dims(value.get("shape"), f"{where}.shape", declared)
    stride = value.get("stride")
    if stride is not None:
        _dims(stride, f"{where}.stride", declared)
        need(len(stride) == len(value["shape"]), f"{where}.stride", "not one stride per dimension")
    return Leaf(
        value["dtype"], value["device"], tuple(value["shape"]), None if stride is None else tuple(stride)
    )


def _input(value: Any, where: str, declared: Collection[str]) -> Input:
    spec = obj(value, where)
    string(spec.get("name"), f"{where}.name")
    need(isinstance(spec.get("keyword", False), bool), f"{where}.keyword", "not a boolean")
    leaves = tuple(each(spec.get("leaves"), f"{where}.leaves", lambda v, w: _leaf(v, w, declared)))
    return Input(
        spec["name"], spec.get("keyword", False), _tree(spec.get("tree"), where, len(leaves)), leaves
    )


def _tree(value: Any, where: str, leaves: int) -> Tree | None:
    """The tree at `where.tree`, holding as many leaves as listed beside it (None when absent)."""
    if value is None:
        return None
    tree, count = _node(value, f"{where}.tree", 0)
    need(count == leaves, f"{where}.tree", f"holds {count} leaves, {leaves} listed")
    return tree


def _node(value: Any, where: str, depth: int) -> tuple[Tree, int]:
    need(depth < DEPTH, where, f"nested deeper than {DEPTH}")
    if value == "*":
        return "*", 1
    need(isinstance(value, list) and len(value) == 3, where, "not '*' or [type, context, children]")
    string(value[0], f"{where}[0]")
    need(isinstance(value[2], list), f"{where}[2]", "not a list")
    children: list[Tree] = []
    total = 0
    for i, child in enumerate(value[2]):
        node, count = _node(child, f"{where}[2][{i}]", depth + 1)
        children.append(node)
        total += count
    return (value[0], _context(value[1], f"{where}[1]", depth + 1), tuple(children)), total


def _context(value: Any, where: str, depth: int) -> Context:
    need(depth < DEPTH, where, f"nested deeper than {DEPTH}")
    if isinstance(value, list):
        return tuple(_context(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))
    need(value is None or isinstance(value, (bool, int, str)), where, "not a pytree context")
    return value  # type: ignore[no-any-return]


def _tree_json(tree: Tree | Context) -> Any:
    return [_tree_json(t) for t in tree] if isinstance(tree, tuple) else tree


def _leaf_json(leaf: Leaf | Baked) -> Any:
    return leaf.to_json() if isinstance(leaf, Leaf) else leaf
