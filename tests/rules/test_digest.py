"""Graph digest: banked fixtures, sensitivity, invariance and literal handling (real torch.export)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from cgbuild_rules.digest import SCHEME, GraphFacts, LiteralHidden, _Renderer, _Symbols, graph_facts, identity
from cgbuild_rules.trace import export_job
from support.jobs import BANKED, TOY, flux_job, make_job
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from cgbuild.protocol.contract import CallContract


def digest_of(job: dict[str, Any], mode: str = "fake") -> str:
    return export_job(job, mode)[1]["graph_digest"]  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def mlp() -> tuple[Any, dict[str, Any]]:
    return export_job(make_job(), "fake")


@pytest.fixture(scope="module")
def flux() -> tuple[Any, dict[str, Any]]:
    return export_job(flux_job(), "fake")


# -- rendering rules -------------------------------------------------------------------------------
def test_values_are_typed_and_exact() -> None:
    r = _Renderer(_Symbols())
    assert r.value(0.1) == (0.1).hex()  # exact, locale-free
    assert r.value(0.1) != r.value(0.1000000001)
    assert r.value(True) != r.value(1)
    assert r.value("1") == '"1"' != r.value(1)
    assert r.value([1, 2]) != r.value((1, 2))
    assert r.value({"b": 1, "a": 2}) == r.value({"a": 2, "b": 1})
    assert r.value(torch.device("cuda", 3)) == r.value(torch.device("cuda")) == "device(cuda)"
    assert r.value(torch.bfloat16) == "torch.bfloat16"


def test_tensors_render_dtype_shape_and_device_type_only() -> None:
    r = _Renderer(_Symbols())
    with FakeTensorMode():
        a = torch.empty(2, 3, device="cuda:1")  # fake: fine on a CPU-only build
        b = torch.empty_strided((2, 3), (1, 2), device="cuda:0")  # other strides, other index
    assert r.tensor(a) == r.tensor(b) == "T(float32|[2,3]|cuda)"


# -- banked fixtures -------------------------------------------------------------------------------
def test_banked_toy_mlp(mlp: tuple[Any, dict[str, Any]]) -> None:
    assert mlp[1]["graph_digest"] == BANKED["toy/mlp/8x64-b1"]
    assert identity(mlp[0])["scheme"] == SCHEME


def test_banked_flux2_tiny(flux: tuple[Any, dict[str, Any]]) -> None:
    assert flux[1]["graph_digest"] == BANKED["flux2-klein-tiny/transformer/64x48-t8-b1"]


# -- sensitivity -----------------------------------------------------------------------------------
def test_batch_width_dtype_and_weight_shape_move_the_digest(mlp: tuple[Any, dict[str, Any]]) -> None:
    base = mlp[1]["graph_digest"]
    variants = {
        "batch": digest_of(make_job(batch=2)),
        "width": digest_of(make_job(width=32)),
        "dtype": digest_of(make_job(dtype="bfloat16")),
        "hidden": digest_of(make_job(config={"hidden": 256})),  # graph_module.code misses this one
    }
    assert base not in variants.values()
    assert len(set(variants.values())) == len(variants)


def test_dynamic_symbols_renamed_and_bounded() -> None:
    ep, facts = export_job(make_job(batch=4, config={"dynamic_batch": [2, 16]}), "fake")
    ident = identity(ep)
    assert ident["ranges"] == ["S0:[2,16]"]
    assert facts["contract"]["symbols"] == [{"name": "S0", "min": 2, "max": 16}]
    assert facts["contract"]["inputs"][0]["leaves"][0]["shape"] == ["S0", 8, 64]
    assert CallContract.from_json(facts["contract"]).to_json() == facts["contract"]  # sealed as written
    # The example batch does not matter; the declared range does.
    assert digest_of(make_job(batch=8, config={"dynamic_batch": [2, 16]})) == facts["graph_digest"]
    assert digest_of(make_job(batch=4, config={"dynamic_batch": [2, 32]})) != facts["graph_digest"]
    assert facts["graph_digest"] != digest_of(make_job(batch=4))


class MatMul(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x @ y


def _matmul(x: torch.Tensor, dims: Any = None) -> GraphFacts:
    y = torch.randn(x.shape[0], x.shape[2], 3)
    return graph_facts(torch.export.export(MatMul(), (x, y), dynamic_shapes=dims))


def test_traced_strides_of_a_non_contiguous_input_move_the_digest() -> None:
    """A package reads its inputs with their traced strides: a layout is part of the program.
    Contiguous traces name none (their digests are what they were before strides counted)."""
    contiguous = _matmul(torch.randn(2, 4, 8))
    assert "strides" not in contiguous.identity and "strides" not in contiguous.contract
    transposed = _matmul(torch.randn(2, 8, 4).transpose(1, 2))
    assert transposed.identity["strides"] == transposed.contract["strides"] == {"x": [32, 1, 4]}
    assert CallContract.from_json(transposed.contract).to_json() == transposed.contract  # sealed as written
    sliced = _matmul(torch.randn(2, 4, 16)[..., :8])
    assert sliced.identity["strides"] == {"x": [64, 16, 1]}
    digests = {contiguous.digest, transposed.digest, sliced.digest}
    assert len(digests) == 3
    # A layout is judged by the memory it reads: one transposed view, however it was made.
    assert (
        _matmul(torch.randn(2, 4, 8).transpose(1, 2).contiguous().transpose(1, 2)).digest == transposed.digest
    )


def test_a_stride_that_addresses_nothing_moves_no_digest() -> None:
    """The stride of a dimension of size one is never multiplied by an index: an input with any
    stride there reads what a fresh one does, contiguous or transposed."""
    odd = _matmul(torch.empty_strided((1, 4, 8), (7, 8, 1)).normal_())
    assert "strides" not in odd.identity and odd.digest == _matmul(torch.randn(1, 4, 8)).digest
    cut = torch.empty_strided((1, 8, 4), (7, 4, 1)).normal_().transpose(1, 2)
    fresh = _matmul(torch.randn(1, 8, 4).transpose(1, 2))
    assert _matmul(cut).digest == fresh.digest and fresh.identity["strides"] == {"x": [32, 1, 4]}


def test_a_symbolic_stride_is_named_by_its_symbols() -> None:
    batch, rows = torch.export.Dim("batch", min=2, max=8), torch.export.Dim("rows", min=2, max=8)
    facts = _matmul(torch.randn(3, 8, 4).transpose(1, 2), ({0: batch, 1: rows}, {0: batch}))
    assert facts.identity["strides"] == {"x": ["8*S1", 1, "S1"]}
    assert "strides" not in _matmul(torch.randn(3, 4, 8), ({0: batch, 1: rows}, {0: batch})).identity


# -- invariance ------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["mlp", "conv", "flux2"])
def test_fake_empty_and_real_weights_agree(which: str) -> None:
    job = {
        "mlp": make_job(),
        "conv": make_job("conv", height=32, width=32, batch=2),
        "flux2": flux_job(),
    }[which]
    digests = {mode: digest_of(job, mode) for mode in ("fake", "empty", "real")}
    assert len(set(digests.values())) == 1, digests


def test_empty_mode_program_holds_real_tensors() -> None:
    """`empty` is what AOTI compiles: its weights and example inputs must be real tensors."""
    ep, _ = export_job(make_job(), "empty")
    assert all(not t.is_meta and type(t).__name__ != "FakeTensor" for t in ep.state_dict.values())


def test_transposed_resolutions_share_one_digest(flux: tuple[Any, dict[str, Any]]) -> None:
    # 64x48 and 48x64 are both 12 image tokens: one program, one key, one mint.
    assert digest_of(flux_job(height=48, width=64)) == flux[1]["graph_digest"]
    assert digest_of(flux_job(height=64, width=64)) != flux[1]["graph_digest"]


def test_no_node_names_no_paths(mlp: tuple[Any, dict[str, Any]], tmp_path: Path) -> None:
    ep, facts = mlp
    text = json.dumps({k: v for k, v in identity(ep).items() if k != "scheme"})
    # `x` is the forward's parameter name (in the contract); `output` is also the node kind.
    names = {n.name for n in ep.graph.nodes} - {"x", "output"}
    assert names >= {"p_fc1_weight", "linear_1"}
    assert not [n for n in names if re.search(rf"(?<![\w.]){re.escape(n)}(?![\w.])", text)]
    assert "/" not in text and ".py" not in text and "\\" not in text
    # The same entry from another folder (another path in every stack trace): same digest.
    other = tmp_path / "elsewhere"
    other.mkdir()
    shutil.copy(TOY / "toy_models.py", other / "toy_models.py")
    assert digest_of(make_job(root=other)) == facts["graph_digest"]


# -- contract and topology -------------------------------------------------------------------------
def test_contract_and_topology(flux: tuple[Any, dict[str, Any]], mlp: tuple[Any, dict[str, Any]]) -> None:
    contract = flux[1]["contract"]
    names = [i["name"] for i in contract["inputs"]]
    assert names == ["hidden_states", "encoder_hidden_states", "timestep", "img_ids", "txt_ids"]
    leaves = [i["leaves"][0] for i in contract["inputs"]]
    # hidden_states traced as the pipeline packs it: (B, C, N) transposed to (B, N, C)
    assert leaves[0] == {"dtype": "float32", "shape": [1, 12, 8], "device": "cpu", "stride": [96, 1, 12]}
    assert leaves[3] == {"dtype": "int64", "shape": [12, 4], "device": "cpu", "stride": [4, 1]}
    # The digested contract names no strides; the identity names the non-contiguous ones apart.
    ident = identity(flux[0])
    assert "stride" not in json.dumps(ident["contract"])
    assert ident["strides"] == contract["strides"] == {"hidden_states": [96, 1, 12]}
    assert contract["outputs"]["leaves"] == [{"dtype": "float32", "shape": [1, 12, 8], "device": "cpu"}]
    # FQNs are the diffusers names (what checkpoints and the live module at adopt carry).
    fqns = [row[0] for row in flux[1]["topology"]]
    assert "x_embedder.weight" in fqns and fqns == sorted(fqns)
    assert mlp[1]["topology"] == [
        ["fc1.bias", "float32", [128]],
        ["fc1.weight", "float32", [128, 64]],
        ["fc2.bias", "float32", [10]],
        ["fc2.weight", "float32", [10, 128]],
    ]


# -- trace-baked literals --------------------------------------------------------------------------
LITERAL_ENTRY = """
import torch
from torch import nn


