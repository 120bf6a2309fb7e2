"""`cgbuild mint` end to end: real traces, real AOTInductor compiles on the CPU, a real store.

Compiles cost ~30 s each on two cores, so one minted toy workspace is shared by the tests that
only read it; tests that change it work on a copy.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from support.cli import cli
from support.toy import copy_toy

from cgbuild.core.platform import host_name
from cgbuild.store.local import Store
from cgbuild.store.seal import read_metadata

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
README = EXAMPLES.parent / "README.md"
MLP8 = "//toy/mlp/8x64-b1@fp32:cpu"

pytestmark = pytest.mark.slow


def mint_json(ws: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    proc = cli(ws, "mint", *args, "--json", env=env)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


def copy_ws(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__"), symlinks=True)
    return dest


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


@pytest.fixture(scope="module")
def minted_toy(tmp_path_factory: pytest.TempPathFactory, toy_reference: Path) -> Path:
    """The toy's plain layout minted (three compiles); its int8 targets stay to mint."""
    ws = copy_toy(tmp_path_factory.mktemp("minted") / "toy", toy_reference)
    proc = cli(ws, "mint", "//toy@fp32:cpu", "--json", "-j", "1")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(summary["minted"]) == 3 and not summary["failed"] and not summary["refused"]
    (ws / "mint-progress.txt").write_text(proc.stderr)  # what a person watching it saw
    return ws


def test_mint_records_and_artifacts(minted_toy: Path) -> None:
    plan = json.loads(cli(minted_toy, "plan", "@fp32", "--json").stdout)
    assert {t["status"] for t in plan["targets"]} == {"fresh"}
    store = Store(minted_toy / ".cgbuild" / "store")
    for t in plan["targets"]:
        record = json.loads((minted_toy / ".cgbuild" / "mint" / f"{t['key']}.json").read_text())
        assert record["state"] == "ok" and record["labels"] == [t["label"]]
        assert {"export", "compile", "verify", "seal"} <= set(record["result"]["phases"])
        log = Path(record["log"]).read_text()  # the worker's own output, stage by stage
        assert "== compile stage" in log and "== check stage" in log
        meta = read_metadata(store.resolve(t["key"]).path)
        assert meta["key"] == t["key"] and meta["sm"] == "cpu"
        assert meta["facets"] == [t["envelope"]]
        assert meta["axes"]["graph"]["digest"] == t["axes"]["graph"]["digest"]
        assert "source" not in meta["axes"]["toolchain"]


def test_a_cold_mint_traces_a_key_once_in_the_worker_that_compiles_it(
    minted_toy: Path, tmp_path: Path, toy_reference: Path
) -> None:
    """One slot (-j 1): the first unit's plan trace was the minting worker's own; the other two
    were traced by the trace rule. Either way the keys are the ones a plan alone computes."""
    plan = json.loads(cli(minted_toy, "plan", "@fp32", "--json").stdout)
    records = [
        json.loads((minted_toy / ".cgbuild" / "mint" / f"{t['key']}.json").read_text())
        for t in plan["targets"]
    ]
    assert sorted(r["traced_here"] for r in records) == [False, False, True]
    assert not list((minted_toy / ".cgbuild" / "mint").glob("held-*"))
    alone = copy_toy(tmp_path / "alone", toy_reference)
    again = json.loads(cli(alone, "plan", "@fp32", "--json").stdout)
    assert {t["label"]: t["key"] for t in again["targets"]} == {t["label"]: t["key"] for t in plan["targets"]}


def test_a_re_trace_to_the_same_graph_stops_its_held_worker(minted_toy: Path, tmp_path: Path) -> None:
    """Early cutoff through a held trace: the key stays fresh, so its worker is told to stop
    and leaves no folder, log or process behind."""
    ws = copy_ws(minted_toy, tmp_path / "toy")
    (ws / "toy_models.py").write_text((ws / "toy_models.py").read_text() + "\n# a comment moves no graph\n")
    rc, summary = mint_json(ws, MLP8)
    assert rc == 0 and summary["minted"] == [] and summary["fresh"] == 1
    assert not [p for p in (ws / ".cgbuild" / "build").iterdir()]
    assert not list((ws / ".cgbuild" / "mint").glob("held-*"))


