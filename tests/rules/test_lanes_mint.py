"""Lanes through a real compile: one artifact, every lane selectable at run time; lanes move no key.

The toy's lanes (`baseline`, `chunked`) compute the same function, so they cannot show that a
bound lane really runs. This module mints ONE tiny entry whose three lanes compute different
functions (`act = gelu | relu | tanh`): the same sealed artifact, bound to each lane, must give
that lane's eager result. The numerics self-check then excludes the two that differ from the
reference, so nothing is benchmarked and adopt reports `lane-unverified`. The toy's measured
verdict, evidence and re-fit reasons are checked on the shared toy mint in test_mint_cli.py.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from support.artifacts import HOST_READS, compile_package, edited, host_read_ops, wrapper_source
from support.jobs import make_job
from support.minted import request_for, session_dirs
from support.toy import copy_toy

from cgbuild.lanes import LaneAxis
from cgbuild.store.seal import read_metadata, unseal

ENTRY = textwrap.dedent(
    '''
    """Three activation lanes that compute DIFFERENT functions, to prove the switch."""
    import torch
    import torch.nn.functional as F
    from cgbuild_rules.lanes import LaneSwitch
    from torch import nn

    LANES = {"act": {"gelu": {}, "relu": {}, "tanh": {}}}


    class Net(nn.Module):
        def __init__(self, features, lanes):
            super().__init__()
            self.fc1 = nn.Linear(features, 32)
            self.fc2 = nn.Linear(32, 4)
            self.act = LaneSwitch("act", lanes.get("act") or ["gelu"])

        def forward(self, x):
            impls = {"gelu": F.gelu, "relu": torch.relu, "tanh": torch.tanh}
            return self.fc2(self.act.select(impls, self.fc1(x)))


    def build(spec):
        x = torch.randn(spec["batch"], spec["height"], spec["width"])
        return Net(spec["width"], spec["lanes"]), (x,), {}
    '''
)
AXIS = ["tanh", "gelu", "relu"]  # declared in another order than the entry's: the program follows the entry
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def act_mint(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any], Path]:
    """(request, result, entry root) of the one real mint of the three-lane entry."""
    _, sandbox = session_dirs(tmp_path_factory)
    root = tmp_path_factory.mktemp("act-entry")
    (root / "act_entry.py").write_text(ENTRY)
    program = {"act": ["gelu", "relu", "tanh"]}
    job = make_job("net", entry="act_entry:build", root=root, family="act", job_id="act", lanes=program)
    lanes = {
        "axes": [["act", AXIS]],
        "needs": {"act": {"gelu": {}, "relu": {}, "tanh": {}}},
        "sku": {"name": "cpu", "memory_bytes": 24 << 30},
    }
    req = request_for(job, tmp_path_factory.mktemp("act-out"), sandbox, lanes=lanes)
    result = run_worker(req)
    assert result["ok"], result
    return req, result, root


def run_worker(request: dict[str, Any]) -> dict[str, Any]:
    """The worker's result line (the last line; progress lines come before it)."""
    proc = subprocess.run(
        [sys.executable, "-m", "cgbuild_rules.mint"],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    results = [ln for ln in lines if "progress" not in ln]
    assert len(results) == 1, f"stdout={proc.stdout!r} stderr={proc.stderr[-2000:]}"
    return results[0]


def _net(root: Path, seed: int = 5) -> torch.nn.Module:
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import act_entry

    torch.manual_seed(seed)
    return act_entry.Net(64, {"act": ["gelu", "relu", "tanh"]}).eval()


def _serve_each_lane(artifact: Path, m: torch.nn.Module, **adopt_kw: Any) -> dict[str, Any]:
    """`artifact` adopted onto `m` once per lane, pinned to it, with `m` switched to the same lane:
    every call runs compiled and matches eager, and the lanes compute different outputs. Returns
    each lane's adopted module."""
    from cgbuild_rules.adopt import adopt
    from cgbuild_rules.lanes import set_lanes

    x = torch.randn(1, 8, 64)
    outs: dict[str, torch.Tensor] = {}
    adopted: dict[str, Any] = {}
    for lane in ("gelu", "relu", "tanh"):
        served = adopted[lane] = adopt(artifact, m, lane=lane, **adopt_kw)
        set_lanes(m, {"act": lane})
        with torch.no_grad():
            outs[lane] = served(x)
            torch.testing.assert_close(outs[lane], m(x), rtol=1e-5, atol=1e-6)
        assert served.counters == {"compiled": 1}
    assert not torch.allclose(outs["gelu"], outs["relu"]) and not torch.allclose(outs["relu"], outs["tanh"])
    return adopted


def test_one_artifact_runs_each_lane_it_is_bound_to(
    act_mint: tuple[dict[str, Any], dict[str, Any], Path],
) -> None:
    from cgbuild_rules.adopt import adopt

    _, result, root = act_mint
    m = _net(root)
    for served in _serve_each_lane(result["artifact"], m).values():
        assert served.lanes[next(iter(served.lanes))].code == "lane-pinned"
    with pytest.raises(ValueError, match="not in this artifact"):
        adopt(result["artifact"], m, lane="swish")


def test_numerics_exclude_lanes_that_differ_and_nothing_is_benchmarked(
    act_mint: tuple[dict[str, Any], dict[str, Any], Path], tmp_path: Path
) -> None:
    from cgbuild_rules.adopt import adopt

    _, result, root = act_mint
    meta = read_metadata(result["artifact"])
    lanes = meta["lanes"]
    assert lanes["schema"] == "cgbuild.lanes/2"
    assert lanes["axes"] == [{"axis": "act", "values": ["gelu", "relu", "tanh"]}]
    assert lanes["selector"] == {"input": "_cgbuild_lanes", "axes": ["act"], "base": 2}
    assert lanes["excluded"] == {"act.relu": "numerics", "act.tanh": "numerics"}
    verdict = lanes["verdict"]
    assert verdict["winner"] == "gelu" and verdict["candidates"] == [] and verdict["peaks"] == {}
    assert result["lane_evidence"]["measured"] == {}  # no candidates → no benchmark
    assert "lanes" in result["phases"]
    numerics = result["lane_evidence"]["numerics"]["act"]
    assert numerics["gelu"]["ok"] and not numerics["relu"]["ok"] and not numerics["tanh"]["ok"]
    # the choice is an input's size: the program takes the selector, its symbol spans the 3 values
    contract = meta["graph"]["contract"]
    (sel,) = [i for i in contract["inputs"] if i["name"] == "_cgbuild_lanes"]
    (dim, zero) = sel["leaves"][0]["shape"]
    assert zero == 0 and {"name": dim, "min": 2, "max": 4} in contract["symbols"]
    assert "constants.safetensors" not in unseal(result["artifact"], tmp_path / "u")  # no literal
    served = adopt(result["artifact"], _net(root))
    (choice,) = served.lanes.values()
    assert (choice.lane, choice.code) == ("gelu", "lane-unverified")
    assert not served.armed[0].dynamic  # only the selector has a symbol: still a static class


def test_a_served_call_reads_no_tensor_on_the_host(
    act_mint: tuple[dict[str, Any], dict[str, Any], Path], tmp_path: Path
) -> None:
    """The package's wrapper branches on the selector's size (`if (s0 == 2L)`, `== 3L`) and has
    no host read of a tensor (`aoti_torch_item_bool`: a device→host copy per switch on a GPU);
    the profiler sees no `item` in a served call."""
    from cgbuild_rules.adopt import adopt

    _, result, root = act_mint
    src = wrapper_source(unseal(result["artifact"], tmp_path / "u")["model.pt2"])
    assert not any(word in src for word in HOST_READS)
    assert {int(v) for v in re.findall(r"if \(s\d+ == (\d+)L\)", src)} == {2, 3}
    served = adopt(result["artifact"], _net(root), lane="tanh")
    x = torch.randn(1, 8, 64)
    assert host_read_ops(lambda: served(x)) == set()
    assert served.counters == {"compiled": 1}


def test_a_lanes_table_the_program_does_not_carry_is_refused_before_the_first_call(
    act_mint: tuple[dict[str, Any], dict[str, Any], Path], tmp_path: Path
) -> None:
    """The program reads its selector's size unchecked (a size no value has runs the last
    value): a sealed table naming a fourth value would serve `tanh` as `swish`. Adopt holds the
    selector it builds to the program's contract and refuses it (`lane-selector`), typed, with
    no compiled call."""
    from cgbuild_rules.adopt import AdoptRefused, adopt

    _, result, root = act_mint

    def fourth(meta: dict[str, Any]) -> None:
        meta["lanes"]["axes"][0]["values"].append("swish")

    bent = edited(Path(result["artifact"]), tmp_path / "bent.tar.gz", fourth)
    served = adopt(bent, _net(root), lane="swish")
    (refusal,) = served.refusals.values()
    assert refusal.code == "lane-selector" and "symbol-range" in refusal.detail, refusal
    with torch.no_grad():
        served(torch.randn(1, 8, 64))
    assert served.counters == {"eager:lane-selector": 1}
    with pytest.raises(AdoptRefused, match="lane-selector"):
        adopt(bent, _net(root), lane="swish", strict=True)
    assert adopt(bent, _net(root), lane="tanh").refusals == {}  # a value the program has: armed


def test_the_mint_refuses_a_switch_that_does_not_carry_the_spec(
    act_mint: tuple[dict[str, Any], dict[str, Any], Path], tmp_path: Path
) -> None:
    from cgbuild_rules.lanes import lane_rows

    _, _, root = act_mint
    rows = lane_rows(_net(root), ["act"], {"act": ["gelu", "relu", "tanh"]})
    assert rows == [LaneAxis("act", ("gelu", "relu", "tanh"))]
    with pytest.raises(ValueError, match="the spec asked"):
        lane_rows(_net(root), ["act"], {"act": ["gelu", "relu"]})
    with pytest.raises(ValueError, match="undeclared lane axes"):
        lane_rows(_net(root), [], {})


# ---- artifacts sealed with one-hot switches keep adopting ---------------------------------------
class OneHotAct(torch.nn.Module):
    """The switch as artifacts sealed before the lane selector compiled it: a non-persistent int64
    one-hot and nested `torch.cond(onehot[i] != 0, ...)`, the value read back on the host."""

    def __init__(self, n: int) -> None:
        super().__init__()
        from cgbuild_rules.lanes import one_hot

        self.register_buffer("onehot", one_hot(0, n), persistent=False)

    def branch(self, fns: list[Any], onehot: torch.Tensor, x: torch.Tensor, i: int = 0) -> Any:
        if i == len(fns) - 1:
            return fns[i](x)
        rest = lambda h, t: self.branch(fns, h, t, i + 1)  # noqa: E731
        return torch.cond(onehot[i] != 0, lambda h, t: fns[i](t), rest, (onehot, x))


class OneHotNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 32)
        self.fc2 = torch.nn.Linear(32, 4)
        self.act = OneHotAct(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fns = [torch.nn.functional.gelu, torch.relu, torch.tanh]
        return self.fc2(self.act.branch(fns, self.act.onehot, self.fc1(x)))


@pytest.fixture(scope="module")
def one_hot_artifact(
    act_mint: tuple[dict[str, Any], dict[str, Any], Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The act entry's program as a one-hot switch compiles it, sealed as such artifacts were
    (`cgbuild.lanes/1`: the axis names its literal by `fqn`, the literal sealed beside the
    package), from the act mint's own metadata (host, layout, configuration)."""
    from cgbuild_rules.digest import graph_facts
    from cgbuild_rules.lanes import one_hot
    from safetensors.torch import save_file

    from cgbuild.store.seal import seal

    _, result, _ = act_mint
    work = tmp_path_factory.mktemp("one-hot")
    x = torch.randn(1, 8, 64)
    with torch.no_grad():
        ep = torch.export.export(OneHotNet().eval(), (x,), strict=False)
    pt2 = compile_package(ep, work / "model.pt2")
    save_file({"act.onehot": one_hot(0, 3)}, str(work / "constants.safetensors"))
    meta = read_metadata(result["artifact"])
    meta["graph"]["contract"] = graph_facts(ep).contract
    meta["constants"]["literal"] = [{"fqn": "act.onehot", "dtype": "int64", "shape": [3], "stride": [1]}]
    block = meta["lanes"]
    del block["selector"]
    block["schema"] = "cgbuild.lanes/1"
    block["axes"] = [{"axis": "act", "values": ["gelu", "relu", "tanh"], "fqn": "act.onehot"}]
    out = work / "one-hot.tar.gz"
    seal(out, meta, {"model.pt2": pt2, "constants.safetensors": work / "constants.safetensors"})
    return out


def test_an_artifact_sealed_with_one_hot_switches_serves_each_lane_it_is_bound_to(
    act_mint: tuple[dict[str, Any], dict[str, Any], Path], one_hot_artifact: Path
) -> None:
    """A serving process on this code adopts it with the entry's module of today (a switch with
    no one-hot): adopt binds the chosen one-hot by the table's FQN, and each lane runs."""
    from cgbuild_rules.adopt import adopt

    _, _, root = act_mint
    m = _net(root)
    _serve_each_lane(one_hot_artifact, m, strict=True)
    (choice,) = adopt(one_hot_artifact, m).lanes.values()
    assert (choice.lane, choice.code) == ("gelu", "lane-unverified")


# ---- lanes are not a key axis ----------------------------------------------------------------------
def _plan(ws: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cgbuild.cli.main",
            "-C",
            str(ws),
            "plan",
            "//toy/mlp/8x64-b1@fp32:cpu",
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["targets"][0]


def test_reordering_lanes_moves_no_key_and_a_buildable_value_is_a_graph_change(
    tmp_path: Path, toy_reference: Path
) -> None:
    ws = copy_toy(tmp_path / "toy", toy_reference)
    cg = ws / "Cgfile"
    declared = 'linear = ["baseline", "chunked", "triton"]'
    base = _plan(ws)
    text = cg.read_text()
    assert declared in text
    cg.write_text(text.replace(declared, 'linear = ["triton", "chunked", "baseline"]'))
    assert _plan(ws)["key"] == base["key"]  # reordered: same program, same key
    cg.write_text(text.replace(declared, 'linear = ["chunked", "baseline"]'))
    assert _plan(ws)["key"] == base["key"]  # triton was never buildable on a CPU target
    cg.write_text(text.replace(declared, 'linear = ["baseline"]'))
    one = _plan(ws)
    assert one["key"] != base["key"]  # one branch fewer in the program: the graph moved
    assert any(r.get("axis") == "graph" for r in one["reasons"]), one["reasons"]
    shutil.rmtree(ws / ".cgbuild")
    cg.write_text(text.replace(declared + "\n", "").replace("[family.toy.lanes]\n", ""))
    assert _plan(ws)["key"] == one["key"]  # one buildable value: the plain program, no switch
