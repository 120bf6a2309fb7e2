"""The plan end to end: real traces of the toy family, real locks, a real store on disk.

Key membership (docs/identity.md): a moved member moves the key; a moved non-member does not; an unknown
toolchain component does. Each test works on its own copy of the toy workspace, sharing one trace
cache so only traces whose inputs really moved run again.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.cli import cli
from support.toy import copy_toy

from cgbuild.config import cgfile
from cgbuild.config.labels import parse_selector
from cgbuild.plan.diff import diff_plans, render
from cgbuild.plan.entries import Plan
from cgbuild.plan.planner import Workspace, make_plan
from cgbuild.store.local import Store

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MLP8 = "//toy/mlp/8x64-b1@fp32:cpu"
MLP16 = "//toy/mlp/16x64-b1@fp32:cpu"
CONV = "//toy/conv/32x32-b2@fp32:cpu"
MLP8_INT8 = "//toy/mlp/8x64-b1@int8:cpu"
CONV_INT8 = "//toy/conv/32x32-b2@int8:cpu"


@pytest.fixture(scope="module")
def shared_traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("traces") / "traces.sqlite"


@pytest.fixture
def toy(tmp_path: Path, shared_traces: Path, toy_reference: Path) -> Path:
    ws = copy_toy(tmp_path / "toy", toy_reference)
    state = ws / ".cgbuild"
    state.mkdir()
    if shared_traces.exists():
        shutil.copy(shared_traces, state / "traces.sqlite")
    yield ws
    if (state / "traces.sqlite").exists() and not (state / "private-facts").exists():
        shutil.copy(state / "traces.sqlite", shared_traces)


def plan(ws: Path, label: str = "//...", lock: str | None = None) -> dict[str, Any]:
    """What `cgbuild plan` computes and records, as `plan --json` writes it."""
    return make_plan(
        Workspace(cgfile.load(ws / "Cgfile"), toolchain_lock=lock), parse_selector(label), record=True
    ).to_json()


def by_label(p: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["label"]: t for t in p["targets"]}


def keys(p: dict[str, Any]) -> dict[str, str | None]:
    return {t["label"]: t["key"] for t in p["targets"]}


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def test_plan_json_shape_and_first_reasons(toy: Path) -> None:
    p = plan(toy)
    assert p["schema"] == "cgbuild.plan/1"
    assert set(p["toolchains"]) == {"cpu", "cuda"}
    t = by_label(p)[MLP8]
    for field in (
        "label",
        "family",
        "module",
        "graph_class",
        "layout",
        "stamp",
        "sm",
        "skus",
        "envelope",
        "key",
        "status",
        "axes",
        "reasons",
    ):
        assert field in t
    assert t["status"] == "mint"
    assert t["stamp"] == "toy.mlp@1+plain.fp32@1"
    assert set(t["axes"]) == {"graph", "sm", "toolchain", "layout"}
    assert {r["code"] for r in t["reasons"]} == {"missing-from-store", "new-target"}
    assert len(set(keys(p).values())) == 6
    q = by_label(p)[MLP8_INT8]
    assert q["stamp"] == "toy.mlp@1+int8-rowwise@1" and q["axes"]["layout"]["topology_source"] == "reference"
    assert q["axes"]["graph"]["digest"] != t["axes"]["graph"]["digest"]  # fc1 is quantized in the graph


def test_fresh_only_from_a_verified_ref(toy: Path, tmp_path: Path) -> None:
    first = by_label(plan(toy))[MLP8]
    artifact = tmp_path / "artifact.bin"
    artifact.write_bytes(b"stand-in bytes: the mint tests admit real artifacts")
    store = Store(toy / ".cgbuild" / "store")
    assert store.admit(first["key"], artifact).status == "admitted"
    again = by_label(plan(toy))
    assert again[MLP8]["status"] == "fresh"
    assert again[MLP16]["status"] == "mint"
    obj = store.object_path(store.read_ref(first["key"]).object)  # type: ignore[union-attr]
    os.chmod(obj, 0o644)
    obj.write_bytes(b"short")  # a torn object is not fresh
    assert by_label(plan(toy))[MLP8]["status"] == "mint"


def test_adding_a_resolution_adds_targets_and_rekeys_none(toy: Path) -> None:
    before = keys(plan(toy))
    edit(toy / "Cgfile", 'shapes = ["8x64", "16x64"]', 'shapes = ["8x64", "16x64", "32x64"]')
    after = plan(toy)
    new = keys(after)
    assert set(new) - set(before) == {"//toy/mlp/32x64-b1@fp32:cpu", "//toy/mlp/32x64-b1@int8:cpu"}
    assert all(new[label] == key for label, key in before.items())
    assert [r["code"] for r in by_label(after)["//toy/mlp/32x64-b1@fp32:cpu"]["reasons"]] == [
        "missing-from-store",
        "new-target",
    ]


def test_non_members_move_no_key(toy: Path) -> None:
    before = plan(toy)
    cg = toy / "Cgfile"
    edit(cg, "memory_gib = 24", "memory_gib = 48")  # SKU memory
    edit(cg, "[sku.cpu]", "[sku.cpu-host]")  # SKU name
    edit(cg, 'skus = ["cpu"]', 'skus = ["cpu-host"]')
    edit(cg, "batch_sizes = [2]", "batch_sizes = [2]\nguidance = [3.5]")  # guidance values
    text = cg.read_text().replace("family.toy", "family.toyish")  # family name
    cg.write_text(text)
    after = plan(toy)
    renamed = {t["label"].replace("//toyish/", "//toy/"): t["key"] for t in after["targets"]}
    assert renamed == keys(before)
    conv = next(t for t in after["targets"] if t["module"] == "conv")
    assert conv["envelope"]["guidance"] == ["3.5"]
    assert conv["stamp"] == "toyish.conv@1+plain.fp32@1"


def _header_only(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A safetensors file with its header and NO data region: the header alone must suffice."""
    header = {n: {"dtype": d, "shape": s, "data_offsets": [0, 0]} for n, (d, s) in tensors.items()}
    raw = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def _topology(p: dict[str, Any], label: str) -> dict[str, tuple[str, list[int]]]:
    """A target's traced state as header rows, from the trace cache the plan filled."""
    import sqlite3

    db = sqlite3.connect(Path(p["workspace"]["cgfile"]).parent / ".cgbuild" / "traces.sqlite")
    inputs = by_label(p)[label]["trace_inputs"]
    (facts,) = db.execute("SELECT facts FROM traces WHERE inputs=?", (inputs,)).fetchone()
    db.close()
    from cgbuild.identity.topology import from_trace

    return {n: (d, s) for n, d, s in from_trace(json.loads(facts)["topology"])}


