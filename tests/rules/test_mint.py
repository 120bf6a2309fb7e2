"""The mint worker, with real AOTInductor compiles of a tiny MLP on the CPU.

Compiles are the expensive part (tens of seconds each on a 2-core box), so a test session makes
exactly three: `minted("A")` (a static class with a trace-baked literal), `minted("B")` (a
dynamic-batch class, for routing in test_adopt) and the double mint of A in a fresh sandbox.
`minted` is memoised at module level so test_adopt shares the same artifacts.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from cgbuild.identity import keys, toolchain
from cgbuild.store.seal import read_metadata, unseal

ENTRY = textwrap.dedent(
    '''
    """A tiny MLP with a trace-baked literal (a non-persistent buffer)."""
    import torch
    from torch import nn


    class Tiny(nn.Module):
        def __init__(self, features: int, hidden: int = 32, out: int = 4) -> None:
            super().__init__()
            self.fc1 = nn.Linear(features, hidden)
            self.fc2 = nn.Linear(hidden, out)
            self.register_buffer("scale", torch.linspace(0.5, 1.5, hidden), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(torch.nn.functional.gelu(self.fc1(x)) * self.scale)


    def build(spec):
        model = Tiny(spec["width"])
        dyn = spec["config"].get("dynamic_batch")
        if dyn:
            x = torch.randn(max(spec["batch"], 2), spec["height"], spec["width"])
            return model, (x,), {}, {"x": {0: torch.export.Dim("batch", min=dyn[0], max=dyn[1])}}
        return model, (torch.randn(spec["batch"], spec["height"], spec["width"]),), {}
    '''
)
CLASSES: dict[str, dict[str, Any]] = {
    "A": {"graph_class": "8x64-b1", "height": 8, "batch": 1, "config": {}},
    "B": {"graph_class": "4x64-b2-16", "height": 4, "batch": 2, "config": {"dynamic_batch": [2, 16]}},
}
_MINTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
ANNOUNCED: dict[str, list[str]] = {}
"""Request id → the phases its worker announced, in order."""


def session_dirs(factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(entry root, sandbox) shared by every mint of the session; the sandbox path is fixed."""
    base = factory.getbasetemp()
    root, sandbox = base / "entry", base / "sandbox"
    if not root.exists():
        root.mkdir()
        (root / "tiny_entry.py").write_text(ENTRY)
    return root, sandbox


def job_for(root: Path, name: str, device: str = "cpu") -> dict[str, Any]:
    c = CLASSES[name]
    spec = {
        "family": "tiny",
        "module": "mlp",
        "graph_class": c["graph_class"],
        "height": c["height"],
        "width": 64,
        "text_len": None,
        "batch": c["batch"],
        "dtype": "float32",
        "device": device,
    }
    return {
        "id": name,
        "entry": "tiny_entry:build",
        "root": str(root),
        "config": c["config"],
        "spec": spec,
        "quant": "plain.fp32",
    }


def request_for(job: dict[str, Any], out: Path, sandbox: Path, **extra: Any) -> dict[str, Any]:
    """A request as the engine builds it: digest from a fake-mode trace, toolchain from a probe."""
    from cgbuild_rules.trace import export_job

    _, facts = export_job(job, "fake")
    block = toolchain.probe()["cpu"]
    fold = toolchain.fold(block["components"])
    axes = {
        "graph": keys.graph_axis(facts["graph_digest"], torch=facts["torch"], nodes=facts["nodes"]),
        "sm": keys.sm_axis("cpu"),
        "toolchain": keys.toolchain_axis("cpu", fold, "probe"),
        "layout": keys.Axis({"stamp": "tiny.mlp@1+plain.fp32@1"}, {"stamp": "tiny.mlp@1+plain.fp32@1"}),
    }
    return {
        "schema": "cgbuild.mint-request/1",
        "id": job["id"],
        "key": keys.key_of(axes),
        "labels": [],
        "job": job,
        "sm": "cpu",
        "graph_digest": facts["graph_digest"],
        "toolchain": {"platform": "cpu", "fold": fold, "components": block["components"]},
        "axes": {name: axis.readable for name, axis in axes.items()},
        "facets": [{"graph_class": job["spec"]["graph_class"]}],
        "stamp": "tiny.mlp@1+plain.fp32@1",
        "out": str(out),
        "sandbox": str(sandbox),
        **extra,
    }


