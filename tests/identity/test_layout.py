"""Layouts: quant rule records and their identity, floors, topology from headers, quantized modules.

Engine facts (no torch) first, then the torch side of the rules on tiny modules (no compile).
"""

from __future__ import annotations

import dataclasses
import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support.jobs import make_job
from torch import nn

from cgbuild.config import cgfile
from cgbuild.core.errors import UserError
from cgbuild.identity import keys
from cgbuild.identity.quantrule import QUANT_RULES, compute_dtype, floor_refusal, scaled_mm_rowwise
from cgbuild.identity.topology import read_header, topology_digest, topology_from_reference, topology_mismatch


# ---- quant rules: the facts are the identity --------------------------------------------------
def test_quant_digest_is_the_facts_alone() -> None:
    digests = {name: rule.digest for name, rule in QUANT_RULES.items()}
    assert len(set(digests.values())) == len(digests)
    int8 = QUANT_RULES["int8-rowwise"]
    assert int8.display == "int8-rowwise@1"
    # name and version are display: same facts, same identity
    assert dataclasses.replace(int8, name="renamed", version=7).digest == int8.digest
    # any convention fact moves it
    for path, value in (
        (("scale", "dtype"), "BF16"),
        (("eligible", "dims_multiple_of"), 32),
        (("min_sm",), "sm_90"),
        (("element",), "U8"),
        (("devices",), ["cuda"]),
    ):
        facts = json.loads(json.dumps(int8.facts))
        *parents, last = path
        node = facts
        for p in parents:
            node = node[p]
        node[last] = value
        assert dataclasses.replace(int8, facts=facts).digest != int8.digest, path


def test_quant_fact_moves_the_key_and_topology_moves_only_its_own() -> None:
    def key(topology: str, quant: str) -> str:
        return keys.key_of(
            {
                "graph": keys.graph_axis("g" * 64, torch="2.13.0", nodes=1),
                "sm": keys.sm_axis("cpu"),
                "toolchain": keys.toolchain_axis("cpu", "f" * 16, "probe"),
                "layout": keys.Axis({"topology": topology, "quant": quant}, {}),
            }
        )

    topo = topology_digest([["fc.weight", "I8", [16, 16]], ["fc.weight_scale", "F32", [16]]])
    plain, int8 = QUANT_RULES["plain.fp32"].digest, QUANT_RULES["int8-rowwise"].digest
    assert key(topo, plain) != key(topo, int8)
    moved = topology_digest([["fc.weight", "I8", [32, 16]], ["fc.weight_scale", "F32", [32]]])
    assert key(moved, int8) != key(topo, int8)
    # row order is not identity
    assert topology_digest([["b", "F32", [1]], ["a", "F32", [2]]]) == topology_digest(
        [["a", "F32", [2]], ["b", "F32", [1]]]
    )


def test_records_state_what_they_emit_and_need() -> None:
    int8, fp8 = QUANT_RULES["int8-rowwise"], QUANT_RULES["fp8-rowwise"]
    for rule, element in ((int8, "I8"), (fp8, "F8_E4M3")):
        assert rule.facts["emits"] == [
            ["{fqn}.weight", element, "[out, in]"],
            ["{fqn}.weight_scale", "F32", "[out]"],
        ]
        assert rule.facts["scale"]["dtype"] == "F32"
        assert rule.facts["eligible"] == {
            "module": "torch.nn.Linear",
            "weight_rank": 2,
            "dims_multiple_of": 16,
        }
    assert int8.min_sm is None and int8.devices == ("cpu", "cuda")
    assert fp8.min_sm == "sm_89" and fp8.devices == ("cuda",) and fp8.compute == ("bfloat16",)