def test_topology_change_of_one_module_leaves_others(toy: Path) -> None:
    before = by_label(plan(toy))
    assert before[CONV_INT8]["axes"]["layout"]["topology_source"] == "reference"
    # The written reference agrees with the trace: the same digest a trace-sourced topology gives.
    assert before[CONV_INT8]["axes"]["layout"]["topology"] == before[CONV]["axes"]["layout"]["topology"]
    edit(
        toy / "Cgfile",
        "config = { hidden = 128, out = 10 }",
        "config = { hidden = 128, out = 10, channels = 32 }",
    )
    mid = by_label(plan(toy))  # the conv's reference still has 16 channels: refused, never minted
    assert mid[CONV_INT8]["status"] == "blocked" and mid[CONV_INT8]["key"] is None
    (why,) = mid[CONV_INT8]["reasons"][:1]
    assert why["code"] == "layout-topology-mismatch" and why["root"]
    assert "bn.bias: layout has F32[16], the traced module F32[32]" in why["detail"]
    # Header-only stubs (no data region at all) of the new conv topology fix it.
    _header_only(toy / "reference" / "int8" / "conv.safetensors", _topology(plan(toy, CONV), CONV))
    after = by_label(plan(toy))
    assert after[MLP8_INT8]["key"] == before[MLP8_INT8]["key"]  # the mlp's component did not move
    assert after[CONV_INT8]["status"] == "mint"
    assert after[CONV_INT8]["key"] != before[CONV_INT8]["key"]
    moved = {r["axis"] for r in after[CONV_INT8]["reasons"] if r["code"] == "axis-moved"}
    assert "layout" in moved