def run_worker(request: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "cgbuild_rules.mint"],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    # progress lines ({"id", "progress"}) come first; exactly one result line ends the output
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{") and '"progress"' not in ln]
    assert len(lines) == 1, (
        f"exactly one result line expected; stdout={proc.stdout!r} stderr={proc.stderr[-2000:]}"
    )
    said = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{") and '"progress"' in ln]
    ANNOUNCED[str(request.get("id"))] = [str(m["progress"]) for m in said]
    return json.loads(lines[0])


def minted(factory: pytest.TempPathFactory, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(request, result) of the session's one real mint of class `name`."""
    if name not in _MINTS:
        root, sandbox = session_dirs(factory)
        req = request_for(job_for(root, name), factory.mktemp(f"out{name}"), sandbox)
        result = run_worker(req)
        assert result["ok"], result
        _MINTS[name] = (req, result)
    return _MINTS[name]


@pytest.fixture(scope="session")
def mint_a(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    return minted(tmp_path_factory, "A")


# ---- with a real compile ----------------------------------------------------------------------
@pytest.mark.slow
def test_every_phase_a_worker_announces_is_a_step_of_the_progress_bar(
    mint_a: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    """The CLI counts a key's progress by the phases the worker names: one it does not know
    would drop the bar to 0 (the serve check once did)."""
    from cgbuild.cli.mint import STEPS
    from cgbuild.protocol.mint import PHASES

    announced = [p.split(":")[0] for p in ANNOUNCED[mint_a[0]["id"]]]
    assert announced and all(p in STEPS for p in announced), announced
    assert [p for p in PHASES if p in announced] == [p for p in announced if p in PHASES]
    assert {"compile", "verify", "seal", "adopt"} <= set(announced)


@pytest.mark.slow
def test_mint_seals_a_verified_artifact(
    mint_a: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path
) -> None:
    req, result = mint_a
    print("\nmint phases (s):", json.dumps(result["phases"]), "artifact bytes:", result["size"])
    assert result["key"] == req["key"] and Path(result["artifact"]).name == f"{req['key']}.tar.gz"
    assert set(result["phases"]) == {"export", "compile", "verify", "seal", "adopt", "total"}
    assert result["served"] == [{"counters": {"compiled": 1}, "seconds": result["served"][0]["seconds"]}]
    assert result["verify"][0]["rel_rms"] < 1e-5
    meta = read_metadata(result["artifact"])
    assert meta["key"] == req["key"] and meta["graph"]["digest"] == req["graph_digest"]
    assert meta["graph"]["contract"]["inputs"][0]["leaves"][0]["shape"] == [1, 8, 64]
    assert meta["toolchain"]["fold"] == req["toolchain"]["fold"]
    assert meta["policy"]["aot_inductor.package_constants_in_so"] is False
    assert meta["host"]["isa"]["level"] == "x86-64-v3" and meta["host"]["aoti_cpu_isa"] == "AVX2"
    assert meta["host"]["runtime"]["GLIBCXX"].startswith("3.4.")
    assert [r["fqn"] for r in meta["constants"]["literal"]] == ["scale"]
    assert [r["fqn"] for r in meta["constants"]["state"]] == [
        "fc1.bias",
        "fc1.weight",
        "fc2.bias",
        "fc2.weight",
    ]
    assert meta["facets"] == [{"graph_class": "8x64-b1"}] and meta["stamp"] == "tiny.mlp@1+plain.fp32@1"
    text = json.dumps(meta)
    assert (
        req["sandbox"] not in text and req["out"] not in text and "seconds" not in text
    )  # no paths, no clocks
    files = unseal(result["artifact"], tmp_path / "x")
    assert set(files) == {"metadata.json", "model.pt2", "constants.safetensors"}
    import zipfile

    with zipfile.ZipFile(files["model.pt2"]) as z:
        names = z.namelist()
        cpp = [z.read(n).decode() for n in names if n.endswith(".cpp")]
    assert all(n.startswith("model/") for n in names)
    assert cpp and not any("// Compile cmd" in c or req["sandbox"] in c for c in cpp)


@pytest.mark.slow
def test_double_mint_in_a_fresh_sandbox_is_byte_identical(
    mint_a: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path
) -> None:
    req, first = mint_a
    # a fresh mint empties the sandbox, so it waits for the warm mint holding it: a timed phase
    held = os.open(f"{req['sandbox']}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(held, fcntl.LOCK_SH)
    threading.Timer(3.0, os.close, (held,)).start()
    again = run_worker(
        {**req, "id": "again", "out": str(tmp_path), "fresh": True, "compare_with": first["artifact"]}
    )
    assert again["ok"], again
    assert again["differing"] == [] and again["reproducible"] is True
    assert again["sha256"] == first["sha256"]
    assert again["phases"]["wait"] >= 2.0 and "wait" not in first["phases"]
    assert ANNOUNCED["again"][0].startswith("waiting for the compile sandbox")


# ---- refusals and failures: no compile ---------------------------------------------------------
@pytest.fixture(scope="module")
def cheap_request(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root, _ = session_dirs(tmp_path_factory)
    return request_for(job_for(root, "A"), tmp_path_factory.mktemp("cheap"), tmp_path_factory.mktemp("sb"))


def test_graph_drift_is_refused_before_compiling(cheap_request: dict[str, Any]) -> None:
    result = run_worker({**cheap_request, "graph_digest": "0" * 64})
    assert result["ok"] is False and result["code"] == "graph-drift" and result["retryable"] is False
    assert result["old"] == "0" * 64 and result["new"] == cheap_request["graph_digest"]
    assert result["phase"] == "compile" and "000000000000 →" in result["detail"]


def test_toolchain_drift_names_the_component(cheap_request: dict[str, Any]) -> None:
    tc = json.loads(json.dumps(cheap_request["toolchain"]))
    tc["components"]["cxx"]["version"] = "11.1.0"
    tc["fold"] = toolchain.fold(tc["components"])
    result = run_worker({**cheap_request, "toolchain": tc})
    assert result["code"] == "toolchain-drift" and result["retryable"] is False
    assert result["old"] == tc["fold"] and result["new"] == cheap_request["toolchain"]["fold"]
    assert any(c.startswith("cxx") and "11.1.0" in c for c in result["changes"]), result


def test_cuda_key_on_a_cpu_machine_is_refused_naming_the_sm(cheap_request: dict[str, Any]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    job = json.loads(json.dumps(cheap_request["job"]))
    job["spec"]["device"] = "cuda"
    tc = {**cheap_request["toolchain"], "platform": "cuda"}
    result = run_worker({**cheap_request, "job": job, "sm": "sm_90", "toolchain": tc})
    assert result["code"] == "wrong-device" and result["needed"] == "sm_90" and "sm_90" in result["detail"]
    assert result["retryable"] is False


@pytest.mark.parametrize(("sig", "code"), [("SIGKILL", "worker-killed"), ("SIGSEGV", "worker-signal")])
def test_a_stage_that_dies_is_a_typed_retryable_failure(
    cheap_request: dict[str, Any], sig: str, code: str
) -> None:
    import os

    result = run_worker(cheap_request, env={**os.environ, "CGBUILD_MINT_FAULT": f"compile:{sig}"})
    assert result["ok"] is False and result["code"] == code and result["retryable"] is True
    assert result["signal"] == sig and result["phase"] == "compile"


def test_a_stage_part_without_a_result_in_time_is_a_typed_timeout(cheap_request: dict[str, Any]) -> None:
    """The compile stage traces, then its compiler hangs: the part's deadline ends it, typed."""
    import os

    env = {**os.environ, "CGBUILD_MINT_FAULT": "compile:hang"}
    result = run_worker({**cheap_request, "timeout_s": 20}, env=env)
    assert result["ok"] is False and result["code"] == "timeout" and result["retryable"] is True
    assert result["phase"] == "compile" and "no result within 20 s" in result["detail"]


def test_a_stage_the_spawner_refuses_to_start_fails_its_first_part_typed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While cgbuild is stopping the spawner starts no stage: the part the worker waits on says
    the stage did not start (typed `worker-killed`), at once, not after its timeout."""
    import os
    import time

    from cgbuild_rules.mint import MintFailure, _Stage

    from cgbuild.protocol import spawn

    monkeypatch.setattr(spawn, "_stopping", True)  # what stop_children() leaves behind
    started = time.monotonic()
    stage = _Stage("check", tmp_path, os.environ, timeout_s=600)
    with pytest.raises(MintFailure) as failed:
        stage.part("verify")
    assert failed.value.code == "worker-killed" and "verify stage did not start" in failed.value.detail
    assert time.monotonic() - started < 60 and stage.pid is None


@pytest.mark.parametrize(("part", "phase"), [("verify", "verify"), ("serve", "adopt")])
def test_the_check_stage_dying_in_a_part_fails_that_phase(
    cheap_request: dict[str, Any], part: str, phase: str
) -> None:
    """verify, measure and serve run in one child started beside the compile: its death while
    the worker waits on one of them is that phase's typed, retryable failure (never a hang)."""
    import os

    result = run_worker(cheap_request, env={**os.environ, "CGBUILD_MINT_FAULT": f"{part}:SIGKILL"})
    assert result["ok"] is False and result["code"] == "worker-killed" and result["retryable"] is True
    assert result["phase"] == phase and result["signal"] == "SIGKILL"
    assert f"{part} stage" in result["detail"]


def test_bad_requests_are_typed(cheap_request: dict[str, Any]) -> None:
    assert run_worker({"schema": "nope"})["code"] == "bad-request"
    mixed = run_worker({**cheap_request, "sm": "sm_90"})
    assert mixed["code"] == "bad-request" and "disagree" in mixed["detail"]


def test_generated_sources_lose_compile_commands_and_sandbox_paths() -> None:
    from cgbuild_rules.mint import _strip_cpp

    cmds = "// Compile cmd\n// g++ /sb/a.cpp\n// Link cmd\n// g++ /sb/a.o\n"
    src = "// kernels in /sb/inductor/x.cpp\nint f();\n\n" + cmds
    warm = src + "\n" + cmds
    assert (
        _strip_cpp(src, "/sb")
        == _strip_cpp(warm, "/sb")
        == "// kernels in <sandbox>/inductor/x.cpp\nint f();\n"
    )
    code = "int g();\n// Compile cmd\nint h();\n"  # not a trailing comment block: left alone
    assert _strip_cpp(code, "/sb") == code


def test_compile_commands_must_carry_the_clamp() -> None:
    from cgbuild_rules.mint import MintFailure, _check_clamp

    _check_clamp("// g++ a.cpp -O3 -march=x86-64-v3 -mavx2", "x86-64-v3")
    with pytest.raises(MintFailure, match="clamp-not-applied"):
        _check_clamp("// g++ a.cpp -march=x86-64-v3\n// g++ w.cpp -march=native", "x86-64-v3")


def test_verification_compares_structure_dtype_nonfinite_and_tolerance() -> None:
    import torch
    from cgbuild_rules.mint import MintFailure, compare_outputs

    want = torch.randn(4, 8)
    (row,) = compare_outputs(want + 1e-7, want)
    assert row["output"] == 0 and row["rel_rms"] < 1e-5
    for got, needle in [
        (want * 1.01, "relative RMS error"),
        (want.double(), "vs eager"),
        (want[:2], "vs eager"),
        (torch.where(want > 0, float("nan"), want), "non-finite"),
        ((want, want), "structure"),
    ]:
        with pytest.raises(MintFailure, match=needle):
            compare_outputs(got, want)
    half = want.bfloat16()
    compare_outputs(half * 1.01, half)  # bf16 rounding noise is within its tolerance


def test_a_quant_rule_states_its_own_tolerance() -> None:
    """W8A8 is not bf16: fp8-rowwise verifies at 8% rel-rms where bf16 verifies at 5%, the stated
    value is sealed under verify.rule, and rules that state none keep the dtype's."""
    import torch
    from cgbuild_rules.mint import MintFailure, _rule_tolerance, compare_outputs

    want = torch.linspace(-2, 2, 64).bfloat16()
    off = want * 1.06  # 6% off: past bf16's 5%, within the fp8 rule's 8%
    with pytest.raises(MintFailure, match="relative RMS error"):
        compare_outputs(off, want)
    (row,) = compare_outputs(off, want, tolerance=_rule_tolerance("fp8-rowwise")["rule"])
    assert row["tolerance"] == 0.08
    with pytest.raises(MintFailure):
        compare_outputs(want * 1.09, want, tolerance="8e-2")
    assert _rule_tolerance("plain.bf16") == {} and _rule_tolerance("int8-rowwise") == {}
