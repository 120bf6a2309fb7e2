"""`cgbuild manifest` and `adopt_manifest`: one module, two layouts, served by the serving device.

Two real compiles: the toy MLP's 8x64 class in its plain and its int8 layout. The CLI writes the
v2 manifest of both; a serving process adopts from it with a plain live module (the fp32
artifact serves), a quantized one (the int8 artifact serves), a named layout, a module neither
layout fits, and a device no entry is for. v1 manifests are still read.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hostile import _mutated
from hypothesis import given, settings
from support.artifacts import sealed_for
from support.cli import cli, last_json
from support.toy import EXAMPLES, copy_toy

from cgbuild.config import cgfile
from cgbuild.protocol.manifest import SCHEMA, SCHEMA_V1, SCHEMA_V2, BadManifest, read
from cgbuild.store.local import Store

MLP = "//toy/mlp/8x64-b1:cpu"


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory, toy_reference: Path) -> Path:
    """The toy with `//toy/mlp/8x64-b1` minted in both layouts (two compiles)."""
    ws = copy_toy(tmp_path_factory.mktemp("manifest") / "toy", toy_reference)
    proc = cli(ws, "mint", MLP, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return ws


@pytest.fixture(scope="module")
def doc(ws: Path) -> dict[str, Any]:
    out = ws / "serving.json"
    proc = cli(ws, "manifest", MLP, "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "2 entries of 1 modules of toy" in proc.stdout
    return dict(json.loads(out.read_text()))


def live_mlp(ws: Path, seed: int = 5) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    """The MLP as a serving process holds it: built by the entry, weights of its own."""
    from cgbuild_rules import trace

    from cgbuild.config.targets import expand
    from cgbuild.protocol.trace import job_for

    cg = cgfile.load(ws / "Cgfile")
    label = "//toy/mlp/8x64-b1@fp32:cpu"
    target = next(t for t in expand(cg) if t.label == label)
    torch.manual_seed(seed)
    built = trace.build(trace.parse_job(job_for(cg, target).with_id(label).to_json()), "real")
    return built.module, built.args


def serve(ws: Path, doc: dict[str, Any], module: torch.nn.Module, **kw: Any) -> Any:
    from cgbuild_rules.adopt import adopt_manifest

    return adopt_manifest(doc, {"mlp": module}, store=Store(ws / ".cgbuild" / "store"), **kw)["mlp"]


@pytest.mark.slow
def test_the_manifest_names_every_layout_of_the_fresh_targets(ws: Path, doc: dict[str, Any]) -> None:
    plan = json.loads(cli(ws, "plan", MLP, "--json").stdout)
    want = sorted((t["layout"], t["key"], t["stamp"]) for t in plan["targets"])
    assert doc["schema"] == SCHEMA and doc["family"] == "toy" and list(doc["modules"]) == ["mlp"]
    assert doc["modules"]["mlp"]["serves"] == "mlp"
    rows = doc["modules"]["mlp"]["entries"]
    assert all(r["compiled_only"] is False and r["envelope"]["shape"] == "8x64" for r in rows)
    assert {(r["graph_class"], r["sm"]) for r in rows} == {("8x64-b1", "cpu")}
    assert sorted((r["layout"], r["key"], r["stamp"]) for r in rows) == want
    assert [r["layout"] for r in rows] == ["fp32", "int8"]  # a fixed order: same selection, same bytes
    assert json.loads(cli(ws, "manifest", MLP).stdout) == doc  # stdout without -o


@pytest.mark.slow
def test_the_serving_module_picks_the_layout_its_tensors_match(ws: Path, doc: dict[str, Any]) -> None:
    from cgbuild_rules.quant import convert

    keys = {r["layout"]: r["key"] for r in doc["modules"]["mlp"]["entries"]}
    plain, args = live_mlp(ws)
    served = serve(ws, doc, plain)
    assert served.refusals == {} and [a.key for a in served.armed] == [keys["fp32"]]
    with torch.no_grad():
        torch.testing.assert_close(served(*args), plain(*args), rtol=1e-5, atol=1e-6)
    assert served.counters == {"compiled": 1}

    quantized, _ = convert(live_mlp(ws)[0], "int8-rowwise", torch.float32)
    served = serve(ws, doc, quantized)
    assert served.refusals == {} and [a.key for a in served.armed] == [keys["int8"]]
    with torch.no_grad():
        torch.testing.assert_close(served(*args), quantized(*args), rtol=1e-5, atol=1e-5)
    assert served.counters == {"compiled": 1}


@pytest.mark.slow
def test_a_named_layout_and_modules_no_layout_fits(ws: Path, doc: dict[str, Any]) -> None:
    plain, args = live_mlp(ws)
    named = serve(ws, doc, plain, layouts={"mlp": "int8"})  # the caller's choice, not the tensors'
    (refusal,) = named.refusals.values()
    assert refusal.code == "layout-mismatch" and "fc1.weight is F32[128, 64]" in refusal.detail
    with pytest.raises(ValueError, match="no layout 'bf16'"):
        serve(ws, doc, plain, layouts={"mlp": "bf16"})
    with pytest.raises(ValueError, match="'conv'"):
        serve(ws, doc, plain, layouts={"conv": "fp32"})

    half = live_mlp(ws)[0].to(torch.bfloat16)  # neither layout's tensors
    served = serve(ws, doc, half)
    (refusal,) = served.refusals.values()
    assert refusal.code == "layout-mismatch"
    assert "fp32: " in refusal.detail and "int8: " in refusal.detail and "layouts={'mlp'" in refusal.detail
    with torch.no_grad():
        served(*(a.to(torch.bfloat16) for a in args))
    assert served.counters == {"eager:layout-mismatch": 1}


@pytest.mark.slow
def test_entries_of_another_sm_are_not_loaded(ws: Path, doc: dict[str, Any]) -> None:
    plain, args = live_mlp(ws)
    entries = doc["modules"]["mlp"]["entries"]
    other = {**entries[0], "sm": "sm_90", "key": "00" * 32}  # not in the store
    with_gpu = {**doc, "modules": {"mlp": {"serves": "mlp", "entries": [*entries, other]}}}
    served = serve(ws, with_gpu, plain)
    assert served.refusals == {} and len(served.armed) == 1  # the sm_90 key was never resolved
    gpu_only = {**doc, "modules": {"mlp": {"serves": "mlp", "entries": [other]}}}
    served = serve(ws, gpu_only, plain)
    (refusal,) = served.refusals.values()
    assert refusal.code == "wrong-sm" and "on sm_90, the module is on cpu" in refusal.detail
    with torch.no_grad():
        served(*args)
    assert served.counters == {"eager:wrong-sm": 1}


@pytest.mark.slow
def test_a_v1_manifest_is_still_read(ws: Path, doc: dict[str, Any]) -> None:
    plain, args = live_mlp(ws)
    (fp32,) = [r["key"] for r in doc["modules"]["mlp"]["entries"] if r["layout"] == "fp32"]
    served = serve(ws, {"schema": SCHEMA_V1, "modules": {"mlp": {"8x64-b1": fp32}}}, plain)
    with torch.no_grad():
        torch.testing.assert_close(served(*args), plain(*args), rtol=1e-5, atol=1e-6)
    assert served.counters == {"compiled": 1} and [a.label for a in served.armed] == ["8x64-b1"]


@pytest.mark.slow
def test_targets_that_are_not_fresh_are_refused_by_name(ws: Path, tmp_path: Path) -> None:
    out = tmp_path / "serving.json"
    proc = cli(ws, "manifest", "//toy/mlp:cpu", "-o", str(out))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "2 of 4 selected targets are not fresh" in proc.stderr
    assert "//toy/mlp/16x64-b1@fp32:cpu (mint)" in proc.stderr
    assert "//toy/mlp/16x64-b1@int8:cpu (mint)" in proc.stderr and "8x64" not in proc.stderr
    assert not out.exists()


def test_the_printed_count_is_the_written_documents_entries(tmp_path: Path) -> None:
    """Two modules of one class each, fresh from stand-in artifacts (two traces, no compile): the
    line names the entries the file holds, not the fields of its module objects."""
    ws = tmp_path / "toy"
    shutil.copytree(EXAMPLES / "toy", ws, ignore=shutil.ignore_patterns(".cgbuild", "reference"))
    cg = ws / "Cgfile"
    cg.write_text(cg.read_text().replace('shapes = ["8x64", "16x64"]', 'shapes = ["8x64"]'))
    plan = last_json(cli(ws, "plan", "//toy@fp32", "--json"))
    store = Store(ws / ".cgbuild" / "store")
    for target in plan["targets"]:
        store.admit(target["key"], sealed_for(tmp_path, target["key"]))
    out = tmp_path / "serving.json"
    proc = cli(ws, "manifest", "//toy@fp32", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    modules = json.loads(out.read_text())["modules"]
    entries = sum(len(m["entries"]) for m in modules.values())
    assert (entries, len(modules)) == (2, 2)
    assert proc.stdout.strip() == f"wrote {out}: {entries} entries of {len(modules)} modules of toy"


def test_one_family_per_manifest(tmp_path: Path) -> None:
    """Refused before anything is traced: the selector is what must change."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "Cgfile").write_text(
        '[sku.cpu]\nsm = "cpu"\nmemory_gib = 8\n[layout.fp32]\nquant = "plain.fp32"\n'
        + "".join(
            f'[family.{f}]\nentry = "m:build"\nskus = ["cpu"]\nlayouts = ["fp32"]\n'
            f'[family.{f}.module.mlp]\nshapes = ["8x64"]\n'
            for f in ("a", "b")
        )
    )
    proc = cli(ws, "manifest", "//...")
    assert proc.returncode == 2 and "selects a, b (select one, e.g. //a)" in proc.stderr, proc.stderr


