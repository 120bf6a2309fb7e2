"""The call contract as frozen values: parsed once from sealed metadata, refused by field name when
it has the wrong shape, and written back exactly as the trace rule writes it."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
from support.artifacts import stand_in_metadata

from cgbuild.core.fields import Malformed
from cgbuild.protocol.contract import DEPTH, CallContract, Input, Leaf, Outputs, Symbol
from cgbuild.store.metadata import metadata_problem
from cgbuild.store.sealed import parse

# What the trace rule writes (rules/digest.py): a dynamic batch, a nested keyword input, a baked
# constant, a transposed input named in `strides`, a tuple output.
TRACED: dict[str, Any] = {
    "inputs": [
        {
            "name": "x",
            "keyword": False,
            "tree": "*",
            "leaves": [{"dtype": "float32", "device": "cpu", "shape": ["S0", 8, 64], "stride": [512, 1, 8]}],
        },
        {
            "name": "extra",
            "keyword": True,
            "tree": ["dict", ["a", "b"], ["*", ["tuple", None, ["*", "*"]]]],
            "leaves": [
                {"dtype": "int64", "device": "cpu", "shape": [2, "2*S0"], "stride": ["2*S0", 1]},
                None,
                "0x1.8p+0",
            ],
        },
        {"name": "return_dict", "keyword": True, "tree": "*", "leaves": [False]},
    ],
    "outputs": {
        "tree": ["tuple", None, ["*"]],
        "leaves": [{"dtype": "float32", "device": "cpu", "shape": ["S0", 8, "u0"]}],
    },
    "symbols": [{"name": "S0", "min": 2, "max": 16}],
    "strides": {"x": [512, 1, 8]},
}


def test_the_traced_contract_parses_to_values_and_writes_back_byte_for_byte() -> None:
    contract = CallContract.from_json(TRACED)
    x, extra, flag = contract.inputs
    assert x == Input("x", False, "*", (Leaf("float32", "cpu", ("S0", 8, 64), (512, 1, 8)),))
    assert extra.tree == ("dict", ("a", "b"), ("*", ("tuple", None, ("*", "*"))))
    assert extra.leaves[1:] == (None, "0x1.8p+0") and flag.leaves == (False,)
    assert (x.rank, extra.rank, flag.rank) == (3, None, None)
    assert contract.outputs == Outputs(("tuple", None, ("*",)), (Leaf("float32", "cpu", ("S0", 8, "u0")),))
    assert contract.symbols == (Symbol("S0", 2, 16),) and contract.bounds == {"S0": (2, 16)}
    assert contract.strides == (("x", (512, 1, 8)),)
    assert contract.to_json() == TRACED  # the mint seals this: what the trace rule wrote
    assert CallContract.from_json(contract.to_json()) == contract


def test_a_contract_built_as_values_survives_its_own_json() -> None:
    built = CallContract(
        (Input("z", tree="*", leaves=(Leaf("bfloat16", "cuda", (1, "S1"), ("S1", 1)),)),),
        Outputs(None, (7,)),
        (Symbol("S1"),),
    )
    assert CallContract.from_json(built.to_json()) == built
    assert CallContract.from_json(CallContract().to_json()) == CallContract()


def test_without_drops_the_supplied_inputs_and_the_symbols_only_they_use() -> None:
    doc = copy.deepcopy(TRACED)
    doc["inputs"].append(
        {
            "name": "_cgbuild_lanes",
            "keyword": True,
            "tree": "*",
            "leaves": [{"dtype": "uint8", "device": "cpu", "shape": ["S1", 0], "stride": [1, 1]}],
        }
    )
    doc["symbols"].append({"name": "S1", "min": 2, "max": 4})
    mine = CallContract.from_json(doc).without(["_cgbuild_lanes"])
    assert mine == CallContract.from_json(TRACED)


def _bend(edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """The stand-in metadata with the traced contract, edited."""
    meta = stand_in_metadata("a" * 64)
    contract = copy.deepcopy(TRACED)
    edit(contract)
    meta["graph"]["contract"] = contract
    return meta


def _nested(depth: int) -> Any:
    tree: Any = "*"
    for _ in range(depth):
        tree = ["tuple", None, [tree]]
    return tree


def _listed(depth: int) -> Any:
    context: Any = None
    for _ in range(depth):
        context = [context]
    return context


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        node[int(last) if isinstance(node, list) else last] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (_set("inputs.0.name", 3), "graph.contract.inputs[0].name: not a string"),
        (_set("inputs.2.keyword", "yes"), "graph.contract.inputs[2].keyword: not a boolean"),
        (_set("inputs.0.leaves", {"dtype": "f32"}), "graph.contract.inputs[0].leaves: not a list"),
        (_set("inputs.2.leaves.0", [1]), "graph.contract.inputs[2].leaves[0]: not a tensor or constant"),
        (_set("symbols.0.max", 1.5), "graph.contract.symbols[0].max: not an integer"),
        (_set("inputs.1.name", "x"), "graph.contract.inputs: names repeat"),
        (
            _set("inputs.0.leaves.0.shape", ["S7", 8, 64]),
            "graph.contract.inputs[0].leaves[0].shape[0]: names 'S7', not a declared symbol",
        ),
        (
            _set("inputs.1.leaves.0.stride", ["2*S0 + S3", 1]),
            "graph.contract.inputs[1].leaves[0].stride[0]: names 'S3', not a declared symbol",
        ),
        (_set("strides.x", [512, "S9", 8]), "graph.contract.strides.x[1]: names 'S9', not a declared symbol"),
        (_set("inputs.0.leaves.0.stride", [512, -1, 8]), "inputs[0].leaves[0].stride[1]: not a size"),
        (_set("inputs.0.leaves.0.shape", ["S0", -8, 64]), "inputs[0].leaves[0].shape[1]: not a size"),
        (
            _set("inputs.0.leaves.0.stride", [1, 8]),
            "inputs[0].leaves[0].stride: not one stride per dimension",
        ),
        (_set("inputs.0.tree", _nested(DEPTH + 1)), f"inputs[0].tree{'[2][0]' * DEPTH}: nested deeper than"),
        (
            _set("inputs.1.tree", ["dict", _listed(DEPTH), ["*", "*", "*"]]),
            "inputs[1].tree[1]" + "[0]" * (DEPTH - 1) + ": nested deeper than",
        ),
        (_set("inputs.0.tree", ["tuple", None, ["*", "*"]]), "inputs[0].tree: holds 2 leaves, 1 listed"),
        (_set("outputs.tree", "*!"), "graph.contract.outputs.tree: not '*' or [type, context, children]"),
        (_set("outputs.tree", ["tuple", 1.5, ["*"]]), "graph.contract.outputs.tree[1]: not a pytree context"),
        (
            _set("outputs.leaves", [{"dtype": "float32", "shape": [1]}]),
            "outputs.leaves[0].device: not a string",
        ),
        (_set("strides", []), "graph.contract.strides: not an object"),
    ],
)
def test_a_hostile_contract_is_refused_naming_its_field(
    edit: Callable[[dict[str, Any]], None], field: str
) -> None:
    """Through the one parse adopt and `cgbuild inspect` read artifacts with, and the store's
    admission check: the same refusal, naming the field."""
    meta = _bend(edit)
    with pytest.raises(Malformed) as refused:
        parse(meta)
    assert field in str(refused.value)
    assert metadata_problem(meta) == str(refused.value)


def test_a_deep_tree_within_the_limit_and_an_output_size_the_program_makes_are_read() -> None:
    """The guards refuse only past their line: nesting up to `DEPTH`, and a symbol in an output's
    shape (a size the program makes itself, not one a caller passes)."""
    meta = _bend(_set("inputs.0.tree", _nested(DEPTH - 1)))
    assert parse(meta).contract.to_json() == meta["graph"]["contract"]
    assert parse(_bend(lambda doc: None)).contract.outputs.leaves[0] == Leaf(
        "float32", "cpu", ("S0", 8, "u0")
    )


def test_a_function_in_a_size_is_not_taken_for_a_symbol() -> None:
    meta = _bend(_set("inputs.0.leaves.0.shape", ["Max(1, S0)", 8, 64]))
    assert parse(meta).contract.inputs[0].leaves[0] == Leaf(
        "float32", "cpu", ("Max(1, S0)", 8, 64), (512, 1, 8)
    )
