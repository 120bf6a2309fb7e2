"""An int8 layout end to end on the CPU: ONE real AOTInductor compile of the toy MLP's int8 target.

`cgbuild mint` seals the layout's tensor table; `verify --run` reloads the package and compares it
with eager; adopt binds a live module quantized by the same rule (with its own weights, never the
mint's) and refuses modules whose tensors are not the layout's, naming the first one. A request
whose layout moved is refused before any compile.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support.cli import cli
from support.toy import copy_toy

from cgbuild.config import cgfile
from cgbuild.store.local import Store
from cgbuild.store.seal import read_metadata

pytestmark = pytest.mark.slow
INT8 = "//toy/mlp/8x64-b1@int8:cpu"
PLAIN = "//toy/mlp/8x64-b1@fp32:cpu"


@pytest.fixture(scope="module")
def minted(tmp_path_factory: pytest.TempPathFactory, toy_reference: Path) -> tuple[Path, dict[str, Any]]:
    """(workspace, sealed metadata) of the one int8 mint."""
    ws = copy_toy(tmp_path_factory.mktemp("int8") / "toy", toy_reference)
    proc = cli(ws, "mint", INT8, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    (done,) = summary["minted"]
    print(f"\nint8 mint phases: {done.get('phases')}")
    meta = read_metadata(Store(ws / ".cgbuild" / "store").resolve(done["key"]).path)
    return ws, meta


def live_module(ws: Path, label: str, seed: int) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    """The target's module as a serving process would hold it: built by the entry, weights of its
    own (seeded differently from the mint's), no quantization applied yet."""
    from cgbuild_rules import trace

    from cgbuild.config.targets import expand
    from cgbuild.protocol.trace import job_for

    cg = cgfile.load(ws / "Cgfile")
    target = next(t for t in expand(cg) if t.label == label)
    built = trace.build(trace.parse_job(job_for(cg, target).with_id(label).to_json()), "real")
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in built.module.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return built.module, built.args


def test_sealed_layout_block(minted: tuple[Path, dict[str, Any]]) -> None:
    ws, meta = minted
    block = meta["layout"]
    assert block["stamp"] == meta["stamp"] == "toy.mlp@1+int8-rowwise@1"
    assert block["rule"]["name"] == "int8-rowwise" and block["rule"]["facts"]["scale"]["dtype"] == "F32"
    assert {"topology": block["topology"], "quant": block["quant"]} == {
        k: meta["axes"]["layout"][k] for k in ("topology", "quant")
    }
    table = {n: (d, s) for n, d, s in block["tensors"]}
    assert table["fc1.weight"] == ("I8", [128, 64]) and table["fc1.weight_scale"] == ("F32", [128])
    assert table["fc2.weight"] == ("F32", [10, 128])
    assert str(ws) not in json.dumps(meta)  # the reference's path is a machine fact, never sealed
    state = {r["fqn"]: r["dtype"] for r in meta["constants"]["state"]}
    assert state["fc1.weight"] == "int8" and state["fc1.weight_scale"] == "float32"


def test_verify_run_against_eager(minted: tuple[Path, dict[str, Any]]) -> None:
    ws, _ = minted
    proc = cli(ws, "verify", INT8, "--run", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert {a["status"] for a in json.loads(proc.stdout)["artifacts"]} == {"ok"}


def test_adopt_a_quantized_live_module_and_refuse_others(minted: tuple[Path, dict[str, Any]]) -> None:
    from cgbuild_rules.adopt import adopt
    from cgbuild_rules.quant import convert

    ws, meta = minted
    store = Store(ws / ".cgbuild" / "store")
    module, args = live_module(ws, PLAIN, seed=5)

    plain = adopt(meta["key"], module, store=store)  # a plain module offered to the int8 artifact
    (refusal,) = plain.refusals.values()
    assert refusal.code == "layout-mismatch"
    assert refusal.detail.startswith(
        "toy.mlp@1+int8-rowwise@1: fc1.weight is F32[128, 64] in the module, I8[128, 64]"
    )
    assert "cgbuild_rules.quant.convert" in refusal.detail
    with torch.no_grad():
        assert torch.equal(plain(*args), module(*args))  # served eager, never failed
    assert plain.counters == {"eager:layout-mismatch": 1}

    quantized, done = convert(module, "int8-rowwise", torch.float32)
    assert done == ["fc1"]
    served = adopt(meta["key"], quantized, store=store)
    assert served.refusals == {}, served.refusals
    with torch.no_grad():
        got, want = served(*args), quantized(*args)
    assert served.counters == {"compiled": 1}
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    quantized.fc1.weight_scale = torch.nn.Parameter(  # type: ignore[union-attr]
        quantized.fc1.weight_scale.to(torch.bfloat16),  # type: ignore[union-attr,operator]
        requires_grad=False,
    )
    served.rebind()
    (refusal,) = served.refusals.values()
    assert refusal.code == "layout-mismatch" and "fc1.weight_scale is BF16[128]" in refusal.detail


def test_a_moved_layout_is_refused_before_compiling(
    minted: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    from cgbuild.config.labels import parse_selector
    from cgbuild.exec.mint import approved, request_for
    from cgbuild.plan.planner import Workspace, make_plan

    ws, _ = minted
    w = Workspace(cgfile.load(ws / "Cgfile"))
    plan = make_plan(w, parse_selector("//toy/mlp/16x64-b1@int8:cpu"))
    (mk,) = approved(plan, w)
    req = request_for(w, mk, tmp_path)
    req["layout"] = {**req["layout"], "topology": "0" * 64}
    proc = subprocess.run(
        [sys.executable, "-m", "cgbuild_rules.mint"], input=json.dumps(req), capture_output=True, text=True
    )
    result = json.loads([ln for ln in proc.stdout.splitlines() if '"ok"' in ln][-1])
    assert result["ok"] is False and result["code"] == "layout-drift", result
    assert "topology moved: 000000000000" in result["detail"]
    assert "compile" not in result.get("phases", {})
