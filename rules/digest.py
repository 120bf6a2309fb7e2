"""Canonical render and graph digest of a torch.export ExportedProgram.

The graph digest is the `graph` key axis: same computation → same digest on any machine, whatever
the process, the hash seed, the file layout or the weights. It is computed from the DEFAULT
(pre-decomposition) export: decompositions differ by device (e.g. fused rms_norm on CUDA) and lower
attention to whatever backend the tracing box happens to pick, so a CUDA graph traced on a CPU box
would not match the mint machine's.

What is rendered, one line per node in graph order:
- positional node refs (`n0`, `n1`, …): node names are generated and carry nothing;
- op targets by qualified name (`aten.linear.default`, `_operator.getitem`);
- every value typed: floats as `float.hex` (exact, locale-free), strings quoted, kwargs sorted;
- tensors as `T(dtype|shape|device-type)`: `str(graph)` and `graph_module.code` omit shapes and
  dtypes, so batch 8 and 16 would collide; strides and device indices are left out of the lines
  (the tracer's choices inside the program);
- symbolic sizes renamed `S0, S1, …` in first-appearance order, so the tracer's internal symbol
  names (hash-derived) never matter, with their range constraints as sorted lines.
Beside the lines: the input/output signature (kinds, positions, target FQNs), the call contract
(parameter names, pytree nesting, dtypes, shapes, symbol bounds) and the VALUES of trace-baked
literals (constants that are not state-dict weights): a literal is part of the computation, a
weight is not. Last, the traced strides of the inputs not laid out contiguously (`strides`,
absent when all are): a package reads its inputs with them, so they are the program's.
Stack traces, module stacks and file paths in node meta are never read.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ConstantArgument,
    CustomObjArgument,
    InputSpec,
    OutputSpec,
    SymBoolArgument,
    SymFloatArgument,
    SymIntArgument,
    TensorArgument,
    TokenArgument,
)
from torch.utils._pytree import TreeSpec

from cgbuild.core.canon import canonical_json, digest
from cgbuild.core.codes import Code

SCHEME = "cgbuild.graph/1"
"""Version of the render. Bump it whenever a rendering rule changes: every graph digest moves."""


class TraceError(Exception):
    """A typed failure of a trace job; `code` is the result line's `code` field."""

    code = Code.TRACE_FAILED

    def __init__(self, detail: str, code: Code | None = None) -> None:
        super().__init__(detail)
        if code is not None:
            self.code = code


class LiteralHidden(TraceError):
    """A trace-baked literal's value is invisible (fake/meta tensor) and was not supplied.

    Hashing its shape alone would let two programs that differ only in a baked table share a key.
    """

    code = Code.LITERAL_HIDDEN


@dataclass(frozen=True)
class GraphFacts:
    """What the trace rule reports for one exported program."""

    digest: str
    contract: dict[str, Any]
    topology: list[list[Any]]
    nodes: int
    identity: dict[str, Any] = field(repr=False)
    """The digested object itself, for `inspect`/`diff` when two digests disagree."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def qualified_name(target: Any) -> str:
    """Stable qualified name of a call_function target (never a repr with an address)."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)  # aten.linear.default
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"  # type: ignore[no-untyped-call]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return str(target._qualified_op_name).replace("::", ".")
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    if module is None or qualname is None:
        raise TraceError(f"call target {type(target).__name__} has no qualified name")
    return f"{module}.{qualname}"


def is_hidden(t: torch.Tensor) -> bool:
    """True when the tensor's data cannot be read: a fake tensor, or a meta tensor."""
    return isinstance(t, FakeTensor) or t.is_meta


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a real tensor's contiguous bytes (dtype and shape are rendered beside it)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


class _Symbols:
    """Renames the tracer's symbols to S0, S1, … in first-appearance order."""

    _TOKEN = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")

    def __init__(self) -> None:
        self.names: dict[sympy.Symbol, sympy.Symbol] = {}
        self._cache: dict[sympy.Basic, str] = {}

    def expr(self, e: sympy.Basic) -> str:
        cached = self._cache.get(e)
        if cached is not None:
            return cached
        if e.free_symbols:
            # Order within one expression: by position in the tracer's own printing of it.
            by_name = {str(s): s for s in e.free_symbols}
            for token in self._TOKEN.findall(str(e)):
                sym = by_name.get(token)
                if sym is not None and sym not in self.names:
                    self.names[sym] = sympy.Symbol(f"S{len(self.names)}", **sym.assumptions0)
            out = str(e.xreplace(self.names))
        else:
            out = str(e)
        self._cache[e] = out
        return out