def with_a_new_conv_shape(minted_toy: Path, tmp_path: Path) -> tuple[Path, str]:
    """A copy of the minted toy that declares one more conv shape, and that new target's label."""
    ws = copy_ws(minted_toy, tmp_path / "toy")
    edit(ws / "Cgfile", 'shapes = ["32x32"]', 'shapes = ["32x32", "16x16"]')
    return ws, "//toy/conv/16x16-b2@fp32:cpu"


def test_a_held_trace_that_dies_refuses_its_target_with_the_typed_end(
    minted_toy: Path, tmp_path: Path
) -> None:
    ws, label = with_a_new_conv_shape(minted_toy, tmp_path)
    rc, summary = mint_json(ws, label, env={**os.environ, "CGBUILD_MINT_FAULT": "trace:SIGKILL"})
    assert rc == 1 and summary["minted"] == [] and summary["failed"] == []
    (refused,) = summary["refused"]
    assert refused["code"] == "worker-killed" and "trace stage" in refused["detail"], refused


def test_mint_progress_in_execution_order_with_waits_and_phase_times(minted_toy: Path) -> None:
    lines = [
        line
        for line in (minted_toy / "mint-progress.txt").read_text().splitlines()
        if line.startswith("mint ")
    ]
    keys = list(dict.fromkeys(line.split()[1] for line in lines))
    assert len(keys) == 3
    # -j 1: the second and third key wait for a slot, and say so, before they start
    waits = [
        k
        for k in keys
        if any(line.startswith(f"mint {k}") and "waiting for a free mint slot" in line for line in lines)
    ]
    assert len(waits) == 2

    def events(key: str) -> list[str]:
        return [line.split(": ", 1)[1] for line in lines if line.startswith(f"mint {key}")]

    (first,) = [k for k in keys if k not in waits]
    phases = [p.split(" (")[0].split(":")[0] for p in events(first)]
    assert phases[:3] == ["starting", "compile", "verify"] and phases[-2:] == ["admitting", "done"]
    assert phases.index("lanes") < phases.index("seal")
    assert all(" took " in p for p in events(first)[1:])  # each change says how long the last took
    for key in waits:
        later = events(key)
        assert later[0].startswith("waiting for a free mint slot (1 at once")
        assert later[1].startswith("starting (waiting for a free mint slot") and " took " in later[1]


def test_second_mint_is_a_noop(minted_toy: Path) -> None:
    rc, summary = mint_json(minted_toy, "//toy@fp32:cpu")
    assert rc == 0
    assert summary["minted"] == [] and summary["fresh"] == 3


def test_verify_run_then_flipped_byte_is_quarantined(minted_toy: Path, tmp_path: Path) -> None:
    ok = cli(minted_toy, "verify", "//toy/mlp", "--run", "--json")
    assert ok.returncode == 0, ok.stderr
    assert {a["status"] for a in json.loads(ok.stdout)["artifacts"]} == {"ok"}
    ws = copy_ws(minted_toy, tmp_path / "toy")
    store = Store(ws / ".cgbuild" / "store")
    plan = json.loads(cli(ws, "plan", MLP8, "--json").stdout)
    key = plan["targets"][0]["key"]
    obj = store.resolve(key, verify=False).path
    os.chmod(obj, 0o644)
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0xFF
    obj.write_bytes(bytes(data))
    bad = cli(ws, "verify", MLP8, "--json")
    assert bad.returncode == 1
    assert json.loads(bad.stdout)["artifacts"][0]["status"] == "corrupt"
    after = json.loads(cli(ws, "plan", MLP8, "--json").stdout)["targets"][0]
    assert after["status"] == "mint"
    assert after["reasons"][0]["code"] == "quarantined"