FACET = {"shape": "8x8", "text_len": None, "batch": 1, "guidance": []}


def _v3(fields: dict[str, Any]) -> dict[str, Any]:
    """A v3 manifest of one entry with these fields besides its identity."""
    row = {"graph_class": "c", "layout": "l", "sm": "cpu", "key": "k", **fields}
    return {"schema": SCHEMA, "modules": {"m": {"serves": "m", "entries": [row]}}}


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ([], "a JSON object"),
        ({"schema": "cgbuild.serving-manifest/4", "modules": {}}, "schema"),
        ({"schema": SCHEMA, "modules": {"m": []}}, "'serves', 'entries' \\(and 'call'\\)"),
        ({"schema": SCHEMA, "modules": {"m": {"serves": "a..b", "entries": []}}}, "m.serves"),
        (_v3({"compiled_only": True}), "m.entries[0].envelope"),
        (_v3({"compiled_only": "yes", "envelope": FACET}), "compiled_only"),
        ({"schema": SCHEMA_V2, "modules": []}, "modules"),
        ({"schema": SCHEMA_V2, "modules": {"m": {"c": "k"}}}, "modules.m: must be a list"),
        ({"schema": SCHEMA_V2, "modules": {"m": ["k"]}}, "modules.m[0]: an entry"),
        (
            {"schema": SCHEMA_V2, "modules": {"m": [{"graph_class": "c", "layout": "l", "sm": "cpu"}]}},
            "m[0].key",
        ),
        (
            {
                "schema": SCHEMA_V2,
                "modules": {"m": [{"graph_class": "c", "layout": "l", "sm": 90, "key": "k"}]},
            },
            "m[0].sm",
        ),
        (
            {
                "schema": SCHEMA_V2,
                "modules": {
                    "m": [{"graph_class": "c", "layout": "l", "sm": "cpu", "key": "k", "graph-class": "c"}]
                },
            },
            "unknown field 'graph-class'",
        ),
        ({"schema": SCHEMA_V1, "modules": {"m": {"c": 7}}}, "modules.m: must map each graph class"),
    ],
)
def test_a_malformed_manifest_names_its_field(doc: Any, field: str) -> None:
    with pytest.raises(BadManifest, match=field.replace("[", r"\[").replace("]", r"\]")):
        read(doc)