def test_compute_dtype() -> None:
    assert compute_dtype(QUANT_RULES["plain.bf16"], None) == "bfloat16"
    assert compute_dtype(QUANT_RULES["plain.bf16"], "bfloat16") == "bfloat16"
    assert compute_dtype(QUANT_RULES["fp8-rowwise"], None) == "bfloat16"
    assert compute_dtype(QUANT_RULES["int8-rowwise"], "float32") == "float32"
    with pytest.raises(ValueError, match="declare the layout's dtype"):
        compute_dtype(QUANT_RULES["int8-rowwise"], None)
    with pytest.raises(ValueError, match="computes in bfloat16, not float32"):
        compute_dtype(QUANT_RULES["fp8-rowwise"], "float32")


def test_cgfile_names_the_layout_dtype_field(tmp_path: Path) -> None:
    text = (
        '[sku.cpu]\nsm = "cpu"\nmemory_gib = 8\n\n[layout.q]\nquant = "int8-rowwise"\n{dtype}\n'
        '[family.f]\nentry = "m:build"\nskus = ["cpu"]\nlayouts = ["q"]\n'
        '[family.f.module.m]\nshapes = ["8x8"]\n'
    )
    (tmp_path / "Cgfile").write_text(text.format(dtype='dtype = "bfloat16"'))
    assert cgfile.load(tmp_path / "Cgfile").layouts["q"].dtype == "bfloat16"
    (tmp_path / "Cgfile").write_text(text.format(dtype=""))
    with pytest.raises(UserError) as e:
        cgfile.load(tmp_path / "Cgfile")
    assert e.value.field == "layout.q.quant" and "declare the layout's dtype" in e.value.message
    (tmp_path / "Cgfile").write_text(text.format(dtype='dtype = "float64"'))
    with pytest.raises(UserError) as e:
        cgfile.load(tmp_path / "Cgfile")
    assert e.value.field == "layout.q.dtype" and e.value.line == 7


# ---- floors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("torch_version", "sm", "ok"),
    [
        ("2.13.0+cu130", "sm_90", True),
        ("2.4.1", "sm_90", False),
        ("2.5.0", "sm_90a", True),
        ("2.11.0+cu130", "sm_89", False),  # kernel on the wrong stream before 2.12
        ("2.12.0", "sm_89", True),
        ("2.8.0", "sm_100", True),
        ("2.8.0", "sm_120", False),
        ("2.9.1", "sm_120", True),
        ("2.13.0", "sm_80", False),  # no fp8 tensor cores
        ("2.13.0", "sm_110", False),  # unknown: fail toward blocked
        ("2.13.0", "cpu", False),
        ("nightly", "sm_90", False),
    ],
)
def test_scaled_mm_rowwise_capability(torch_version: str, sm: str, ok: bool) -> None:
    got, why = scaled_mm_rowwise(torch_version, sm)
    assert got is ok, why
    assert why


def test_floor_refusal() -> None:
    fp8, int8 = QUANT_RULES["fp8-rowwise"], QUANT_RULES["int8-rowwise"]
    assert floor_refusal(fp8, "cpu", "2.13.0+cpu")[0] == "layout-below-sm-floor"  # type: ignore[index]
    assert floor_refusal(fp8, "sm_80", "2.13.0")[0] == "layout-below-sm-floor"  # type: ignore[index]
    assert floor_refusal(fp8, "sm_80", None)[0] == "layout-below-sm-floor"  # type: ignore[index]
    assert floor_refusal(fp8, "sm_89", "2.11.0")[0] == "layout-toolchain-unsupported"  # type: ignore[index]
    assert floor_refusal(fp8, "sm_89", None) is None  # unknown torch: the graph is unknown anyway
    assert floor_refusal(fp8, "sm_90", "2.13.0") is None
    assert floor_refusal(fp8, "sm_120", "2.13.0") is None
    for sm in ("cpu", "sm_80", "sm_90"):
        assert floor_refusal(int8, sm, "2.13.0") is None
        assert floor_refusal(QUANT_RULES["plain.bf16"], sm, "2.13.0") is None