def test_sharded_reference_gives_the_same_topology(toy: Path) -> None:
    one = by_label(plan(toy))[MLP8_INT8]["axes"]["layout"]["topology"]
    from cgbuild_rules.reference import write_references

    shutil.rmtree(toy / "reference")
    written = write_references(toy, ["int8"], shard_bytes=4096)  # mlp.fc1.weight alone is 8 KiB
    mlp = next(w for w in written if w["module"] == "mlp")
    assert (
        len(mlp["files"]) >= 3
        and (toy / "reference" / "int8" / "mlp" / "model.safetensors.index.json").exists()
    )
    assert by_label(plan(toy))[MLP8_INT8]["axes"]["layout"]["topology"] == one
    # shards without their index are read all the same
    (toy / "reference" / "int8" / "mlp" / "model.safetensors.index.json").unlink()
    assert by_label(plan(toy))[MLP8_INT8]["axes"]["layout"]["topology"] == one


def _with_fp8_layout(ws: Path, sku: str, sm: str) -> None:
    edit(ws / "Cgfile", 'skus = ["cpu"]', f'skus = ["cpu", "{sku}"]')
    edit(ws / "Cgfile", 'layouts = ["fp32", "int8"]', 'layouts = ["fp32", "int8", "fp8"]')
    edit(
        ws / "Cgfile",
        "[layout.fp32]",
        f'[sku.{sku}]\nsm = "{sm}"\nmemory_gib = 80\n\n[layout.fp8]\nquant = "fp8-rowwise"\n\n[layout.fp32]',
    )


def test_layout_below_its_sm_floor_is_blocked_and_never_traced(toy: Path) -> None:
    _with_fp8_layout(toy, "a100", "sm_80")
    p = plan(toy, "@fp8")
    targets = by_label(p)
    assert {t["status"] for t in targets.values()} == {"blocked"}
    for label in ("//toy/mlp/8x64-b1@fp8:sm_80", "//toy/mlp/8x64-b1@fp8:cpu"):
        (why,) = targets[label]["reasons"][:1]
        assert why["code"] == "layout-below-sm-floor" and why["root"], why
        assert targets[label]["key"] is None
    assert "needs sm_89" in targets["//toy/mlp/8x64-b1@fp8:sm_80"]["reasons"][0]["detail"]
    assert "runs only on cuda" in targets["//toy/mlp/8x64-b1@fp8:cpu"]["reasons"][0]["detail"]
    # Blocked by the floor means not traced for it: a CPU fp8 trace would have run here.
    assert not any(t["axes"]["graph"] for t in targets.values())
    # the same layout's other targets are unaffected
    assert by_label(plan(toy, "@int8:sm_80"))["//toy/mlp/8x64-b1@int8:sm_80"]["reasons"][0]["code"] == (
        "no-cuda-torch"
    )


def test_fp8_on_an_sm_its_toolchain_torch_cannot_run_is_blocked(toy: Path, tmp_path: Path) -> None:
    _with_fp8_layout(toy, "l40s", "sm_89")

    def old_torch(platforms: dict[str, Any]) -> None:
        torch = platforms["cuda"]["components"]["torch"]
        platforms["cuda"]["components"]["torch"] = {**torch, "version": "2.11.0+cu130", "digest": "2" * 64}

    t = by_label(plan(toy, "@fp8:sm_89", lock=_lock(toy, tmp_path, old_torch)))["//toy/mlp/8x64-b1@fp8:sm_89"]
    assert t["status"] == "blocked"
    assert t["reasons"][0]["code"] == "layout-toolchain-unsupported"
    assert "2.11.0" in t["reasons"][0]["detail"] and "2.12" in t["reasons"][0]["detail"]
    t = by_label(plan(toy, "@fp8:sm_89", lock=_lock(toy, tmp_path)))["//toy/mlp/8x64-b1@fp8:sm_89"]
    assert t["reasons"][0]["code"] != "layout-toolchain-unsupported"  # torch 2.13 runs it on sm_89