def _bound(v: Any) -> int | None:
    """Integer bound of a value range, None when unbounded (JSON has no infinity)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, sympy.Integer):
        return int(v)
    return None


class _Renderer:
    """Renders graphs and values; subgraphs (branches of higher-order ops) get g0, g1, … in order."""

    def __init__(self, symbols: _Symbols) -> None:
        self.sym = symbols
        self.subgraphs: list[list[str]] = []
        self._subgraph_ids: dict[int, int] = {}

    # -- values ----------------------------------------------------------------------------------
    def tensor(self, t: torch.Tensor) -> str:
        shape = ",".join(self.value(d) for d in t.shape)
        return f"T({dtype_name(t.dtype)}|[{shape}]|{t.device.type})"

    def value(self, v: Any, refs: Mapping[torch.fx.Node, int] | None = None) -> str:
        """Typed, unambiguous rendering of an argument or meta value."""
        if isinstance(v, torch.fx.Node):
            if refs is None or v not in refs:
                raise TraceError("node reference outside its graph")
            return f"n{refs[v]}"
        if v is None:
            return "None"
        if isinstance(v, bool):
            return "True" if v else "False"
        if isinstance(v, int):
            return str(v)
        if isinstance(v, float):
            return v.hex()
        if isinstance(v, str):
            return canonical_json(v)
        if isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool):
            return self.sym.expr(v.node.expr)
        if isinstance(v, torch.Tensor):
            if is_hidden(v):
                raise LiteralHidden("a tensor literal inside node arguments has no readable value")
            return f"{self.tensor(v)}#{tensor_sha256(v)}"
        if isinstance(v, torch.dtype):
            return str(v)
        if isinstance(v, torch.device):
            return f"device({v.type})"
        if isinstance(v, torch.layout | torch.memory_format):
            return str(v)
        if isinstance(v, list):
            return "[" + ", ".join(self.value(x, refs) for x in v) + "]"
        if isinstance(v, tuple):
            return "(" + ", ".join(self.value(x, refs) for x in v) + ("," if len(v) == 1 else "") + ")"
        if isinstance(v, dict):
            items = sorted((self.value(k, refs), self.value(x, refs)) for k, x in v.items())
            return "{" + ", ".join(f"{k}: {x}" for k, x in items) + "}"
        if isinstance(v, slice):
            return (
                f"slice({self.value(v.start, refs)}, {self.value(v.stop, refs)}, {self.value(v.step, refs)})"
            )
        if v is Ellipsis:
            return "..."
        if isinstance(v, torch._ops.OpOverload | torch._ops.HigherOrderOperator):
            return f"op({qualified_name(v)})"
        if isinstance(v, sympy.Basic):
            return self.sym.expr(v)
        raise TraceError(f"no canonical rendering for a {type(v).__module__}.{type(v).__qualname__} argument")

    def meta(self, node: torch.fx.Node) -> str:
        if "val" not in node.meta:
            return "-"
        v = node.meta["val"]
        return self._meta_value(v)

    def _meta_value(self, v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return self.tensor(v)  # a node's output: its value is computed, never baked
        if isinstance(v, list | tuple):
            inner = ", ".join(self._meta_value(x) for x in v)
            return f"[{inner}]" if isinstance(v, list) else f"({inner})"
        return self.value(v)

    # -- graphs ----------------------------------------------------------------------------------
    def graph(self, gm: torch.fx.GraphModule) -> tuple[list[str], dict[torch.fx.Node, int]]:
        refs: dict[torch.fx.Node, int] = {}
        lines: list[str] = []
        for i, node in enumerate(gm.graph.nodes):
            refs[node] = i
            head = f"n{i} = {node.op}"
            if node.op == "placeholder":
                lines.append(f"{head} -> {self.meta(node)}")
            elif node.op == "get_attr":
                lines.append(f"{head} {self._attr(gm, node.target)}")
            elif node.op == "call_function":
                args = ", ".join(self.value(a, refs) for a in node.args)
                kwargs = ", ".join(f"{k}={self.value(node.kwargs[k], refs)}" for k in sorted(node.kwargs))
                target = qualified_name(node.target)
                lines.append(f"{head} {target}({args}) {{{kwargs}}} -> {self.meta(node)}")
            elif node.op == "output":
                lines.append(f"{head} {self.value(node.args, refs)}")
            else:  # call_module / call_method never survive torch.export
                raise TraceError(f"unexpected {node.op} node in an exported graph")
        return lines, refs

    def _attr(self, gm: torch.fx.GraphModule, target: Any) -> str:
        obj: Any = gm
        for part in str(target).split("."):
            obj = getattr(obj, part)
        if isinstance(obj, torch.fx.GraphModule):
            key = id(obj)
            if key not in self._subgraph_ids:
                index = len(self.subgraphs)
                self._subgraph_ids[key] = index
                self.subgraphs.append([])  # reserve the slot: numbering is first-appearance order
                self.subgraphs[index] = self.graph(obj)[0]
            return f"g{self._subgraph_ids[key]}"
        if isinstance(obj, torch.Tensor):
            return self.value(obj)
        raise TraceError(f"get_attr of a {type(obj).__name__}: not renderable")


def _tree(spec: TreeSpec) -> Any:
    """Pytree nesting without addresses: '*' for a leaf, else [type, context, children]."""
    if spec.is_leaf():
        return "*"
    t = spec.type
    name = {tuple: "tuple", list: "list", dict: "dict"}.get(t) or f"{t.__module__}.{t.__qualname__}"
    children = [_tree(spec.child(i)) for i in range(spec.num_children)]
    return [name, _context(spec.context), children]


def _context(c: Any) -> Any:
    if c is None or isinstance(c, bool | int | str):
        return c
    if isinstance(c, float):
        return c.hex()
    if isinstance(c, list | tuple):
        return [_context(x) for x in c]
    if isinstance(c, type):
        return f"{c.__module__}.{c.__qualname__}"
    return f"<{type(c).__module__}.{type(c).__qualname__}>"


def _leaf(r: _Renderer, v: Any) -> Any:
    """Contract leaf: a tensor as {dtype, shape, device}; a symbolic/constant value as its text."""
    if isinstance(v, torch.Tensor):
        shape = [d if isinstance(d, int) else r.value(d) for d in v.shape]
        return {"dtype": dtype_name(v.dtype), "shape": shape, "device": v.device.type}
    if isinstance(v, bool | int | str) or v is None:
        return v
    return r.value(v)


def _arg_value(arg: Any, nodes: Mapping[str, torch.fx.Node]) -> Any:
    if isinstance(arg, ConstantArgument):
        return arg.value
    node = nodes.get(getattr(arg, "name", ""))
    return None if node is None else node.meta.get("val")


def _arg_ref(r: _Renderer, arg: Any, refs: Mapping[str, int]) -> str:
    if isinstance(arg, ConstantArgument):
        return f"const {r.value(arg.value)}"
    if isinstance(arg, TensorArgument | SymIntArgument | SymFloatArgument | SymBoolArgument | TokenArgument):
        if arg.name not in refs:
            raise TraceError("signature names a node that is not in the graph")
        return f"n{refs[arg.name]}"
    if isinstance(arg, CustomObjArgument):
        raise TraceError("custom-object arguments have no canonical rendering")
    raise TraceError(f"unknown signature argument {type(arg).__name__}")


def _signature(r: _Renderer, ep: ExportedProgram, refs: Mapping[str, int]) -> dict[str, list[list[Any]]]:
    def ins(s: InputSpec) -> list[Any]:
        return [s.kind.name, _arg_ref(r, s.arg, refs), s.target, s.persistent]

    def outs(s: OutputSpec) -> list[Any]:
        return [s.kind.name, _arg_ref(r, s.arg, refs), s.target]

    sig = ep.graph_signature
    return {"inputs": [ins(s) for s in sig.input_specs], "outputs": [outs(s) for s in sig.output_specs]}


def _contract(r: _Renderer, ep: ExportedProgram, nodes: Mapping[str, torch.fx.Node]) -> dict[str, Any]:
    """Call contract: what a caller must pass and gets back, named as the forward names them."""
    sig = ep.graph_signature
    user_in = [s for s in sig.input_specs if s.kind.name == "USER_INPUT"]
    user_out = [s for s in sig.output_specs if s.kind.name == "USER_OUTPUT"]
    in_spec = ep.call_spec.in_spec
    out_spec = ep.call_spec.out_spec
    leaves: Iterator[Any] = iter([_leaf(r, _arg_value(s.arg, nodes)) for s in user_in])

    names: list[str] = []
    for entry in ep.module_call_graph:
        if entry.fqn == "" and entry.signature is not None:
            names = list(entry.signature.forward_arg_names or [])
    inputs: list[dict[str, Any]] = []
    if in_spec is not None and not in_spec.is_leaf() and in_spec.num_children == 2:
        args_spec, kwargs_spec = in_spec.child(0), in_spec.child(1)
        for i in range(args_spec.num_children):
            child = args_spec.child(i)
            name = names[i] if i < len(names) else f"args[{i}]"
            inputs.append(_input(name, False, child, leaves))
        for i, key in enumerate(kwargs_spec.context or []):  # flatten order: leaves follow it
            inputs.append(_input(str(key), True, kwargs_spec.child(i), leaves))
    outputs = {
        "tree": _tree(out_spec) if out_spec is not None else None,
        "leaves": [_leaf(r, _arg_value(s.arg, nodes)) for s in user_out],
    }
    return {"inputs": inputs, "outputs": outputs}


def _input(name: str, keyword: bool, spec: TreeSpec, leaves: Iterator[Any]) -> dict[str, Any]:
    return {
        "name": name,
        "keyword": keyword,
        "tree": _tree(spec),
        "leaves": [next(leaves, None) for _ in range(spec.num_leaves)],
    }


def _literals(r: _Renderer, ep: ExportedProgram, supplied: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Values of trace-baked constants (non-persistent buffers, tensor attributes, lifted literals)."""
    out: list[list[str]] = []
    for s in ep.graph_signature.input_specs:
        if s.kind.name == "CUSTOM_OBJ":
            raise TraceError(f"custom-object constant {s.target!r} has no canonical value")
        if not is_literal(s):
            continue
        target = str(s.target)
        value = supplied.get(target)
        if value is None:
            value = ep.constants.get(target)
        if isinstance(value, FakeTensor) and getattr(value, "constant", None) is not None:
            value = value.constant
        if not isinstance(value, torch.Tensor):
            raise TraceError(f"constant {target!r} is a {type(value).__name__}, not a tensor")
        if is_hidden(value):
            raise LiteralHidden(
                f"the value of trace-baked constant {target!r} is hidden by fake/meta tensors"
            )
        out.append([target, r.tensor(value), tensor_sha256(value)])
    return out