# ---- topology from headers ------------------------------------------------------------------------
def header_file(path: Path, tensors: dict[str, tuple[str, list[int]]], data: bytes = b"") -> Path:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    header |= {n: {"dtype": d, "shape": s, "data_offsets": [0, 0]} for n, (d, s) in tensors.items()}
    raw = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_header_only_read_of_a_short_file(tmp_path: Path) -> None:
    # Claims 2 GiB of data and holds none: the header alone gives the topology.
    f = header_file(tmp_path / "m.safetensors", {"w": ("BF16", [32768, 32768])})
    assert read_header(f)["w"]["shape"] == [32768, 32768]
    assert topology_from_reference(f, "ignored") == [["w", "BF16", [32768, 32768]]]
    raw = f.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(raw[:20])
    with pytest.raises(UserError, match="truncated"):
        read_header(tmp_path / "cut.safetensors")
    (tmp_path / "tiny.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(UserError, match="shorter than 8 bytes"):
        read_header(tmp_path / "tiny.safetensors")
    (tmp_path / "huge.safetensors").write_bytes(struct.pack("<Q", 1 << 40))
    with pytest.raises(UserError, match="implausible"):
        read_header(tmp_path / "huge.safetensors")


def test_sharded_components(tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    header_file(ref / "transformer" / "a-00001-of-00002.safetensors", {"x.weight": ("I8", [16, 16])})
    header_file(ref / "transformer" / "a-00002-of-00002.safetensors", {"x.weight_scale": ("F32", [16])})
    header_file(ref / "vae.safetensors", {"conv.weight": ("F32", [4, 3, 3, 3])})
    rows = sorted(topology_from_reference(ref, "transformer"))
    assert rows == [["x.weight", "I8", [16, 16]], ["x.weight_scale", "F32", [16]]]
    assert topology_from_reference(ref, "vae") == [["conv.weight", "F32", [4, 3, 3, 3]]]
    # with an index: the index names the shards, and must agree with their headers
    index = ref / "transformer" / "model.safetensors.index.json"
    wm = {"x.weight": "a-00001-of-00002.safetensors", "x.weight_scale": "a-00002-of-00002.safetensors"}
    index.write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    assert sorted(topology_from_reference(ref, "transformer")) == rows
    assert sorted(topology_from_reference(index, "any")) == rows  # the reference may be the index itself
    index.write_text(json.dumps({"weight_map": {**wm, "y.bias": "a-00002-of-00002.safetensors"}}))
    with pytest.raises(UserError, match=r"index and shards disagree on tensor 'y\.bias'"):
        topology_from_reference(ref, "transformer")
    index.write_text(json.dumps({"weight_map": {**wm, "y.bias": "missing.safetensors"}}))
    with pytest.raises(UserError, match="missing shard"):
        topology_from_reference(ref, "transformer")
    index.write_text(json.dumps({"weight_map": {"x.weight": "../vae.safetensors"}}))
    with pytest.raises(UserError, match="outside its folder"):
        topology_from_reference(ref, "transformer")
    index.unlink()
    # a component's own index beside the reference folder's files
    header_file(ref / "te-1.safetensors", {"emb": ("BF16", [8, 4])})
    (ref / "te.safetensors.index.json").write_text(json.dumps({"weight_map": {"emb": "te-1.safetensors"}}))
    assert topology_from_reference(ref, "te") == [["emb", "BF16", [8, 4]]]
    # one tensor in two shards: the checkpoint does not say which
    header_file(ref / "transformer" / "a-00003.safetensors", {"x.weight": ("I8", [16, 16])})
    with pytest.raises(UserError, match="in two shards"):
        topology_from_reference(ref, "transformer")
    with pytest.raises(UserError, match="no component 'unet'"):
        topology_from_reference(ref, "unet")
    with pytest.raises(UserError, match="does not exist"):
        topology_from_reference(tmp_path / "nowhere", "unet")


def test_topology_mismatch_names_the_first_tensor() -> None:
    layout = [["a.bias", "F32", [16]], ["a.weight", "I8", [16, 16]], ["a.weight_scale", "F32", [16]]]
    assert topology_mismatch(layout, list(reversed(layout))) is None
    plain = [["a.bias", "F32", [16]], ["a.weight", "F32", [16, 16]]]
    assert (
        topology_mismatch(layout, plain) == "a.weight: layout has I8[16, 16], the traced module F32[16, 16]"
    )
    assert topology_mismatch(layout[:2], layout) == (
        "a.weight_scale: the traced module has it, the layout's topology does not"
    )
    assert topology_mismatch(layout, layout[:2]) == (
        "a.weight_scale: the layout's topology has it, the traced module does not"
    )


# ---- the torch side --------------------------------------------------------------------------------
def test_int8_rowwise_numerics() -> None:
    from cgbuild_rules.quant import Int8RowwiseLinear, convert

    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    q, done = convert(nn.Sequential(lin), "int8-rowwise", torch.float32)
    assert done == ["0"] and isinstance(q[0], Int8RowwiseLinear)
    m = q[0]
    assert m.weight.dtype == torch.int8 and m.weight_scale.dtype == torch.float32
    assert int(m.weight.abs().max()) == 127  # symmetric absmax: each row's largest hits the end
    dequant = m.weight.float() * m.weight_scale[:, None]
    assert bool(((dequant - lin.weight).abs() <= m.weight_scale[:, None] / 2 + 1e-7).all())
    x = torch.randn(4, 64)
    with torch.no_grad():
        err = (m(x) - lin(x)).norm() / lin(x).norm()
    assert float(err) < 1e-2
    bf16 = convert(nn.Linear(64, 32).to(torch.bfloat16), "int8-rowwise", torch.bfloat16)[0]
    assert bf16.weight_scale.dtype == torch.float32 and bf16.bias.dtype == torch.bfloat16
    with torch.no_grad():
        assert bf16(torch.randn(2, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_fp8_rowwise_module_matches_its_emulation() -> None:
    """torch 2.13's CPU build has row-wise _scaled_mm, so the module's math is checked here; the
    rule still refuses CPU targets (its record names cuda only), and a mint on a GPU probes."""
    from cgbuild_rules.quant import probe

    ok, why = probe("fp8-rowwise", "cpu")
    if not ok and "failed on cpu" in why:
        pytest.skip(f"this torch has no CPU row-wise scaled_mm: {why}")
    assert ok, why
    assert probe("int8-rowwise", "cpu")[0]


ENTRY = """
import torch
from torch import nn


def build(spec):
    model = nn.Sequential(nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 16))
    return model, (torch.randn(spec["batch"], spec["height"], spec["width"]),), {}
"""
# Banked: moving one is a fleet-wide re-mint of that layout (a scheme or rule change).
BANKED_INT8 = "18d88f8d5d0febc82dc72e2aa4c1f2b8a97a697eb34e04c62d5ee377e61f7e26"


def _job(root: Path, quant: str, dtype: str = "float32") -> dict[str, Any]:
    return make_job(dtype=dtype, entry="q_entry:build", root=root, family="q", job_id=quant, quant=quant)


def test_quantized_graph_digests(tmp_path: Path) -> None:
    from cgbuild_rules.trace import export_job

    (tmp_path / "q_entry.py").write_text(ENTRY)
    plain = export_job(_job(tmp_path, "plain.fp32"))[1]
    int8 = {mode: export_job(_job(tmp_path, "int8-rowwise"), mode)[1] for mode in ("fake", "empty", "real")}
    assert {f["graph_digest"] for f in int8.values()} == {int8["fake"]["graph_digest"]}
    assert int8["fake"]["graph_digest"] != plain["graph_digest"]
    assert int8["fake"]["graph_digest"] == BANKED_INT8, int8["fake"]["graph_digest"]
    assert sorted(r[0] for r in int8["fake"]["topology"]) == [
        "0.bias",
        "0.weight",
        "0.weight_scale",
        "2.bias",
        "2.weight",
        "2.weight_scale",
    ]
    bf16 = export_job(_job(tmp_path, "int8-rowwise", "bfloat16"))[1]
    assert bf16["graph_digest"] != int8["fake"]["graph_digest"]
    fp8 = export_job(_job(tmp_path, "fp8-rowwise", "bfloat16"))[
        1
    ]  # the graph exports; CPU targets are blocked
    assert fp8["graph_digest"] not in {bf16["graph_digest"], int8["fake"]["graph_digest"]}
    assert ["0.weight", "float8_e4m3fn", [32, 64]] in fp8["topology"]


def test_reference_command(tmp_path: Path, toy_reference: Path) -> None:
    ws = tmp_path / "toy"
    ws.mkdir()
    src = Path(__file__).resolve().parents[2] / "examples" / "toy"
    for name in ("Cgfile", "toy_models.py"):
        (ws / name).write_bytes((src / name).read_bytes())
    cmd = [sys.executable, "-m", "cgbuild_rules.reference", "-C", str(ws)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    mlp = ws / "reference" / "int8" / "mlp.safetensors"
    assert mlp.read_bytes() == (toy_reference / "int8" / "mlp.safetensors").read_bytes()  # same bytes
    stamp = mlp.stat().st_mtime_ns
    assert subprocess.run(cmd, capture_output=True).returncode == 0
    assert mlp.stat().st_mtime_ns == stamp  # nothing rewritten
    rows = {n: (d, s) for n, d, s in topology_from_reference(ws / "reference" / "int8", "mlp")}
    assert rows["fc1.weight"] == ("I8", [128, 64]) and rows["fc1.weight_scale"] == ("F32", [128])
    assert rows["fc2.weight"] == ("F32", [10, 128])  # 10 rows: not eligible
    # two modules writing one component of one reference are refused
    text = (
        (ws / "Cgfile")
        .read_text()
        .replace("[family.toy.module.conv]", '[family.toy.module.conv]\ncomponent = "mlp"')
    )
    (ws / "Cgfile").write_text(text)
    bad = subprocess.run(cmd, capture_output=True, text=True)
    assert bad.returncode == 2 and "would both write component 'mlp'" in bad.stderr


def test_every_rewriting_quant_rule_has_a_transform_and_every_transform_a_rule() -> None:
    from cgbuild_rules import quant

    rewriting = {name for name, rule in QUANT_RULES.items() if rule.transforms}
    assert rewriting == set(quant.MODULES)
    assert all(not QUANT_RULES[n].transforms for n in QUANT_RULES if n.startswith("plain."))


def test_a_half_registered_quant_rule_refuses_instead_of_tracing_plain_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A record without a transform would key and seal plain weights under a quantized layout."""
    from cgbuild_rules import quant

    half = dataclasses.replace(QUANT_RULES["int8-rowwise"], name="int4-rowwise")
    monkeypatch.setitem(QUANT_RULES, "int4-rowwise", half)
    with pytest.raises(quant.QuantError, match="no transform"):
        quant.convert(nn.Sequential(nn.Linear(64, 64)), "int4-rowwise", torch.float32)


def test_the_layout_identity_is_the_axis_kinds_fields() -> None:
    """The layout axis is built through its kind: what the mint re-derives (`layout_identity`)
    is exactly what the key hashes and what `plan`, `why` and `diff` compare."""
    from cgbuild.identity import layout
    from cgbuild.identity.keys import LAYOUT

    rule = QUANT_RULES["plain.bf16"]
    axis = layout.layout_axis("fam", "unet", rule, "t" * 64, "trace")
    assert tuple(layout.layout_identity("t" * 64, rule)) == LAYOUT.fields
    assert axis.identity == layout.layout_identity("t" * 64, rule) == LAYOUT.identity(axis.readable)
    moved = LAYOUT.moved(axis.readable, {**axis.readable, "quant": "q" * 64, "stamp": "other"})
    assert [f for f, *_ in moved] == ["quant"]  # the stamp is for people: not identity