def test_entry_source_change_moves_only_that_graph(toy: Path) -> None:
    before = by_label(plan(toy))
    edit(toy / "toy_models.py", "self.act = nn.GELU()", "self.act = nn.GELU(approximate='tanh')")
    after = by_label(plan(toy))
    assert after[MLP8]["key"] != before[MLP8]["key"]
    assert after[CONV]["key"] == before[CONV]["key"]  # re-traced, same digest: early cutoff
    assert "early-cutoff" in {r["code"] for r in after[CONV]["reasons"]}
    graph_moved = [r for r in after[MLP8]["reasons"] if r.get("axis") == "graph"]
    assert graph_moved and not graph_moved[0]["root"]  # the root cause is the moved trace input
    moved = [r for r in after[MLP8]["reasons"] if r["code"] == "trace-input-moved"]
    assert [(r["component"], r["detail"], r["root"]) for r in moved] == [
        ("toy_models.py", "toy_models.py changed", True)
    ]


def test_an_entry_traced_on_other_strides_re_mints_naming_them(toy: Path) -> None:
    """A package reads its inputs with their traced strides: a layout is part of the program. An
    entry changed to trace a transposed view moves its graph's key and says so (contiguous
    traces keep the keys they had: tests/golden/keys.json)."""
    before = by_label(plan(toy, MLP8))
    contiguous = "return model, (torch.randn(batch, height, width),), {}"
    transposed = "return model, (torch.randn(batch, width, height).transpose(1, 2),), {}"
    edit(toy / "toy_models.py", contiguous, transposed)
    after = by_label(plan(toy, MLP8))
    assert after[MLP8]["key"] != before[MLP8]["key"] and after[MLP8]["status"] == "mint"
    (moved,) = [r for r in after[MLP8]["reasons"] if r.get("axis") == "graph" and r["code"] == "axis-moved"]
    assert moved["old"].endswith("traced strides contiguous"), moved
    assert moved["new"].endswith("traced strides x [512, 1, 8]"), moved
    assert after[MLP8]["axes"]["graph"]["strides"] == {"x": [512, 1, 8]}
    assert "strides" not in before[MLP8]["axes"]["graph"]


def test_installed_library_bump_retraces_and_moves_no_key(toy: Path, tmp_path: Path) -> None:
    first = cli(toy, "plan", "--json")
    assert first.returncode == 0, first.stderr
    shadow = tmp_path / "shadow"
    (shadow / "diffusers-99.0.0.dist-info").mkdir(parents=True)
    (shadow / "diffusers-99.0.0.dist-info" / "METADATA").write_text("Name: diffusers\nVersion: 99.0.0\n")
    env = {**os.environ, "PYTHONPATH": str(shadow)}
    second = cli(toy, "plan", "--json", env=env)
    assert second.returncode == 0, second.stderr
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert keys(a) == keys(b)
    assert "[1/6]" in second.stderr  # it did re-trace
    codes = {r["code"] for r in by_label(b)[MLP8]["reasons"]}
    assert {"trace-input-moved", "early-cutoff"} <= codes
    moved = next(r for r in by_label(b)[MLP8]["reasons"] if r["code"] == "trace-input-moved")
    assert "diffusers" in moved["detail"] and "99.0.0" in moved["detail"]


def _lock(toy: Path, tmp_path: Path, mutate: Any = None) -> str:
    out = cli(toy, "toolchain", "lock")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    if mutate:
        mutate(doc["platforms"])
        for block in doc["platforms"].values():
            block.pop("fold", None)
    path = tmp_path / f"lock{len(list(tmp_path.glob('lock*')))}.json"
    path.write_text(json.dumps(doc))
    return str(path)


