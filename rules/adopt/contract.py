"""A call against the traced contract: dtypes, devices, shapes, symbol ranges and strides, and
the inputs copied into the traced layout where only their strides or alignment differ; the
inputs adopt passes itself (the lane selector) held to it once, and placed among a call's leaves.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import torch
from cgbuild_rules.adopt.refusal import Refusal
from cgbuild_rules.weights import ALIGN
from torch.utils import _pytree as pytree

from cgbuild.core.codes import Code
from cgbuild.protocol.contract import CallContract, Leaf


# ---- call contracts ----------------------------------------------------------------------------
def _dim_value(expr: str, bound: Mapping[str, int]) -> int | None:
    """Evaluate a rendered size (`7`, `S0`, `2*S0`, `S0 + 1`); None if it is not that simple."""
    total = 0
    for term in expr.replace(" ", "").split("+"):
        prod = 1
        for factor in term.split("*"):
            if factor.isdigit():
                prod *= int(factor)
            elif factor in bound:
                prod *= bound[factor]
            else:
                return None
        total += prod
    return total


def _contiguous(shape: list[int]) -> list[int]:
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= max(size, 1)
    return out[::-1]


def _overlapping(shape: list[int], stride: list[int]) -> bool:
    """Whether a layout may address one element from two indices (a stride-0 broadcast, an
    `as_strided` window): no copy can be written into it. Dimensions by ascending stride, each
    must step past everything the smaller ones span."""
    span = 0
    for step, size in sorted((w, n) for n, w in zip(shape, stride, strict=True) if n > 1):
        if step <= span:
            return True
        span += step * (size - 1)
    return False


def _as_traced(g: torch.Tensor, want: list[int]) -> torch.Tensor | None:
    """`g` itself when the package may read it as traced (the strides it was traced with on
    every dimension longer than one, an aligned start), else a copy laid out that way; None
    for an input that cannot be laid out so (overlapping traced strides, such as a stride-0
    dimension an artifact sealed before the trace refused it was traced with: only a call
    passing that same broadcast, aligned, is read as traced)."""
    if g.numel() == 0:
        return g
    same = all(n <= 1 or s == w for n, s, w in zip(g.shape, g.stride(), want, strict=True))
    if same and g.data_ptr() % ALIGN == 0:
        return g
    if _overlapping(list(g.shape), want):
        return None
    try:
        out = torch.empty_strided(g.shape, want, dtype=g.dtype, device=g.device)
    except RuntimeError:
        return None
    return out.copy_(g)


def fit(
    contract: CallContract,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    restrided: list[str] | None = None,
) -> tuple[Refusal | None, list[Any]]:
    """Does this call fit the contract? Returns (why not, or None) and the call's leaves in order.

    A package reads each input with the strides it was traced with, unchecked: an expanded
    (stride-0), transposed, sliced or channels-last view would be read as if laid out as traced.
    So an input whose strides (on dimensions longer than one) or 16-byte alignment differ is
    copied into the traced layout first, its name appended to `restrided`. Artifacts sealed
    before the contract recorded strides were traced with contiguous inputs (every entry then
    built them so) and are held to that.
    """
    positional = [i for i in contract.inputs if not i.keyword]
    keywords = {i.name for i in contract.inputs if i.keyword}
    if len(args) != len(positional) or set(kwargs) != keywords:
        takes = f"{len(positional)} positional + {sorted(keywords)}"
        return Refusal(
            Code.CALL_STRUCTURE,
            f"call passes {len(args)} positional + {sorted(kwargs)}, artifact takes {takes}",
        ), []
    bounds = contract.bounds
    bound: dict[str, int] = {}
    leaves: list[Any] = []
    pending: list[tuple[str, str, int]] = []
    tensors: list[tuple[str, torch.Tensor, Leaf]] = []
    positions: list[int] = []
    arg_iter = iter(args)
    for spec in contract.inputs:
        value = kwargs[spec.name] if spec.keyword else next(arg_iter)
        got = pytree.tree_leaves(value)
        want = spec.leaves
        if len(got) != len(want):
            return Refusal(
                Code.CALL_STRUCTURE, f"{spec.name}: {len(got)} leaves, artifact takes {len(want)}"
            ), []
        for j, (g, w) in enumerate(zip(got, want, strict=True)):
            where = spec.name + (f"[{j}]" if len(want) > 1 else "")
            if not isinstance(w, Leaf):
                if isinstance(g, torch.Tensor) or g != w:
                    return Refusal(Code.CONSTANT_ARG, f"{where}: {g!r} where the program baked {w!r}"), []
                leaves.append(g)
                continue
            if (why := _tensor_refusal(where, g, w, bounds, bound, pending)) is not None:
                return why, []
            positions.append(len(leaves))
            tensors.append((where, g, w))
            leaves.append(g)
    why = _pending_refusal(pending, bound) or _laid_out(tensors, leaves, positions, bound, restrided)
    return why, [] if why else leaves


def distance(contract: CallContract, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int | None:
    """How far a call's tensor sizes lie from what the contract takes: per size, its distance to
    the traced size, or to the nearer end of a symbol's range (0 inside it); None for a call of
    another structure. What makes one class the closest to a call that no class covers."""
    positional = [i for i in contract.inputs if not i.keyword]
    if len(args) != len(positional) or set(kwargs) != {i.name for i in contract.inputs if i.keyword}:
        return None
    bounds = contract.bounds
    arg_iter = iter(args)
    total = 0
    for spec in contract.inputs:
        value = kwargs[spec.name] if spec.keyword else next(arg_iter)
        for g, w in zip(pytree.tree_leaves(value), spec.leaves, strict=False):
            if not isinstance(w, Leaf) or not isinstance(g, torch.Tensor) or g.dim() != len(w.shape):
                continue
            for size, dim in zip(g.shape, w.shape, strict=True):
                if isinstance(dim, int):
                    total += abs(size - dim)
                elif dim in bounds:
                    lo, hi = bounds[dim]
                    total += max(0, (size if lo is None else lo) - size, size - (size if hi is None else hi))
    return total


def _tensor_refusal(
    where: str,
    g: Any,
    w: Leaf,
    bounds: Mapping[str, tuple[int | None, int | None]],
    bound: dict[str, int],
    pending: list[tuple[str, str, int]],
) -> Refusal | None:
    """Why tensor leaf `g` does not fit its traced leaf `w`: its kind, dtype, device, rank and each
    size (a symbol binds on first sight and must agree after, within its range; an expression of
    symbols is checked once all are bound, from `pending`)."""
    if not isinstance(g, torch.Tensor):
        return Refusal(Code.NOT_A_TENSOR, f"{where}: {type(g).__name__}, artifact takes a tensor")
    dtype = str(g.dtype).removeprefix("torch.")
    if dtype != w.dtype:
        return Refusal(Code.DTYPE, f"{where}: {dtype}, artifact takes {w.dtype}")
    if g.device.type != w.device:
        return Refusal(Code.DEVICE, f"{where}: on {g.device.type}, artifact takes {w.device}")
    if g.dim() != len(w.shape):
        return Refusal(Code.SHAPE, f"{where}: rank {g.dim()}, artifact takes {len(w.shape)}")
    for axis, (size, dim) in enumerate(zip(g.shape, w.shape, strict=True)):
        if isinstance(dim, int):
            if size != dim:
                return Refusal(Code.SHAPE, f"{where} dim {axis}: {size}, artifact takes {dim}")
        elif dim in bounds:
            lo, hi = bounds[dim]
            if bound.setdefault(dim, size) != size:
                return Refusal(Code.SHAPE, f"{where} dim {axis}: {size}, but {dim} = {bound[dim]}")
            if (lo is not None and size < lo) or (hi is not None and size > hi):
                return Refusal(Code.SYMBOL_RANGE, f"{where} dim {axis}: {size} outside {dim} ∈ [{lo}, {hi}]")
        else:
            pending.append((f"{where} dim {axis}", dim, size))
    return None


def _pending_refusal(pending: list[tuple[str, str, int]], bound: Mapping[str, int]) -> Refusal | None:
    """Why a size traced as an expression of symbols is not what the bound symbols make it."""
    for where, expr, size in pending:
        value = _dim_value(expr, bound)
        if value is None:
            return Refusal(Code.SHAPE, f"{where}: size {expr!r} is not checkable here")
        if value != size:
            return Refusal(Code.SHAPE, f"{where}: {size}, artifact takes {expr} = {value}")
    return None


def _laid_out(
    tensors: list[tuple[str, Any, Leaf]],
    leaves: list[Any],
    positions: list[int],
    bound: Mapping[str, int],
    restrided: list[str] | None,
) -> Refusal | None:
    """Each tensor leaf in its traced layout (copied where its strides or alignment differ, in
    `leaves` at its position), or why one cannot be."""
    for i, (where, g, w) in enumerate(tensors):
        recorded = None if w.stride is None else list(w.stride)
        shape = list(g.shape)
        want = _contiguous(shape) if recorded is None else [_dim_value(str(d), bound) for d in recorded]
        if any(d is None for d in want) or len(want) != g.dim():
            return Refusal(Code.STRIDE, f"{where}: traced strides {recorded} are not checkable here")
        laid = _as_traced(g, want)  # type: ignore[arg-type]
        if laid is None:
            return Refusal(
                Code.STRIDE,
                f"{where}: cannot lay out {shape} with traced strides {want} (overlapping: a copy "
                "cannot be written into them); only a call passing that layout, aligned, is served",
            )
        if laid is not g:
            leaves[positions[i]] = laid
            if restrided is not None:
                restrided.append(where)
    return None


def conform(
    contract: CallContract,
    signature: inspect.Signature,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The call (`args`, `kwargs`) in the traced convention, bound through the served callable's
    signature: an argument passed by position where the trace took it by keyword (or the other
    way), or left to its default, lands where the program reads it. None when the call does not
    bind, or passes a value other than its default for a parameter the program never took (that
    value would be ignored: never computed wrong)."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    given = dict(bound.arguments)
    for name, param in signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            given.update(given.pop(name, {}))
    traced = {i.name for i in contract.inputs}
    for name, value in given.items():
        known = signature.parameters.get(name)
        default = known.default if known is not None else inspect.Parameter.empty
        if name not in traced and not _is_default(value, default):
            return None
    if any(i.name not in given for i in contract.inputs):
        return None
    positional = tuple(given[i.name] for i in contract.inputs if not i.keyword)
    return positional, {i.name: given[i.name] for i in contract.inputs if i.keyword}


def _is_default(value: Any, default: Any) -> bool:
    """Whether a value the program never took is its parameter's default (a tensor never is:
    comparing one is no answer, and its values would be ignored)."""
    if value is default:
        return True
    if isinstance(value, torch.Tensor) or isinstance(default, torch.Tensor):
        return False
    try:
        return bool(value == default)
    except Exception:  # a value whose comparison raises is not known to be the default
        return False


# ---- inputs adopt supplies itself (the lane selector) --------------------------------------------
def supplied_positions(contract: CallContract, supplied: Mapping[str, Any]) -> list[tuple[int, Any]]:
    """(leaf index in the sealed contract, value) of each supplied input, ascending: inserted in
    this order into a caller's fitted leaves, each lands where the program reads it."""
    out: list[tuple[int, Any]] = []
    index = 0
    for spec in contract.inputs:
        if spec.name in supplied:
            out.append((index, supplied[spec.name]))
        index += len(spec.leaves)
    return out


def supplied_refusal(contract: CallContract, supplied: Mapping[str, Any]) -> Refusal | None:
    """Why an input adopt passes itself does not fit the program (`lane-selector`), or None.

    A compiled lanes program reads its selector's sizes unchecked: a size no value has runs the
    last value. So the selector built from the sealed lanes table is held to the sealed contract
    (dtype, rank, each size within its symbol's range) once, before the first call."""
    traced = [i for i in contract.inputs if i.name in supplied]
    absent = sorted(set(supplied) - {i.name for i in traced})
    if absent:
        return Refusal(Code.LANE_SELECTOR, f"the program takes no input {absent[0]!r}")
    sub = CallContract(tuple(dataclasses.replace(i, keyword=True) for i in traced), symbols=contract.symbols)
    why, _ = fit(sub, (), supplied)
    if why is None:
        return None
    return Refusal(Code.LANE_SELECTOR, f"{why.detail} ({why.code}): the lane would not be the one chosen")