def _ranges(r: _Renderer, ep: ExportedProgram) -> tuple[list[str], list[dict[str, Any]]]:
    lines: list[str] = []
    bounds: list[dict[str, Any]] = []
    # Symbols the graph never mentions still get a name, in a seed-independent order.
    for sym in sorted(ep.range_constraints, key=str):
        vr = ep.range_constraints[sym]
        name = r.sym.expr(sym)
        lines.append(f"{name}:[{vr.lower},{vr.upper}]")
        bounds.append({"name": name, "min": _bound(vr.lower), "max": _bound(vr.upper)})
    return sorted(lines), sorted(bounds, key=lambda b: b["name"])


def topology(ep: ExportedProgram) -> list[list[Any]]:
    """Sorted [fqn, dtype, shape] of the state dict (parameters and persistent buffers)."""
    rows: list[list[Any]] = []
    for fqn, t in ep.state_dict.items():
        rows.append([fqn, dtype_name(t.dtype), [int(d) for d in t.shape]])
    return sorted(rows)


def identity(ep: ExportedProgram, literals: Mapping[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """The canonical object the graph digest hashes (integers and strings only)."""
    return _identify(ep, literals)[0]


def _strides(r: _Renderer, ep: ExportedProgram, nodes: Mapping[str, torch.fx.Node]) -> list[Any]:
    """Per user input (flatten order), the strides it was traced with (None for a constant)."""
    out: list[Any] = []
    for s in ep.graph_signature.input_specs:
        if s.kind.name != "USER_INPUT":
            continue
        v = _arg_value(s.arg, nodes)
        tensor = isinstance(v, torch.Tensor)
        out.append([d if isinstance(d, int) else r.value(d) for d in v.stride()] if tensor else None)
    return out


def _laid_out(
    r: _Renderer, ep: ExportedProgram, nodes: Mapping[str, torch.fx.Node], contract: Mapping[str, Any]
) -> dict[str, list[Any]]:
    """Leaf name → traced strides of each tensor input NOT laid out contiguously ({} when all
    are): the layout part of the program's identity.

    A compiled package reads its inputs with the strides it was traced with, so two traces of one
    computation from other layouts are two programs, and an entry changed to trace another
    layout must re-mint. Contiguity is judged as the router judges a call (a dimension of size
    one or less, whose stride addresses nothing, never counts) and such a dimension's stride is
    rendered as its contiguous value, so two layouts that read the same memory name one program.
    A contiguous trace adds nothing: its identity, digest and key are what they were before
    strides entered them. Leaf names are the router's (`name`, or `name[j]` in a nested input).
    """
    values = iter(
        [_arg_value(s.arg, nodes) for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    )
    out: dict[str, list[Any]] = {}
    for spec in contract["inputs"]:
        leaves = spec["leaves"]
        for j in range(len(leaves)):
            v = next(values, None)
            if not isinstance(v, torch.Tensor):
                continue
            where = spec["name"] + (f"[{j}]" if len(leaves) > 1 else "")
            sizes = [sympy.sympify(d.node.expr if isinstance(d, torch.SymInt) else d) for d in v.shape]
            if any(s.is_number and s == 0 for s in sizes):
                continue  # no element: nothing is read
            step: sympy.Basic = sympy.Integer(1)
            wanted: list[sympy.Basic] = []
            for size in reversed(sizes):
                wanted.append(step)
                step = step * size
            wanted.reverse()
            rendered: list[Any] = []
            moved = False
            for size, d, want in zip(sizes, v.stride(), wanted, strict=True):
                got = sympy.sympify(d.node.expr if isinstance(d, torch.SymInt) else d)
                if size.is_number and size <= 1:
                    got = want
                elif sympy.expand(got - want) != 0:
                    moved = True
                rendered.append(int(got) if got.is_number else r.sym.expr(got))
            if moved:
                out[where] = rendered
    return out


def _with_strides(
    contract: Mapping[str, Any], strides: list[Any], laid_out: dict[str, Any]
) -> dict[str, Any]:
    """The contract as sealed: each tensor leaf also names its traced strides (the package reads
    its inputs with them, so adopt must know them), and `strides` the non-contiguous ones the
    digest holds (absent when every input is contiguous), for `plan` and `why` to name."""
    out: dict[str, Any] = json.loads(json.dumps(contract))
    flat = iter(strides)
    for spec in out["inputs"]:
        for leaf in spec["leaves"]:
            stride = next(flat, None)
            if isinstance(leaf, dict) and stride is not None:
                leaf["stride"] = stride
    if laid_out:
        out["strides"] = laid_out
    return out


def _identify(
    ep: ExportedProgram, literals: Mapping[str, torch.Tensor] | None
) -> tuple[dict[str, Any], list[Any]]:
    r = _Renderer(_Symbols())
    lines, node_refs = r.graph(ep.graph_module)
    by_name = {n.name: n for n in ep.graph.nodes}
    refs = {n.name: i for n, i in node_refs.items()}
    contract = _contract(r, ep, by_name)
    ranges, bounds = _ranges(r, ep)
    contract["symbols"] = bounds
    ident = {
        "scheme": SCHEME,
        "graph": lines,
        "subgraphs": r.subgraphs,
        "signature": _signature(r, ep, refs),
        "ranges": ranges,
        "contract": contract,
        "literals": _literals(r, ep, literals or {}),
    }
    # Rendered last, so no symbol is named by a stride before the program names it.
    laid_out = _laid_out(r, ep, by_name, contract)
    if laid_out:  # absent for a contiguous trace: its digest is what it was before strides counted
        ident["strides"] = laid_out
    return ident, _strides(r, ep, by_name)


def graph_facts(ep: ExportedProgram, literals: Mapping[str, torch.Tensor] | None = None) -> GraphFacts:
    """Digest, call contract and topology of a default (pre-decomposition) export.

    `literals` supplies real values, by constant target FQN, for trace-baked constants whose
    values the export could not see (fake or meta tensors); a hidden value not supplied raises
    `LiteralHidden`.
    """
    ident, strides = _identify(ep, literals)
    return GraphFacts(
        digest=digest(ident),
        contract=_with_strides(ident["contract"], strides, ident.get("strides") or {}),
        topology=topology(ep),
        nodes=len(ep.graph.nodes),
        identity=ident,
    )


def graph_digest(ep: ExportedProgram, literals: Mapping[str, torch.Tensor] | None = None) -> str:
    """sha256 hex of the canonical identity of `ep` (see the module docstring)."""
    return graph_facts(ep, literals).digest


def is_literal(s: InputSpec) -> bool:
    """A trace-baked constant: a lifted tensor constant or a non-persistent buffer (not a weight)."""
    return s.kind.name == "CONSTANT_TENSOR" or (s.kind.name == "BUFFER" and s.persistent is False)
