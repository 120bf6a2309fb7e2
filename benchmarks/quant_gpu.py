"""Quant rules on a real GPU: the capability probe, numerics and speed of int8-rowwise and
fp8-rowwise against plain bf16, eager and through AOTInductor.

Run on a machine with a CUDA device, from a checkout (no install needed):

    python benchmarks/quant_gpu.py --out benchmarks/results/quant_gpu.json [--commit SHA]

What it answers:
- does the plan's pure capability function (`quantrule.scaled_mm_rowwise`, torch version × sm)
  agree with the real probe the mint runs (`cgbuild_rules.quant.probe`) on this device;
- how far each rule's output is from plain bf16 on a klein-shaped MLP block (3072 → 9216 → 3072,
  4608 tokens = 1024x1024 image + 512 text), and from an fp32 reference;
- eager and AOTInductor-compiled step times (3 warm-ups, median of 9 timed calls, CUDA events)
  and the weight bytes each layout holds.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
try:
    import cgbuild_rules  # noqa: F401
except ImportError:  # a bare checkout: the rules folder is the package
    spec = importlib.util.spec_from_file_location(
        "cgbuild_rules", ROOT / "rules" / "__init__.py", submodule_search_locations=[str(ROOT / "rules")]
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["cgbuild_rules"] = module
    spec.loader.exec_module(module)

import torch  # noqa: E402
from cgbuild_rules.quant import convert, probe  # noqa: E402
from harness import PhaseClock, commit_option, cuda_timed, write_result  # noqa: E402
from torch import nn  # noqa: E402

from cgbuild.core.platform import normalize_arch  # noqa: E402
from cgbuild.identity import compiler, policy  # noqa: E402
from cgbuild.identity.quantrule import QUANT_RULES, floor_refusal, scaled_mm_rowwise  # noqa: E402

HIDDEN, MLP, TOKENS = 3072, 9216, 4608


def rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    d = (got.double() - want.double()).pow(2).mean().sqrt()
    return float(d / want.double().pow(2).mean().sqrt())


def step_ms(fn: Any, x: torch.Tensor) -> float:
    """Median milliseconds of 9 calls after 3 warm-ups, timed with CUDA events."""
    with torch.no_grad():
        return round(cuda_timed(lambda: fn(x), reps=9, warmup=3) * 1e3, 4)


def weight_bytes(m: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in m.state_dict().values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--no-compile", action="store_true")
    commit_option(parser)
    args = parser.parse_args()
    dev = torch.device("cuda")
    result = _planned(dev)
    print(json.dumps(result, indent=1), flush=True)

    torch.manual_seed(0)
    ref32 = nn.Sequential(nn.Linear(HIDDEN, MLP), nn.GELU(approximate="tanh"), nn.Linear(MLP, HIDDEN)).to(dev)
    x = torch.randn(1, TOKENS, HIDDEN, device=dev)
    plain = copy.deepcopy(ref32).to(torch.bfloat16).eval()
    models = {"plain.bf16": plain}
    for name in ("int8-rowwise", "fp8-rowwise"):
        models[name] = convert(copy.deepcopy(plain), name, torch.bfloat16)[0].eval()
    xb = x.to(torch.bfloat16)
    with torch.no_grad():
        want32 = ref32(x)
        outs = {name: m(xb) for name, m in models.items()}
    rows: dict[str, Any] = {}
    for name, m in models.items():
        rows[name] = {
            "weight_bytes": weight_bytes(m),
            "rel_rms_vs_plain_bf16": rel_rms(outs[name], outs["plain.bf16"]),
            "rel_rms_vs_fp32": rel_rms(outs[name], want32),
            "eager_ms": step_ms(m, xb),
        }
        print(name, rows[name], flush=True)
    if not args.no_compile:
        configs = _mint_configs(result)
        for name, m in models.items():
            rows[name] |= _compiled(m, xb, outs[name], configs)
            print(name, rows[name], flush=True)
    result["layouts"] = rows
    write_result(args.out, "quant_gpu", result, torch=True, commit=args.commit)
    return 0


def _planned(dev: torch.device) -> dict[str, Any]:
    """What the plan decides on this GPU (the rowwise capability, each layout's floor) and what the
    mint's probe finds, with its seconds."""
    major, minor = torch.cuda.get_device_capability(dev)
    sm = f"sm_{major}{minor}"
    result: dict[str, Any] = {
        "shape": {"tokens": TOKENS, "hidden": HIDDEN, "mlp": MLP, "dtype": "bfloat16"},
    }
    ok, why = scaled_mm_rowwise(torch.__version__, sm)
    result["plan_capability"] = {"supported": ok, "why": why}
    result["plan_floor"] = {
        name: floor_refusal(QUANT_RULES[name], sm, torch.__version__)
        for name in ("int8-rowwise", "fp8-rowwise")
    }
    result["mint_probe"] = {}
    for name in ("int8-rowwise", "fp8-rowwise"):
        row: dict[str, Any] = {}
        with PhaseClock(row).phase("seconds"):
            p_ok, p_why = probe(name, dev)
        result["mint_probe"][name] = {"ok": p_ok, "detail": p_why, **row}
    return result


def _mint_configs(result: dict[str, Any]) -> dict[str, Any]:
    """The mint's compile policy and host compiler (never $CXX: on this image a foreign compiler's
    wrapper .so segfaults at load); a knob this torch lacks is named in `result`."""
    configs: dict[str, Any] = {}
    for knob, value in policy.inductor_configs(normalize_arch(platform.machine())).items():
        try:
            torch._inductor.config.__getattr__(knob)
            configs[knob] = value
        except AttributeError:  # an older torch lacks a knob (e.g. cpp.march): say so
            result.setdefault("policy_knobs_missing", []).append(knob)
    configs["cpp.cxx"] = (None, compiler.choose_cxx())
    return configs


def _compiled(m: nn.Module, xb: torch.Tensor, eager: torch.Tensor, configs: dict[str, Any]) -> dict[str, Any]:
    """`m` exported and compiled, loaded through the C++ loader and bound to the module's own
    tensors, as adopt does: compile seconds, error against eager, step time, the scaled matmul."""
    from cgbuild_rules.loader import Package

    row: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        with PhaseClock(row, digits=1).phase("export_and_compile_s"):
            ep = torch.export.export(m, (xb,))
            pt2 = torch._inductor.aoti_compile_and_package(
                ep, package_path=str(Path(tmp) / "model.pt2"), inductor_configs=configs
            )
        loaded = Package(pt2, device_index=0)
        live = {**dict(m.named_parameters()), **dict(m.named_buffers())}
        loaded.bind({fqn: live[fqn] for fqn in loaded.constant_fqns})
        with torch.no_grad():
            got = loaded(xb)
        return row | {
            "compiled_rel_rms_vs_eager": rel_rms(got, eager),
            "compiled_ms": step_ms(loaded, xb),
            "scaled_mm_in_graph": "_scaled_mm" in str(ep.graph),
        }


if __name__ == "__main__":
    sys.exit(main())