def test_mint_check_and_gc_quarantine_a_ref_naming_another_keys_artifact(
    minted_toy: Path, tmp_path: Path
) -> None:
    """Plan reads such a ref fresh (it opens no artifact); the commands that open it anyway
    quarantine it: `mint --check` before re-minting anything, and `gc`."""
    ws = copy_ws(minted_toy, tmp_path / "toy")
    store = Store(ws / ".cgbuild" / "store")
    plan = json.loads(cli(ws, "plan", "//toy@fp32:cpu", "--json").stdout)["targets"]
    targets = [t for t in plan if t["status"] == "fresh"]
    mine, theirs = (store.read_ref(t["key"]) for t in targets[:2])
    assert mine is not None and theirs is not None
    doc = store.ref_path(mine.key).read_text()
    crossed = doc.replace(mine.object, theirs.object).replace(f'"size":{mine.size}', f'"size":{theirs.size}')
    store.ref_path(mine.key).write_text(crossed)
    again = json.loads(cli(ws, "plan", targets[0]["label"], "--json").stdout)["targets"][0]
    assert again["status"] == "fresh"
    proc = cli(ws, "mint", targets[0]["label"], "--check", "--json")
    error = json.loads(proc.stdout)["checks"][0]["error"]
    assert proc.returncode == 1 and error["code"] == "key-mismatch", proc.stdout + proc.stderr
    assert store.ref_state(mine.key) == "quarantined" and store.ref_state(theirs.key) == "fresh"
    assert store.admit(mine.key, store.object_path(mine.object)).status == "admitted"  # repaired
    store.ref_path(mine.key).write_text(crossed)
    gc = json.loads(cli(ws, "gc", "--json").stdout)
    assert gc["refs_quarantined"] == [mine.key] and store.ref_state(mine.key) == "quarantined"


def test_mint_plan_mints_exactly_the_approved_keys(minted_toy: Path, tmp_path: Path) -> None:
    ws = copy_ws(minted_toy, tmp_path / "toy")
    cg = ws / "Cgfile"
    edit(cg, 'shapes = ["8x64", "16x64"]', 'shapes = ["8x64", "16x64", "32x64"]')
    approved = tmp_path / "approved.json"
    assert cli(ws, "plan", "@fp32", "-o", str(approved)).returncode == 0
    edit(cg, '"32x64"]', '"32x64", "4x64"]')  # declared after approval: not minted
    rc, summary = mint_json(ws, "--plan", str(approved))
    assert rc == 0, summary
    assert [m["labels"] for m in summary["minted"]] == [["//toy/mlp/32x64-b1@fp32:cpu"]]
    statuses = {t["label"]: t["status"] for t in json.loads(cli(ws, "plan", "--json").stdout)["targets"]}
    assert statuses["//toy/mlp/4x64-b1@fp32:cpu"] == "mint"
    # the approved key moves (a source edit): --plan refuses rather than mint another identity
    edit(ws / "toy_models.py", "self.act = nn.GELU()", "self.act = nn.GELU(approximate='tanh')")
    rc, summary = mint_json(ws, "--plan", str(approved))
    assert rc == 1 and summary["minted"] == []
    assert {r["code"] for r in summary["refused"]} == {"plan-stale"}


def test_killed_worker_is_a_typed_retryable_failure_and_rerun_resumes(
    minted_toy: Path, tmp_path: Path
) -> None:
    ws, label = with_a_new_conv_shape(minted_toy, tmp_path)
    env = {**os.environ, "CGBUILD_MINT_FAULT": "compile:SIGKILL"}
    rc, summary = mint_json(ws, label, env=env)
    assert rc == 1
    failure = summary["failed"][0]
    assert failure["retryable"] is True and failure["code"] == "worker-killed"
    record = json.loads((ws / ".cgbuild" / "mint" / f"{failure['key']}.json").read_text())
    assert record["state"] == "failed"
    rc, summary = mint_json(ws, label)
    assert rc == 0 and [m["labels"] for m in summary["minted"]] == [[label]]