class Inner(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("table", torch.arange(4.0) * scale, persistent=False)
        self.offset = torch.linspace(0, 1, 4)  # plain tensor attribute: a lifted constant

    def forward(self, x):
        return self.lin(x) * torch.tensor([1.5, 2.0, 3.0, 4.0]) + self.table + self.offset


class Outer(nn.Module):
    def __init__(self, scale: float, listed: bool) -> None:
        super().__init__()
        self.inner = Inner(scale)
        self.listed = [torch.full((4,), 3.0)] if listed else None  # unreachable by FQN

    def forward(self, x):
        y = self.inner(x)
        return y + self.listed[0] if self.listed else y


def build(spec):
    c = spec["config"]
    return Outer(c.get("scale", 0.5), c.get("listed", False)), (torch.randn(spec["batch"], 4),), {}
"""


@pytest.fixture(scope="module")
def literal_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("literals")
    (root / "literal_models.py").write_text(LITERAL_ENTRY)
    return root


def literal_job(root: Path, **config: Any) -> dict[str, Any]:
    return make_job("m", width=4, batch=2, config=config, entry="literal_models:build", root=root)


def test_literals_enter_by_value(literal_root: Path) -> None:
    job = literal_job(literal_root)
    _, facts = export_job(job, "fake")
    targets = [row[0] for row in facts["identity"]["literals"]]
    assert targets == ["inner.table", "inner.lifted_tensor_0", "inner.offset"]
    assert digest_of(job, "empty") == digest_of(job, "real") == facts["graph_digest"]
    # Same shapes, other baked values: another program.
    assert digest_of(literal_job(literal_root, scale=0.25)) != facts["graph_digest"]


def test_unreachable_hidden_literal_is_refused(literal_root: Path) -> None:
    job = literal_job(literal_root, listed=True)
    with pytest.raises(LiteralHidden) as err:
        export_job(job, "fake")
    assert err.value.code == "literal-hidden"
    assert len(digest_of(job, "real")) == 64  # real weights see the value


COND_ENTRY = """
import torch
from torch import nn


class Branchy(nn.Module):
    def __init__(self, k: float) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.k = k

    def forward(self, x, flag):
        k = self.k
        return torch.cond(flag, lambda x: self.lin(x) * k, lambda x: x - 1.0, (x,))


def build(spec):
    return Branchy(spec["config"].get("k", 2.0)), (torch.randn(2, 4), torch.tensor(True)), {}
"""


def test_subgraphs_are_rendered(tmp_path: Path) -> None:
    """Higher-order ops (torch.cond) keep their branches in submodules: those are the program too."""
    (tmp_path / "cond_models.py").write_text(COND_ENTRY)

    def job(k: float) -> dict[str, Any]:
        return make_job("m", width=4, batch=2, config={"k": k}, entry="cond_models:build", root=tmp_path)

    _, facts = export_job(job(2.0), "fake")
    assert len(facts["identity"]["subgraphs"]) == 2
    assert any("higher_order.cond(" in line for line in facts["identity"]["graph"])
    assert digest_of(job(2.0), "empty") == facts["graph_digest"]
    assert digest_of(job(3.0)) != facts["graph_digest"]  # a constant inside one branch
