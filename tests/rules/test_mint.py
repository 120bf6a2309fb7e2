"""The mint worker, with real AOTInductor compiles of a tiny MLP on the CPU.

Compiles are the expensive part (tens of seconds each on a 2-core box), so a test session makes
exactly three: `minted("A")` (a static class with a trace-baked literal), `minted("B")` (a
dynamic-batch class, for routing in test_adopt) and the double mint of A in a fresh sandbox.
`minted` (support/minted.py) is memoised for the session, so every module adopting from them
shares the same artifacts.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from support.minted import ANNOUNCED, ENTRY, job_for, minted, request_for, run_worker, session_dirs

from cgbuild.identity import toolchain
from cgbuild.protocol.mint import Phase
from cgbuild.store.seal import read_metadata, unseal


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
    assert {"compile", "verify", "seal", "serve"} <= set(announced)


@pytest.mark.slow
def test_mint_seals_a_verified_artifact(
    mint_a: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path
) -> None:
    req, result = mint_a
    print("\nmint phases (s):", json.dumps(result["phases"]), "artifact bytes:", result["size"])
    assert result["key"] == req["key"] and Path(result["artifact"]).name == f"{req['key']}.tar.gz"
    assert set(result["phases"]) == {"export", "compile", "verify", "seal", "serve", "total"}
    assert result["served"] == [{"counters": {"compiled": 1}, "seconds": result["served"][0]["seconds"]}]
    assert result["verify"][0]["rel_rms"] < 1e-5
    assert result["device"] == {"type": "cpu", "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}
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
    assert "visible" not in text  # nor the device it was verified on
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
        {**req, "id": "again", "out": str(tmp_path), "empty_sandbox": True, "compare_with": first["artifact"]}
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
    pinned = {**os.environ, "CUDA_VISIBLE_DEVICES": "3"}  # as a fleet node pins a CUDA key's mint
    result = run_worker({**cheap_request, "job": job, "sm": "sm_90", "toolchain": tc}, env=pinned)
    assert result["code"] == "wrong-device" and result["needed"] == "sm_90" and "sm_90" in result["detail"]
    assert result["retryable"] is False
    # the stage that refused it ran under the pinned devices (the mint environment keeps them)
    assert result["visible"] == "3" and "(CUDA_VISIBLE_DEVICES='3')" in result["detail"]


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

    from cgbuild_rules.mint import MintFailure
    from cgbuild_rules.mint.stages import Stage

    from cgbuild.protocol import spawn
    from cgbuild.protocol.stage import Verified

    monkeypatch.setattr(spawn, "_stopping", True)  # what stop_children() leaves behind
    started = time.monotonic()
    stage = Stage("check", stage_start(tmp_path), os.environ, timeout_s=600, log=tmp_path / "check.log")
    with pytest.raises(MintFailure) as failed:
        stage.part(Verified)
    assert failed.value.code == "worker-killed" and "verify stage did not start" in failed.value.detail
    assert time.monotonic() - started < 60 and stage.pid is None


def stage_start(work: Path) -> Any:
    """A check stage's start line for the tiny MLP's job, working in `work`."""
    from cgbuild.protocol.stage import StageEnv, StageStart
    from cgbuild.protocol.trace import TraceJob

    root = work / "entry"
    root.mkdir()
    (root / "tiny_entry.py").write_text(ENTRY)
    return StageStart(TraceJob.from_json(job_for(root, "A")), StageEnv(str(work)))


def test_a_stage_that_dies_before_its_go_fails_the_part_waiting_on_it_with_its_phase(tmp_path: Path) -> None:
    """The check stage is killed while it builds the module, before the worker hands it the
    verify go: the part's wait ends at the stage's death (no timeout, no hang), typed as the
    verify phase's `worker-killed`."""
    import os
    import time

    from cgbuild_rules.mint import MintFailure
    from cgbuild_rules.mint.stages import Stage

    from cgbuild.protocol.stage import Verified

    env = {**os.environ, "CGBUILD_MINT_FAULT": "check:SIGKILL"}
    started = time.monotonic()
    stage = Stage("check", stage_start(tmp_path), env, timeout_s=600, log=tmp_path / "check.log")
    with pytest.raises(MintFailure) as failed:
        stage.part(Verified)
    result = failed.value.result("k", Phase.VERIFY).to_json()
    assert result["code"] == "worker-killed" and result["phase"] == "verify" and result["signal"] == "SIGKILL"
    assert "verify stage killed by SIGKILL" in result["detail"]
    assert time.monotonic() - started < 60
    with pytest.raises(MintFailure, match="worker-killed"):  # it stays ended for a later part
        stage.part(Verified)


def test_a_stage_answer_that_is_no_result_is_refused_by_name(cheap_request: dict[str, Any]) -> None:
    """The compile stage answers its trace with a line that is not a `Traced`: the mint ends as
    `mint-error` naming the part and what is wrong, not with a traceback or a dict passed on."""
    import os

    result = run_worker(cheap_request, env={**os.environ, "CGBUILD_MINT_FAULT": "trace:garble"})
    assert result["ok"] is False and result["code"] == "mint-error" and result["phase"] == "compile"
    assert result["detail"].startswith("the compile stage answered no trace result: the trace result:")
    assert "Traceback" not in result["detail"]


@pytest.mark.parametrize(("part", "phase"), [("verify", "verify"), ("serve", "serve")])
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
    from cgbuild_rules.mint.package import _strip_cpp

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
    from cgbuild_rules.mint import MintFailure
    from cgbuild_rules.mint.package import _check_clamp

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
    from cgbuild_rules.mint import MintFailure, compare_outputs
    from cgbuild_rules.mint.compare import rule_tolerance

    want = torch.linspace(-2, 2, 64).bfloat16()
    off = want * 1.06  # 6% off: past bf16's 5%, within the fp8 rule's 8%
    with pytest.raises(MintFailure, match="relative RMS error"):
        compare_outputs(off, want)
    (row,) = compare_outputs(off, want, tolerance=rule_tolerance("fp8-rowwise")["rule"])
    assert row["tolerance"] == 0.08
    with pytest.raises(MintFailure):
        compare_outputs(want * 1.09, want, tolerance="8e-2")
    assert rule_tolerance("plain.bf16") == {} and rule_tolerance("int8-rowwise") == {}