MANIFEST_V2: dict[str, Any] = {
    "schema": SCHEMA_V2,
    "modules": {
        "mlp": [
            {"graph_class": "8x64-b1", "layout": "fp32", "sm": "cpu", "key": "k" * 64, "stamp": "t@1+q@1"}
        ],
        "conv": [{"graph_class": "32x32-b2", "layout": "int8", "sm": "sm_90", "key": "a" * 64}],
    },
}


def test_both_schemas_read_to_entries() -> None:
    row = {"graph_class": "c", "layout": "fp32", "sm": "cpu", "key": "k", "stamp": "t@1+q@1"}
    (entry,) = read({"schema": SCHEMA_V2, "modules": {"m": [row]}})["m"]
    assert entry.to_json() == row
    (old,) = read({"schema": SCHEMA_V1, "modules": {"m": {"c": "k"}}})["m"]
    assert (old.graph_class, old.key, old.layout, old.sm) == ("c", "k", None, None)


MANIFEST_V3: dict[str, Any] = {
    "schema": SCHEMA,
    "family": "f",
    "modules": {
        "vae.decode": {
            "serves": "vae.decode",
            "entries": [
                {
                    "graph_class": "8x8-f5-b1",
                    "layout": "fp8",
                    "sm": "sm_90",
                    "key": "k" * 64,
                    "stamp": "t@1+q@1",
                    "compiled_only": True,
                    "envelope": {"shape": "8x8", "frames": 5, "text_len": None, "batch": 1, "guidance": []},
                }
            ],
            "call": {
                "passes": {"return_dict": False},
                "first_row": ["ids"],
                "returns": "tuple",
                "traced_class": "entry.Traced",
            },
        }
    },
}


@settings(max_examples=300, deadline=None, derandomize=True)
@given(mutated=_mutated(MANIFEST_V2, toml=False) | _mutated(MANIFEST_V3, toml=False))
def test_generated_manifests_read_or_are_refused_by_name(mutated: tuple[dict[str, Any], str]) -> None:
    """Whatever manifest a serving process is handed, `read` returns entries or raises
    BadManifest (which adopt reports), never anything else."""
    doc, _ = mutated
    try:
        entries = read(doc)
    except BadManifest as refused:
        assert str(refused)  # a sentence naming the field, for adopt's refusal
        return
    assert all(isinstance(rows, list) for rows in entries.values())