def _cuda_facts_from_cpu(toy: Path) -> None:
    """Share the CPU trace facts under the CUDA trace inputs, as a CUDA-build box would.

    Each platform's job is derived as the planner derives it (with that platform's toolchain
    components, which decide the lane values a program carries).
    """
    import sqlite3

    from cgbuild.config.targets import expand
    from cgbuild.core.canon import digest
    from cgbuild.plan import environment
    from cgbuild.plan.inputs import SourceHasher
    from cgbuild.plan.jobs import resolve_toolchains, trace_job
    from cgbuild.plan.tracecache import trace_inputs

    cg = cgfile.load(toy / "Cgfile")
    ws = Workspace(cg)
    toolchains, _ = resolve_toolchains(ws)
    env = digest(sorted(environment.installed().items()))
    sources = SourceHasher(toy / ".cgbuild" / "cache" / "sources.json")
    fam = sources.family_inputs(cg, cg.families["toy"]).digest
    torch = environment.torch_build()["version"]  # type: ignore[index]

    def inputs(t: Any) -> str:
        job = trace_job(ws, t, toolchains).to_json()
        return trace_inputs(
            family_inputs=fam,
            module=t.id.module,
            spec=job["spec"],
            quant=job["quant"],
            torch=torch,
            environment=env,
        )

    targets = expand(cg)
    cpu = {(t.id.module, t.id.graph_class, t.id.layout): t for t in targets if t.device == "cpu"}
    db = sqlite3.connect(toy / ".cgbuild" / "traces.sqlite")
    for t in targets:
        if t.device != "cuda":
            continue
        row = db.execute(
            "SELECT facts FROM traces WHERE inputs=?",
            (inputs(cpu[(t.id.module, t.id.graph_class, t.id.layout)]),),
        ).fetchone()
        db.execute("INSERT OR REPLACE INTO traces VALUES (?, ?)", (inputs(t), row[0]))
    db.commit()
    db.close()
    (toy / ".cgbuild" / "private-facts").touch()  # keep these facts out of the shared cache


def test_triton_bump_moves_only_cuda_targets(toy: Path, tmp_path: Path) -> None:
    # Without lanes: triton's presence decides which lanes a CUDA program carries (a graph change,
    # tests/lanes/test_lanes.py); a version bump of a present triton must move only the toolchain axis.
    edit(toy / "Cgfile", 'linear = ["baseline", "chunked", "triton"]', "")
    edit(toy / "Cgfile", "[family.toy.lanes]", "")
    edit(toy / "Cgfile", 'skus = ["cpu"]', 'skus = ["cpu", "h200"]')
    edit(toy / "Cgfile", "[layout.fp32]", '[sku.h200]\nsm = "sm_90"\nmemory_gib = 141\n\n[layout.fp32]')
    plan(toy)
    _cuda_facts_from_cpu(toy)

    def triton(version: str) -> Any:
        def put(platforms: dict[str, Any]) -> None:
            platforms["cuda"]["components"]["triton"] = {
                "dist": "triton",
                "version": version,
                "digest": version.replace(".", "") * 16,
            }

        return put

    base = plan(toy, lock=_lock(toy, tmp_path, triton("3.6.0")))
    head = plan(toy, lock=_lock(toy, tmp_path, triton("3.7.0")))
    bk, hk = keys(base), keys(head)
    cuda = [label for label in bk if label.endswith(":sm_90")]
    assert cuda and all(bk[label] and hk[label] != bk[label] for label in cuda)
    assert all(hk[label] == bk[label] for label in bk if label.endswith(":cpu"))
    d = diff_plans(Plan.from_json(base, "base"), Plan.from_json(head, "head"))
    moved = {e["label"]: e for e in d["entries"]}
    assert set(moved) == set(cuda)
    assert all(e["axes"] == ["toolchain"] for e in moved.values())
    assert "toolchain: triton 3.6.0 → 3.7.0" in moved[cuda[0]]["detail"]
    assert "re-mint" in render(d, "markdown")


