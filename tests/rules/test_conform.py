"""A call is bound through the served callable's signature before the contract is checked: by
position or keyword as traced, defaults filled in; a value the program never took is refused
unless it is that parameter's default."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from cgbuild_rules.adopt.contract import conform

from cgbuild.protocol.contract import CallContract, Input

CONTRACT = CallContract((Input("x"), Input("scale", keyword=True)))


def forward(
    x: Any, scale: Any = 1.0, mask: Any = None, temperature: Any = 1.0, return_dict: bool = False
) -> Any:
    return x


SIG = inspect.signature(forward)


def test_a_call_lands_where_the_program_reads_it() -> None:
    x = torch.ones(2)
    assert conform(CONTRACT, SIG, (), {"x": x, "scale": 2.0}) == ((x,), {"scale": 2.0})  # keyword → position
    assert conform(CONTRACT, SIG, (x, 2.0), {}) == ((x,), {"scale": 2.0})  # position → keyword
    assert conform(CONTRACT, SIG, (x,), {}) == ((x,), {"scale": 1.0})  # the default filled in
    assert conform(CONTRACT, SIG, (x,), {"mask": None, "return_dict": False}) == ((x,), {"scale": 1.0})


def test_a_value_the_program_never_took_is_refused_unless_default() -> None:
    x = torch.ones(2)
    assert conform(CONTRACT, SIG, (x,), {"return_dict": True}) is None  # would be ignored: refused
    assert conform(CONTRACT, SIG, (x,), {"mask": torch.ones(2)}) is None  # a tensor is never "the default"
    assert conform(CONTRACT, SIG, (x,), {"temperature": torch.ones(2)}) is None  # nor compared elementwise
    assert conform(CONTRACT, SIG, (x,), {"nope": 1}) is None  # does not bind at all
    assert conform(CONTRACT, SIG, (), {}) is None  # x missing
