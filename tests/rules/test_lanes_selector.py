"""The lane selector: the lane choice enters a compiled program as an input's SIZES.

`cgbuild_rules.lanes.export` adds one keyword input, `_cgbuild_lanes`, a zero-element tensor
whose dimension d is 2 + the value index of the d-th switched axis (by name). Each switch is
`torch.cond(selector.shape[d] == 2 + i, ...)`, which AOTInductor compiles into a host `if` on
the input's size: no tensor is read on the host. These tests export and compile a tiny module
with two switched axes (3 and 2 values that compute different functions) and check: the
module's names are the program's, every combination runs its own branch, the generated wrapper
reads no tensor to branch (against a control program that does), and a selector the program
does not take is refused before a call instead of running another lane.
"""

from __future__ import annotations

import functools
import itertools
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from cgbuild_rules import lanes
from cgbuild_rules.adopt.contract import supplied_positions, supplied_refusal
from cgbuild_rules.digest import graph_facts
from cgbuild_rules.loader import Package
from support.artifacts import HOST_READS, compile_package, host_read_ops, wrapper_source
from torch import nn

from cgbuild.lanes import LaneAxis, Selector, Switches
from cgbuild.protocol.contract import CallContract

SELECTOR = lanes.SELECTOR
ACTS = {"gelu": F.gelu, "relu": torch.relu, "tanh": torch.tanh}
SCALES = {"double": lambda t: t * 2.0, "half": lambda t: t * 0.5}  # no identity: a cond branch may not alias


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("shift", torch.linspace(-1, 1, 16))