def test_unknown_toolchain_component_moves_the_key(toy: Path, tmp_path: Path) -> None:
    base = keys(plan(toy, lock=_lock(toy, tmp_path)))

    def add(platforms: dict[str, Any]) -> None:
        platforms["cpu"]["components"]["mystery-linker"] = {"version": "1"}

    head = keys(plan(toy, lock=_lock(toy, tmp_path, add)))
    assert all(head[label] != base[label] for label in base)


def test_lock_with_other_torch_leaves_graph_unknown_and_diff_is_certain(toy: Path, tmp_path: Path) -> None:
    base_lock = _lock(toy, tmp_path)
    base = plan(toy, lock=base_lock)

    def bump_torch(platforms: dict[str, Any]) -> None:
        for block in platforms.values():
            block["components"]["torch"] = {
                **block["components"]["torch"],
                "version": "2.99.0",
                "digest": "1" * 64,
            }

    head = plan(toy, lock=_lock(toy, tmp_path, bump_torch))
    t = by_label(head)[MLP8]
    assert t["status"] == "trace" and t["key"] is None
    assert t["reasons"][0]["code"] == "graph-unknown"
    d = diff_plans(Plan.from_json(base, "base"), Plan.from_json(head, "head"))
    entry = next(e for e in d["entries"] if e["label"] == MLP8)
    assert entry["certain"] and entry["remint"]
    assert "re-mint certain" in entry["detail"] and "torch" in entry["detail"] and "2.99.0" in entry["detail"]


def test_cuda_target_with_cpu_torch_is_blocked(toy: Path) -> None:
    edit(toy / "Cgfile", 'skus = ["cpu"]', 'skus = ["cpu", "h200"]')
    edit(toy / "Cgfile", "[layout.fp32]", '[sku.h200]\nsm = "sm_90"\nmemory_gib = 141\n\n[layout.fp32]')
    p = plan(toy, ":h200")
    assert {t["status"] for t in p["targets"]} == {"blocked"}
    assert {t["reasons"][0]["code"] for t in p["targets"]} == {"no-cuda-torch"}


