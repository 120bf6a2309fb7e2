"""benchmarks/profile_gpu.py end to end on a CPU label: a minted toy lanes artifact adopted,
stepped under the profiler, the ATen ops it dispatches grouped, its host syncs counted (none:
the lane switch branches on the selector's size); and its name → group rule on the kernel names
an H200 step runs, first match winning where a name fits two groups."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from support.cli import cli
from support.toy import copy_toy

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
LABEL = "//toy/mlp/8x64-b1@fp32:cpu"


def _bench() -> ModuleType:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))  # its own imports (harness, targets) are siblings
    spec = importlib.util.spec_from_file_location("profile_gpu", BENCH / "profile_gpu.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("name", "group"),
    [
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128", "attention"),
        ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "attention"),  # names cutlass too
        ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention"),
        ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128", "GEMM"),  # names e4m3 too
        ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN", "GEMM"),
        ("fused_0", "GEMM"),  # the fp8-gemm lane's Triton kernel
        ("aten::addmm", "GEMM"),
        ("triton_red_fused__to_copy_abs_amax_clamp_div_0", "act-quant"),  # names copy, a reduction
        ("triton_per_fused_native_layer_norm_1", "other reductions"),
        ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>", "other reductions"),
        ("triton_poi_fused_ne_select_2", "pointwise"),
        ("Memcpy DtoH (Device -> Pinned)", "copies"),
        ("aten::copy_", "copies"),
        ("aten::gelu", "pointwise"),
        ("aten::as_strided", "other"),  # a view: no kernel
        ("some_other_kernel", "other"),
    ],
)
def test_the_committed_rule_names_each_kernel_into_its_group(name: str, group: str) -> None:
    assert _bench().group_of(name) == group


@pytest.mark.slow
def test_a_cpu_label_is_profiled_end_to_end_with_no_host_sync(tmp_path: Path, toy_reference: Path) -> None:
    ws = copy_toy(tmp_path / "toy", toy_reference)
    minted = cli(ws, "mint", LABEL, "--json")
    assert minted.returncode == 0, minted.stderr[-3000:]
    out = tmp_path / "profile.json"
    argv = [str(out), "--workspace", str(ws), "--label", LABEL, "--steps", "2", "--reps", "3"]
    proc = subprocess.run(
        [sys.executable, str(BENCH / "profile_gpu.py"), *argv],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "profile_gpu" and {"date", "machine", "versions"} <= set(doc)
    (run,) = doc["runs"]
    assert "error" not in run, run.get("error")
    assert run["device"] == "cpu" and run["lane"]["lane"] in ("baseline", "chunked")
    assert run["counters"] == {"compiled": 3 + 3 + 2}  # warm-ups, timed calls, profiled steps
    assert run["wall_ms"] > 0 and run["kernel_ms"] >= 0
    groups = {group for _, group in _bench().GROUPS} | {"other"}
    assert set(run["groups_ms"]) <= groups and {row[1] for row in run["top"]} <= groups
    assert run["dtoh_copies"] == 0 and set(run["host_reads"].values()) == {0}
    assert set(run["sync_calls"].values()) == {0}
    assert all(len(row) == 4 for row in run["top"])  # name, group, ms and calls per step
