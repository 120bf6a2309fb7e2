"""A pipeline's call in the convention an entry traced, through the entry's call adapter
(`cgbuild.config.calls`): what the serving call passes that the program never took, the first
row of an input passed with a batch dimension the module itself drops, the output's wrapping.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from cgbuild_rules.adopt.contract import conform
from cgbuild_rules.adopt.refusal import Refusal

from cgbuild.config.calls import CallAdapter
from cgbuild.core.codes import Code
from cgbuild.protocol.contract import CallContract


def passed(call: CallAdapter, kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], Refusal | None]:
    """The keywords without those the adapter accounts for, or why this call is not one it
    serves (a value other than the one the adapter names: the program would ignore it)."""
    rest = dict(kwargs)
    for name, value in call.passes.items():
        if name not in rest:
            continue
        got = rest.pop(name)
        if isinstance(got, torch.Tensor) or type(got) is not type(value) or got != value:
            return rest, Refusal(Code.CALL_STRUCTURE, f"{name}={got!r}: the adapter serves {name}={value!r}")
    return rest, None


def adapted(
    call: CallAdapter,
    contract: CallContract,
    signature: inspect.Signature | None,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The call bound by name to the program's inputs (`conform`), each `first_row` input that
    has one dimension more than traced replaced by its first row; None when it does not bind."""
    if signature is None:
        return None
    bound = conform(contract, signature, args, kwargs)
    if bound is None:
        return None
    positional, keywords = list(bound[0]), dict(bound[1])
    names = [i.name for i in contract.inputs if not i.keyword]
    ranks = {i.name: i.rank for i in contract.inputs}
    for name in call.first_row:
        here: dict[str, Any] | list[Any]
        slot: str | int
        if name in keywords:
            here, slot = keywords, name
        elif name in names:
            here, slot = positional, names.index(name)
        else:
            continue
        value = here[slot]  # type: ignore[index]
        rank = ranks.get(name)
        if isinstance(value, torch.Tensor) and rank is not None and value.dim() == rank + 1:
            here[slot] = value[0]  # type: ignore[index]
    return tuple(positional), keywords


def wrapped(call: CallAdapter | None, out: Any) -> Any:
    """The program's output as the serving call expects it."""
    return (out,) if call is not None and call.returns == "tuple" else out