def test_warm_plan_does_not_import_torch(toy: Path) -> None:
    assert cli(toy, "plan").returncode == 0
    code = (
        "import sys; from cgbuild.cli.main import main; rc = main(['-C', sys.argv[1], 'plan', '--json']); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(toy)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "tracing" not in proc.stderr


def test_why_separates_root_causes(toy: Path) -> None:
    plan(toy)
    edit(toy / "toy_models.py", "self.act = nn.GELU()", "self.act = nn.GELU(approximate='tanh')")
    out = cli(toy, "why", MLP8)
    assert out.returncode == 0, out.stderr
    root, _, propagated = out.stdout.partition("propagated")
    assert "trace-input-moved" in root
    assert "graph:" in propagated and "missing-from-store" in propagated


def test_diff_cli_exit_code_and_formats(toy: Path, tmp_path: Path) -> None:
    base = tmp_path / "base.json"
    head = tmp_path / "head.json"
    assert cli(toy, "plan", "-o", str(base)).returncode == 0
    edit(toy / "Cgfile", 'shapes = ["32x32"]', 'shapes = ["32x32", "64x64"]')
    assert cli(toy, "plan", "-o", str(head)).returncode == 0
    same = cli(toy, "diff", str(base), str(base), "--exit-code")
    assert same.returncode == 0 and "no target moved" in same.stdout
    moved = cli(toy, "diff", str(base), str(head), "--exit-code", "--format", "markdown")
    assert moved.returncode == 1
    assert "`//toy/conv/64x64-b2@fp32:cpu`" in moved.stdout and "**toy**" in moved.stdout
    bad = cli(toy, "diff", str(base), str(toy / "Cgfile"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_query_outputs(toy: Path) -> None:
    dot = cli(toy, "query", "//toy/mlp", "--output", "dot")
    assert dot.returncode == 0 and dot.stdout.startswith("digraph cgbuild")
    assert '"sources://toy" -> "trace://toy/mlp/8x64-b1@fp32:cpu"' in dot.stdout
    data = json.loads(cli(toy, "query", "//...", "--output", "json").stdout)
    assert [t["label"] for t in data["targets"]] == [
        MLP8,
        MLP8_INT8,
        MLP16,
        "//toy/mlp/16x64-b1@int8:cpu",
        CONV,
        CONV_INT8,
    ]


def test_unknown_graph_target_reports_moved_inputs_once(toy: Path) -> None:
    edit(toy / "Cgfile", 'skus = ["cpu"]', 'skus = ["cpu", "h200"]')
    edit(toy / "Cgfile", "[layout.fp32]", '[sku.h200]\nsm = "sm_90"\nmemory_gib = 141\n\n[layout.fp32]')
    plan(toy, ":h200")
    edit(toy / "toy_models.py", "self.act = nn.GELU()", "self.act = nn.GELU(approximate='tanh')")
    first = plan(toy, ":h200")["targets"][0]
    assert "trace-input-moved" in {r["code"] for r in first["reasons"]}
    again = plan(toy, ":h200")["targets"][0]  # nothing moved since: the inputs seen were recorded
    assert "trace-input-moved" not in {r["code"] for r in again["reasons"]}


def test_a_malformed_ref_reads_mint_with_its_reason_and_plan_leaves_it(toy: Path) -> None:
    key = by_label(plan(toy))[MLP8]["key"]
    store = Store(toy / ".cgbuild" / "store")
    store.ref_path(key).parent.mkdir(parents=True, exist_ok=True)
    store.ref_path(key).write_text("[]")
    target = by_label(plan(toy))[MLP8]
    assert target["status"] == "mint" and "malformed-ref" in [r["code"] for r in target["reasons"]]
    assert store.ref_path(key).read_text() == "[]"  # plan reads; writers quarantine


def _why(ws: Path, label: str, capsys: pytest.CaptureFixture[str]) -> str:
    from cgbuild.cli.main import main

    capsys.readouterr()
    assert main(["-C", str(ws), "why", label]) == 0
    return capsys.readouterr().out.partition("propagated")[0]


def _stored(ws: Path, tmp_path: Path, *selector: str) -> tuple[Store, Path]:
    """Every key `plan(ws, *selector)` names admitted with one stand-in artifact: (the store, it)."""
    artifact = tmp_path / "artifact.bin"
    artifact.write_bytes(b"stand-in bytes: the mint tests admit real artifacts")
    store = Store(ws / ".cgbuild" / "store")
    for t in plan(ws, *selector)["targets"]:
        store.admit(t["key"], artifact)
    return store, artifact


def test_root_causes_stay_until_fresh_and_only_plan_records(
    toy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cgbuild.cli.main import main
    from cgbuild.plan.planner import record_minted

    store, artifact = _stored(toy, tmp_path)
    assert {t["status"] for t in plan(toy)["targets"]} == {"fresh"}  # every reference is now
    edit(toy / "toy_models.py", "self.act = nn.GELU()", "self.act = nn.GELU(approximate='tanh')")
    plan(toy)
    recorded = (toy / ".cgbuild" / "last-plan.json").read_bytes()
    for _ in range(2):  # asked again, `why` still names what moved: it consumed nothing
        root = _why(toy, MLP8, capsys)
        assert "trace-input-moved" in root and "missing-from-store" not in root
    assert main(["-C", str(toy), "query", "//toy"]) == 0
    assert (toy / ".cgbuild" / "last-plan.json").read_bytes() == recorded  # why and query never write
    assert main(["-C", str(toy), "plan", "--json", "-o", str(tmp_path / "p.json")]) == 0
    assert "trace-input-moved" in _why(toy, MLP8, capsys)  # a second plan keeps the root cause
    edit(toy / "Cgfile", 'shapes = ["32x32"]', 'shapes = ["32x32", "64x64"]')
    _why(toy, "//toy/conv/64x64-b2@fp32:cpu", capsys)
    assert "64x64" not in (toy / ".cgbuild" / "last-plan.json").read_text()
    assert main(["-C", str(toy), "plan", "--json"]) == 0
    assert "64x64" in (toy / ".cgbuild" / "last-plan.json").read_text()  # plan records
    # a mint of the moved key advances its reference: nothing moved since, it only lacks the store
    record_minted(Workspace(cgfile.load(toy / "Cgfile")), {by_label(plan(toy))[MLP8]["key"]})
    root = _why(toy, MLP8, capsys)
    assert "trace-input-moved" not in root and "missing-from-store" in root
    # a fresh key advances it too
    store.admit(by_label(plan(toy))[MLP16]["key"], artifact)
    assert by_label(plan(toy))[MLP16]["status"] == "fresh"
    edit(toy / "toy_models.py", "self.act = nn.GELU(approximate='tanh')", "self.act = nn.GELU()")
    back = by_label(plan(toy))[MLP16]  # the first artifact again: fresh, what moved is informational
    assert back["status"] == "fresh" and not any(r["root"] for r in back["reasons"])
    assert "trace-input-moved" in {r["code"] for r in back["reasons"]}
    assert by_label(plan(toy))[MLP16]["reasons"] == []  # and the reference is now


def test_root_causes_name_the_config_key_and_group_per_family(
    toy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cgbuild.cli.plan import show

    _stored(toy, tmp_path)
    plan(toy)  # every reference is now
    # 8 chunks split the fp32 fc1 (128 rows) otherwise; every other chunked layer splits as before
    edit(
        toy / "Cgfile",
        "config = { hidden = 128, out = 10 }",
        "config = { hidden = 128, out = 10, chunks = 8 }",
    )
    after = plan(toy)
    mlp = by_label(after)[MLP8]
    (root,) = [r for r in mlp["reasons"] if r["root"]]
    assert root == {
        "code": "trace-input-moved",
        "detail": "family.toy.config.chunks changed (absent → 8)",
        "root": True,
        "component": "family.toy.config.chunks",
        "old": "absent",
        "new": "8",
    }
    conv = by_label(after)[CONV]
    assert conv["status"] == "fresh" and "early-cutoff" in {r["code"] for r in conv["reasons"]}
    capsys.readouterr()
    show(Plan.from_json(after, "plan").rows, every=False)
    out = capsys.readouterr().out
    assert "toy\n  2 targets re-mint: family.toy.config.chunks changed (absent → 8)\n" in out
    assert "4 targets re-traced to an unchanged graph (early cutoff)" in out


def test_plan_exit_code_for_ci_gates(toy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cgbuild.cli.main import main

    edit(toy / "Cgfile", 'skus = ["cpu"]', 'skus = ["cpu", "h200"]')
    edit(toy / "Cgfile", "[layout.fp32]", '[sku.h200]\nsm = "sm_90"\nmemory_gib = 141\n\n[layout.fp32]')
    assert main(["-C", str(toy), "plan", "--exit-code"]) == 1  # nothing minted yet
    _stored(toy, tmp_path, ":cpu")
    # the CPU targets are fresh; the GPU ones are blocked by this machine's CPU-only torch only
    assert main(["-C", str(toy), "plan", "--exit-code", "--json"]) == 0
    assert main(["-C", str(toy), "plan"]) == 0  # without the flag: always 0
    capsys.readouterr()


def test_why_and_toolchain_show_print_the_settings(toy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cgbuild.cli.main import main

    capsys.readouterr()
    assert main(["-C", str(toy), "toolchain", "show"]) == 0
    shown = capsys.readouterr().out
    (settings,) = [line for line in shown.splitlines() if line.split()[:1] == ["settings"]][:1]
    assert "cgbuild.policy/1" not in shown and "inductor " in settings and "cpp.march=" in settings
    assert main(["-C", str(toy), "why", MLP8, "--no-trace"]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["toolchain"]]
    assert "settings ," not in line and "settings inductor " in line and "; torch 2." in line