class TwoAxes(nn.Module):
    """Two switched axes under submodules (`act`: 3 values, `scale`: 2) and a nested FQN."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.out = nn.Linear(16, 4)
        self.act = lanes.LaneSwitch("act", list(ACTS))
        self.post = nn.Module()
        self.post.scale = lanes.LaneSwitch("scale", list(SCALES))

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        h = self.act.select(ACTS, self.inner.fc(x) + self.inner.shift)
        h = self.post.scale.select(SCALES, h)
        return self.out(h if bias is None else h + bias)


def _two_axes() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return TwoAxes().eval(), torch.randn(3, 16)


def _block(m: nn.Module) -> Switches:
    return lanes.switch_table([LaneAxis(a, tuple(v)) for a, v in lanes.switches(m).items()])


def _sel_leaf(contract: dict[str, Any]) -> dict[str, Any]:
    (spec,) = [i for i in contract["inputs"] if i["name"] == SELECTOR]
    assert spec["keyword"] is True
    (leaf,) = spec["leaves"]
    return dict(leaf)


# ---- the export ----------------------------------------------------------------------------------
def test_the_export_adds_one_keyword_input_and_keeps_the_modules_names() -> None:
    m, x = _two_axes()
    with torch.no_grad():
        ep = lanes.export(m, (x,), {}, None, lanes.selector_of(m))
    assert sorted(ep.state_dict) == sorted(m.state_dict())  # no wrapper prefix: the checkpoints' FQNs
    lifted = [str(s.target) for s in ep.graph_signature.input_specs if s.kind.name in ("PARAMETER", "BUFFER")]
    assert sorted(lifted) == sorted(m.state_dict())
    users = [s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    assert users == ["x", SELECTOR]
    contract = graph_facts(ep).contract
    assert [(i["name"], i["keyword"]) for i in contract["inputs"]] == [("x", False), (SELECTOR, True)]
    leaf = _sel_leaf(contract)
    assert leaf["dtype"] == "uint8" and leaf["shape"][-1] == 0
    ranges = {s["name"]: (s["min"], s["max"]) for s in contract["symbols"]}
    # dimensions in axis name order: act (3 values: sizes 2..4), then scale (2 values: 2..3)
    assert [ranges[d] for d in leaf["shape"][:-1]] == [(2, 4), (2, 3)]
    assert "forward" not in m.__dict__  # the export's instance forward is gone again
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert {"cond", "aten.sym_size.int"} <= ops and not {"aten.ne.Scalar", "aten.select.int"} & ops


def test_an_instance_forward_the_module_had_is_exported_and_kept() -> None:
    m, x = _two_axes()
    own = functools.partial(type(m).forward, m)
    m.forward = own  # type: ignore[method-assign]
    with torch.no_grad():
        ep = lanes.export(m, (x,), {}, None, lanes.selector_of(m))
    assert m.__dict__["forward"] is own
    assert SELECTOR in (ep.call_spec.in_spec.child(1).context or [])


@pytest.mark.parametrize(
    ("form", "keyword"),
    [
        (lambda d: {"x": {0: d}}, False),  # by name, as entries return them
        (lambda d: ({0: d},), False),  # in input order
        (lambda d: [{0: d}, None], True),  # in input order, with the keyword the call passes
    ],
)
def test_the_entrys_dynamic_shapes_keep_their_symbols_beside_the_selectors(form: Any, keyword: bool) -> None:
    m, _ = _two_axes()
    x = torch.randn(4, 16)
    kwargs = {"bias": torch.zeros(16)} if keyword else {}
    dims = form(torch.export.Dim("rows", min=2, max=32))
    with torch.no_grad():
        ep = lanes.export(m, (x,), kwargs, dims, lanes.selector_of(m))
    contract = graph_facts(ep).contract
    ranges = {s["name"]: (s["min"], s["max"]) for s in contract["symbols"]}
    rows = contract["inputs"][0]["leaves"][0]["shape"][0]
    assert ranges[rows] == (2, 32)
    assert [ranges[d] for d in _sel_leaf(contract)["shape"][:-1]] == [(2, 4), (2, 3)]
    mine = CallContract.from_json(contract).without([SELECTOR])  # what a caller fits: its own call
    assert [i.name for i in mine.inputs] == ["x", *kwargs]
    assert [s.name for s in mine.symbols] == [rows]


def test_dynamic_shapes_that_do_not_name_the_inputs_are_refused() -> None:
    m, x = _two_axes()
    with pytest.raises(ValueError, match="does not name the module's inputs"):
        lanes.export(m, (x,), {}, ({0: None}, None), lanes.selector_of(m))


def test_a_switched_module_exported_without_its_selector_is_refused() -> None:
    m, x = _two_axes()
    with pytest.raises(ValueError, match=r"switches lanes \['act', 'scale'\]: pass its selector"):
        lanes.export(m, (x,), {}, None, None)
    plain = nn.Linear(16, 4)  # nothing switches: the module's own program, no selector
    ep = lanes.export(plain, (x,), {}, None, None)
    assert [s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"] == ["input"]


def test_a_forward_that_takes_the_selectors_name_is_refused() -> None:
    class Takes(TwoAxes):
        def forward(self, x: torch.Tensor, _cgbuild_lanes: Any = None) -> torch.Tensor:  # type: ignore[override]
            return super().forward(x)

    m = Takes().eval()
    with pytest.raises(ValueError, match="the lane selector's name"):
        lanes.export(m, (torch.randn(3, 16),), {}, None, lanes.selector_of(m))


def test_outside_the_export_a_switch_runs_the_value_it_is_set_to() -> None:
    """Eager calls, and a plain torch.export, run the set value as plain Python: no branch."""
    m, x = _two_axes()
    with torch.no_grad():
        want = m.out(torch.tanh(m.inner.fc(x) + m.inner.shift) * 0.5)
        lanes.set_lanes(m, {"act": "tanh", "scale": "half"})
        torch.testing.assert_close(m(x), want)
        ep = torch.export.export(m, (x,), strict=False)
    assert not any("cond" in str(n.target) for n in ep.graph.nodes)
    torch.testing.assert_close(ep.module()(x), want)
    with pytest.raises(ValueError, match="no value 'swish'"):
        lanes.set_lanes(m, {"act": "swish"})


def test_the_selector_of_a_choice_is_its_value_indices_over_the_base() -> None:
    m, _ = _two_axes()
    block = _block(m)
    assert block.selector == Selector(SELECTOR, ("act", "scale"), 2)
    sel = lanes.selector(block, {"act": "tanh", "scale": "double"})
    assert sel.shape == (4, 2, 0) and sel.numel() == 0
    lanes.set_lanes(m, {"act": "relu", "scale": "half"})
    held = lanes.selector_of(m)
    assert held is not None and held.shape == (3, 3, 0)
    with pytest.raises(ValueError, match="no value 'swish'"):
        lanes.selector(block, {"act": "swish", "scale": "double"})
    single = lanes.switch_table([LaneAxis("act", ("gelu",))])
    assert single.selector is None  # one value: no selector, the plain program
    with pytest.raises(ValueError, match="takes no lane selector"):
        lanes.selector(single, {"act": "gelu"})


# ---- compiled ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    m, x = _two_axes()
    with torch.no_grad():
        ep = lanes.export(m, (x,), {}, None, lanes.selector_of(m))
    pt2 = compile_package(ep, tmp_path_factory.mktemp("two-axes") / "model.pt2")
    package = Package(pt2)
    package.bind({fqn: t for fqn, t in m.state_dict().items() if fqn in package.constant_fqns})
    contract = CallContract.from_json(graph_facts(ep).contract)
    return {"module": m, "x": x, "package": package, "pt2": pt2, "contract": contract}


@pytest.mark.slow
def test_every_combination_runs_its_own_branch(compiled: dict[str, Any]) -> None:
    m, x, package = compiled["module"], compiled["x"], compiled["package"]
    block = _block(m)
    outs = {}
    for act, scale in itertools.product(ACTS, SCALES):
        choice = {"act": act, "scale": scale}
        lanes.set_lanes(m, choice)
        with torch.no_grad():
            outs[act, scale] = package(x, **{SELECTOR: lanes.selector(block, choice)})
            torch.testing.assert_close(outs[act, scale], m(x), rtol=1e-5, atol=1e-6)
    for a, b in itertools.combinations(outs.values(), 2):
        assert not torch.allclose(a, b)  # six different functions: a dead lane would repeat one


@pytest.mark.slow
def test_the_compiled_switch_is_a_host_branch_on_a_size_and_reads_no_tensor(
    compiled: dict[str, Any], tmp_path: Path
) -> None:
    """The wrapper branches on the selector's sizes (`if (s0 == 2L)`), never on a value read
    back from a tensor; a control program switching on a tensor's value, as artifacts sealed
    before the selector do, shows the inspection sees such a read (and the profiler its op)."""
    src = wrapper_source(compiled["pt2"])
    assert not any(word in src for word in HOST_READS)
    sizes = re.findall(r"if \((s\d+) == (\d+)L\)", src)
    assert {int(v) for _, v in sizes} == {2, 3}  # act: 2 | 3 | else; scale: 2 | else
    sel = torch.empty(4, 3, 0, dtype=torch.uint8)
    assert host_read_ops(lambda: compiled["package"](compiled["x"], **{SELECTOR: sel})) == set()

    class OnFlag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("flag", torch.tensor([1, 0]), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cond(self.flag[0] != 0, lambda t: t.relu(), lambda t: t.tanh(), (x,))

    with torch.no_grad():
        ep = torch.export.export(OnFlag(), (torch.randn(3, 16),), strict=False)
    pt2 = compile_package(ep, tmp_path / "model.pt2")
    assert any(word in wrapper_source(pt2) for word in HOST_READS)
    control = Package(pt2)
    control.bind({"flag": torch.tensor([1, 0])})
    assert host_read_ops(lambda: control(torch.randn(3, 16)))


@pytest.mark.slow
def test_a_selector_the_program_does_not_take_is_refused_not_run(compiled: dict[str, Any]) -> None:
    """The program reads the selector's sizes unchecked: a size no value has runs the LAST value.
    `supplied_refusal` (what adopt holds its selector to) refuses it, typed, before a call."""
    m, x, package, contract = compiled["module"], compiled["x"], compiled["package"], compiled["contract"]
    lanes.set_lanes(m, {"act": "tanh", "scale": "half"})
    with torch.no_grad():
        last = m(x)
        wrong = package(x, **{SELECTOR: torch.empty(9, 3, 0, dtype=torch.uint8)})
    torch.testing.assert_close(wrong, last)  # computed, silently, as another lane
    for bad, code in (
        (torch.empty(9, 3, 0, dtype=torch.uint8), "symbol-range"),  # act has sizes 2..4
        (torch.empty(2, 1, 0, dtype=torch.uint8), "symbol-range"),  # scale starts at 2
        (torch.empty(2, 0, dtype=torch.uint8), "shape"),  # one axis short
        (torch.empty(2, 2, 1, dtype=torch.uint8), "shape"),  # the selector holds no data
        (torch.empty(2, 2, 0, dtype=torch.int64), "dtype"),
    ):
        refusal = supplied_refusal(contract, {SELECTOR: bad})
        assert refusal is not None and refusal.code == "lane-selector", (bad.shape, refusal)
        assert f"({code})" in refusal.detail
    good = lanes.selector(_block(m), {"act": "relu", "scale": "double"})
    assert supplied_refusal(contract, {SELECTOR: good}) is None
    absent = supplied_refusal(contract, {"_other": good})
    assert absent is not None and "takes no input '_other'" in absent.detail
    assert supplied_positions(contract, {SELECTOR: good}) == [(1, good)]