def test_mint_check_is_byte_identical(minted_toy: Path, tmp_path: Path) -> None:
    ws = copy_ws(minted_toy, tmp_path / "toy")  # a check records its own lane evidence: not in the shared toy
    proc = cli(ws, "mint", MLP8, "--check", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check = json.loads(proc.stdout)["checks"][0]
    assert check["reproducible"] is True
    if check["verdict_moved"]:  # the toy's lanes can sit near the tie band on a loaded host
        assert check["differing"] == ["metadata.json"] and set(check["verdict_moved"]["measured_ns"]) == {
            "baseline",
            "chunked",
        }
    else:
        assert not check["differing"] and not check["fields"]


def test_flux2_tiny_shares_one_key_for_transposed_shapes(tmp_path: Path) -> None:
    ws = copy_ws(EXAMPLES / "flux2_klein", tmp_path / "klein")
    shutil.rmtree(ws / ".cgbuild", ignore_errors=True)
    rc, summary = mint_json(ws, "//flux2-klein-tiny@fp32:cpu")
    assert rc == 0, summary
    labels = sorted(sorted(m["labels"]) for m in summary["minted"])
    assert labels == [
        [
            "//flux2-klein-tiny/transformer/48x64-t8-b1@fp32:cpu",
            "//flux2-klein-tiny/transformer/64x48-t8-b1@fp32:cpu",
        ],
        ["//flux2-klein-tiny/transformer/64x64-t8-b1@fp32:cpu"],
    ]
    shared = next(m for m in summary["minted"] if len(m["labels"]) == 2)
    meta = read_metadata(Store(ws / ".cgbuild" / "store").resolve(shared["key"]).path)
    assert sorted(f["shape"] for f in meta["facets"]) == ["48x64", "64x48"]
    rc, summary = mint_json(ws, "//flux2-klein-tiny@fp32")  # adds the sm_90 targets: CPU torch can't
    assert rc == 1
    assert {r["code"] for r in summary["refused"]} == {"no-cuda-torch"}
    assert summary["fresh"] == 3


# ---- kernel lanes on the toy (measured on this CPU, re-fitted at adopt) ---------------------------
def _toy_mlp() -> Any:
    sys.path.insert(0, str(EXAMPLES / "toy"))
    try:
        import toy_models
    finally:
        sys.path.remove(str(EXAMPLES / "toy"))
    import torch

    torch.manual_seed(11)
    return toy_models.MLP(64, 128, 10, {"linear": ["baseline", "chunked"]}).eval()


def test_toy_lanes_verdict_evidence_and_inspect(minted_toy: Path) -> None:
    from cgbuild import lanes
    from cgbuild.core.platform import host_name

    store = Store(minted_toy / ".cgbuild" / "store")
    plan = json.loads(cli(minted_toy, "plan", "@fp32", "--json").stdout)
    for t in plan["targets"]:
        block = read_metadata(store.resolve(t["key"]).path)["lanes"]
        assert block["axes"] == [{"axis": "linear", "values": ["baseline", "chunked"]}]
        assert block["selector"] == {"input": "_cgbuild_lanes", "axes": ["linear"], "base": 2}
        assert block["excluded"] == {"linear.triton": "not-buildable: needs a cuda device"}
        verdict = block["verdict"]
        assert verdict["candidates"] == ["baseline", "chunked"] and verdict["rule"] == lanes.RULE
        assert verdict["winner"] == verdict["fallback"][0] and sorted(verdict["fallback"]) == [
            "baseline",
            "chunked",
        ]
        assert verdict["binding"] in ("speed", "tie-peak")
        assert all(p % lanes.QUANTUM == 0 and p > 0 for p in verdict["peaks"].values())
        assert verdict["sku"] == {"name": "cpu", "memory_bytes": 24 << 30}
        # raw timings live BESIDE the artifact, never in it
        path = store.root / "evidence" / t["key"] / f"{host_name()}.json"
        run = json.loads(path.read_text())["runs"][0]
        assert run["how"] == "mint" and run["verdict"] == verdict
        assert run["verified_on"]["type"] == "cpu"  # the device verify ran on, beside the artifact
        for lane in ("baseline", "chunked"):
            m = run["measured"][lane]
            assert len(m["samples_ns"]) == 9 and m["median_ns"] > 0 and m["peak_bytes"] > 0
            assert m["peak_method"].startswith("VmHWM") and m["device"]["type"] == "cpu"
        assert "samples_ns" not in json.dumps(block)
    ran = json.loads(cli(minted_toy, "verify", MLP8, "--run", "--json").stdout)["artifacts"][0]
    assert ran["status"] == "ok" and {s["lane"] for s in ran["run"]["served"]} == {"baseline", "chunked"}
    assert all(s["counters"] == {"compiled": 1} for s in ran["run"]["served"])
    proc = cli(minted_toy, "inspect", MLP8, env={**os.environ, "COLUMNS": "250"})
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(cli(minted_toy, "inspect", MLP8, "--json").stdout)
    rows = {line.split("  ")[0]: line for line in proc.stdout.splitlines() if not line.startswith(" ")}
    meta = doc["metadata"]
    assert set(rows) >= {"key", "labels", "graph", "sm", "toolchain", "layout", "signature", "lanes"}
    assert meta["key"] in rows["key"] and MLP8 in rows["labels"]
    assert meta["graph"]["digest"] in rows["graph"] and meta["toolchain"]["fold"] in rows["toolchain"]
    assert "toy.mlp@1+plain.fp32@1" in rows["layout"]
    assert rows["signature"].rstrip().split("  ")[-1].strip() == "(x: float32[1, 8, 64]) -> float32[1, 8, 10]"
    assert "switched by selector _cgbuild_lanes[linear]" in rows["lanes"]  # not in the signature
    assert f"winner {meta['lanes']['verdict']['winner']}" in rows["lanes"]
    assert f"evidence {host_name()} (mint)" in proc.stdout
    torch = meta["toolchain"]["components"]["torch"]["version"]
    assert any(line.split() == ["torch", torch] for line in proc.stdout.splitlines())  # a component row
    assert rows["size"].split()[2] in ("KiB", "MiB") and "fresh (re-hashed now)" in rows["store"]
    assert len(proc.stdout.splitlines()) < 60  # a summary, not the document
    assert doc["lane_evidence"][host_name()]["runs"][0]["measured"].keys() == {"baseline", "chunked"}


def test_toy_lanes_each_match_eager_and_refit_reasons(minted_toy: Path, tmp_path: Path) -> None:
    import torch
    from cgbuild_rules.adopt import adopt
    from cgbuild_rules.lanes import set_lanes

    from cgbuild.store.seal import seal, unseal

    store = Store(minted_toy / ".cgbuild" / "store")
    key = json.loads(cli(minted_toy, "plan", MLP8, "--json").stdout)["targets"][0]["key"]
    m = _toy_mlp()
    x = torch.randn(1, 8, 64)
    for lane in ("baseline", "chunked"):  # one artifact, each lane bound, each equal to its eager
        served = adopt(key, m, store=store, lane=lane)
        set_lanes(m, {"linear": lane})
        with torch.no_grad():
            torch.testing.assert_close(served(x), m(x), rtol=1e-5, atol=1e-6)
        assert served.counters == {"compiled": 1}
    set_lanes(m, {"linear": "baseline"})

    def reason(source: Any, **kw: Any) -> tuple[str, str]:
        (choice,) = adopt(source, m, **kw).lanes.values()
        return choice.lane, choice.code

    winner = read_metadata(store.resolve(key).path)["lanes"]["verdict"]["winner"]
    assert reason(key, store=store) == (winner, "lane-adopted")  # this host's RAM fits it
    assert reason(key, store=store, memory_bytes=1 << 30) == (winner, "lane-refit-no-fit")  # a 1 GiB card
    # Recorded peaks that differ (a copy re-sealed): the winner needs 10.6 GiB, the other 1.3 GiB.
    src = store.resolve(key).path
    files = unseal(src, tmp_path / "u")
    meta = read_metadata(src)
    other = next(v for v in ("baseline", "chunked") if v != winner)
    meta["lanes"]["verdict"]["peaks"] = {winner: 8 << 30, other: 256 << 20}
    edited = tmp_path / "edited.tar.gz"
    seal(edited, meta, {k: v for k, v in files.items() if k != "metadata.json"})
    assert reason(edited, memory_bytes=16 << 30) == (winner, "lane-adopted")
    assert reason(edited, memory_bytes=4 << 30) == (other, "lane-refit")  # a small card: next that fits
    assert reason(edited, memory_bytes=1 << 30) == (other, "lane-refit-no-fit")
    meta["lanes"]["verdict"]["peaks"] = {}
    seal(edited, meta, {k: v for k, v in files.items() if k != "metadata.json"})
    assert reason(edited) == (winner, "lane-unverified")
    served = adopt(edited, m, memory_bytes=4 << 30)
    with torch.no_grad():
        torch.testing.assert_close(served(x), m(x), rtol=1e-5, atol=1e-6)


MACHINE = (
    (re.compile(r"\bwait \d+(?:\.\d+)?s, "), ""),  # a wait for the sandbox another mint held
    (re.compile(r"\b[0-9a-f]{12,64}\b"), "<hex>"),  # keys, digests, folds: this toolchain's
    (re.compile(r"\b\d+(?:\.\d+)? ?(?:s|ms|KiB|MiB|GiB)\b"), "<n>"),  # timings and sizes
    (re.compile(r"\b(gcc|clang|CXXABI|GLIBCXX|GLIBC) \d+(?:\.\d+)*"), r"\1 <version>"),
    (re.compile(r"winner \w+|fallback \w+ > \w+"), "<verdict>"),  # measured: either lane may win
)
"""What differs between machines and runs, never between the code and the README."""


def shown(after: str) -> str:
    """The output block the README shows right after the text `after`."""
    text = README.read_text()
    start = text.index("```\n", text.index(after)) + 4
    return text[start : text.index("```", start)]


def masked(output: str, ws: Path | None = None) -> str:
    """`output` as the README shows it (the workspace and host named as placeholders), with the
    machine's values masked and whitespace collapsed (rich pads and wraps by the terminal)."""
    if ws is not None:
        output = output.replace(str(ws), "<workspace>").replace(f" {host_name()} (", " <host> (")
    for pattern, replacement in MACHINE:
        output = pattern.sub(replacement, output)
    return " ".join(output.split())


def test_readme_shows_what_the_minted_toy_prints(minted_toy: Path, tmp_path: Path) -> None:
    """README's "What it prints": `inspect` of the minted MLP, and the plan after a config edit,
    regenerated here from the minted toy and compared, the machine's values masked."""
    ws = copy_ws(minted_toy, tmp_path / "toy")
    env = {**os.environ, "COLUMNS": "100"}
    proc = cli(ws, "inspect", MLP8, env=env)
    assert proc.returncode == 0, proc.stderr
    assert masked(proc.stdout, ws) == masked(shown(f"`cgbuild inspect {MLP8}`"))
    edit(ws / "Cgfile", "out = 10 }", "out = 10, chunks = 8 }")
    proc = cli(ws, "plan", "@fp32", env=env)
    assert proc.returncode == 0, proc.stderr
    assert masked(proc.stdout, ws) == masked(shown("`cgbuild plan @fp32` after adding `chunks = 8`"))
