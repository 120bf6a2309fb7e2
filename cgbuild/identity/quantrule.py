"""Quant rules: what a layout's bytes mean, and the sm and torch a rule needs.

A QUANT RULE is a versioned record whose convention facts are its identity: the digest covers the
facts alone, never the name or the version number, so renaming a rule or bumping its display
version moves nothing while changing what its bytes mean moves every key that uses it.

A rule may have a floor: the smallest sm whose hardware can run its matmul, and a capability
check of the toolchain's torch on that sm (`scaled_mm_rowwise`). Both are decided here, without
torch, so a plan says `blocked` before anything is traced or compiled; a mint on a real device
probes the kernel as well (`cgbuild_rules.quant.probe`). The torch side of every rule (the module
transform that produces the emitted tensors) lives in `cgbuild_rules.quant`, keyed by the same names.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from cgbuild.core.canon import digest
from cgbuild.core.codes import Code
from cgbuild.core.platform import device_of, sm_number

QUANT_SCHEME = "cgbuild.quant/2"


@dataclass(frozen=True)
class QuantRule:
    """One quant rule. `facts` is the whole identity; `name` and `version` are for display."""

    name: str
    version: int
    facts: dict[str, Any]

    @property
    def display(self) -> str:
        return f"{self.name}@{self.version}"

    @functools.cached_property
    def digest(self) -> str:
        return digest({"scheme": QUANT_SCHEME, "facts": self.facts})

    @property
    def compute(self) -> tuple[str, ...]:
        """Compute dtypes (torch names) the rule allows; the first is the default when it is the only one."""
        return tuple(self.facts["compute"])

    @property
    def dtype(self) -> str | None:
        """The compute dtype when the rule fixes it (plain rules), else None: the layout says."""
        return self.compute[0] if len(self.compute) == 1 else None

    @property
    def transforms(self) -> bool:
        """Whether the rule rewrites modules before the trace (every rule but `plain.*`): such a
        rule must have a transform in `cgbuild_rules.quant`, or it would key plain weights."""
        return bool(self.facts["eligible"] != "none")

    @property
    def compiled_only(self) -> bool:
        """The rule quantizes activations (W8A8): its module's eager path computes another thing."""
        return bool(self.facts["activations"] != "unquantized")

    @property
    def min_sm(self) -> str | None:
        return self.facts.get("min_sm")

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(self.facts["devices"])

    @property
    def lanes(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Lane axes the rule's own modules switch on: axis → value → needs (docs/lanes.md).

        They are facts: which kernels the rule may compile in is part of what its layout means.
        A family opts in by declaring the axis in `[family.<name>.lanes]`; only targets of a
        layout with this rule carry it.
        """
        return dict(self.facts.get("lanes") or {})

    @property
    def tolerance(self) -> str | None:
        """The verification tolerance (relative RMS, compiled vs eager of this rule), when the
        rule states one in place of the compute dtype's."""
        stated = self.facts.get("tolerance")
        return str(stated["rel_rms"]) if stated else None


def _plain(element: str, compute: str) -> dict[str, Any]:
    return {
        "element": element,
        "compute": [compute],
        "eligible": "none",
        "emits": [],
        "scale": "none",
        "packing": "none",
        "activations": "unquantized",
        "matmul": "as traced",
        "min_sm": None,
        "devices": ["cpu", "cuda"],
        "capability": None,
    }


# Both quantized rules quantize the same modules and emit the same two tensors per module; they
# differ in element type, in what happens to activations and in the matmul. Scales are fp32 in
# both: one scale per output row costs 4 bytes per row (nothing next to the row's `in` bytes),
# keeps a bf16 checkpoint's scales exact for an fp32 compute and is what torch._scaled_mm takes.
_ELIGIBLE = {"module": "torch.nn.Linear", "weight_rank": 2, "dims_multiple_of": 16}

INT8_ROWWISE: dict[str, Any] = {
    "element": "I8",
    "compute": ["float32", "bfloat16", "float16"],
    "eligible": _ELIGIBLE,
    "emits": [["{fqn}.weight", "I8", "[out, in]"], ["{fqn}.weight_scale", "F32", "[out]"]],
    "scale": {
        "dtype": "F32",
        "granularity": "per-output-row",
        "value": "absmax(row) / 127, floored at the smallest normal fp32",
        "zero_point": "none (symmetric)",
    },
    "rounding": "round half to even, clamp to [-127, 127]",
    "packing": "none (row-major, one byte per element)",
    "activations": "unquantized",
    "matmul": "dequantize in graph: "
    "linear(x, (weight.to(float32) * weight_scale[:, None]).to(compute), bias)",
    "min_sm": None,
    "devices": ["cpu", "cuda"],
    "capability": None,
}

FP8_ROWWISE: dict[str, Any] = {
    "element": "F8_E4M3",
    "compute": ["bfloat16"],
    "eligible": _ELIGIBLE,
    "emits": [["{fqn}.weight", "F8_E4M3", "[out, in]"], ["{fqn}.weight_scale", "F32", "[out]"]],
    "scale": {
        "dtype": "F32",
        "granularity": "per-output-row",
        "value": "absmax(row) / 448, floored at the smallest normal fp32",
        "zero_point": "none (symmetric)",
    },
    "rounding": "clamp to [-448, 448], then round to nearest float8_e4m3fn",
    "packing": "none (row-major, one byte per element)",
    "activations": "dynamic per row of x, in graph: fp32 scale absmax(row) / 448 floored at 1e-12, "
    "x clamped to [-448, 448] and cast to float8_e4m3fn",
    "matmul": "lane fp8-gemm: scaled-mm = torch._scaled_mm(x_fp8, weight.t(), scale_a=[M, 1], "
    "scale_b=weight_scale[None, :], out_dtype=compute) + bias; triton = one Triton GEMM "
    "(cgbuild::fp8_rowwise_linear_v1) that divides, clamps and casts x per row as it loads it, "
    "scales by both row scales and adds the bias in its epilogue; the same scales and rounding "
    "either way; no dequantize fallback",
    "min_sm": "sm_89",
    "devices": ["cuda"],
    "capability": "scaled_mm-rowwise",
    "lanes": {
        "fp8-gemm": {"scaled-mm": {}, "triton": {"device": "cuda", "triton": True, "min_sm": 89}},
    },
    # e4m3 keeps 3 mantissa bits: rounding x and w each costs ~3.6% rms per element, and the
    # measured klein-4B output is 5.2% (artifact) to 5.6% (eager) off fp32, 4.2% compiled vs
    # eager (docs/layouts.md). 8% clears that by ~2x; a wrong kernel (an unscaled operand, a
    # transposed weight) is off by 50% and more.
    "tolerance": {"metric": "rel-rms", "against": "eager of this rule, same lane", "rel_rms": "8e-2"},
}

QUANT_RULES: dict[str, QuantRule] = {
    r.name: r
    for r in (
        QuantRule("plain.bf16", 1, _plain("BF16", "bfloat16")),
        QuantRule("plain.fp16", 1, _plain("F16", "float16")),
        QuantRule("plain.fp32", 1, _plain("F32", "float32")),
        QuantRule("int8-rowwise", 1, INT8_ROWWISE),
        QuantRule("fp8-rowwise", 1, FP8_ROWWISE),
    )
}


def compute_dtype(rule: QuantRule, declared: str | None) -> str:
    """The compute dtype of a layout: the rule's own, or the declared one if the rule allows it.

    Raises ValueError with a sentence for the Cgfile error.
    """
    allowed = rule.compute
    if declared is None:
        if rule.dtype is None:
            raise ValueError(
                f"quant rule '{rule.name}' computes in {' or '.join(allowed)}: declare the layout's dtype"
            )
        return rule.dtype
    if declared not in allowed:
        raise ValueError(f"quant rule '{rule.name}' computes in {' or '.join(allowed)}, not {declared}")
    return declared


# ---- floors: the sm a rule needs, and what the toolchain's torch can run there --------------------
# First torch release whose CUDA build runs torch._scaled_mm with row-wise scales on an sm, from
# torch's own history: a CUTLASS row-wise kernel for sm_90 (2024, torch 2.5); built for sm_89 from
# torch 2.7 but launched on the wrong stream until 2.12 (hangs when called from a side stream:
# AOTInductor calls on the caller's stream, so older torch is refused on sm_89); sm_100 builds
# from 2.8 and sm_120 from 2.9. Unlisted sms are refused: fail toward `blocked`, never toward a
# mint that cannot run. A mint on a device also probes the kernel itself.
SCALED_MM_ROWWISE_FIRST_TORCH: dict[int, tuple[int, int]] = {
    89: (2, 12),
    90: (2, 5),
    100: (2, 8),
    120: (2, 9),
}
_VERSION = re.compile(r"^(\d+)\.(\d+)")


def torch_release(version: str) -> tuple[int, int] | None:
    m = _VERSION.match(version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def scaled_mm_rowwise(torch_version: str, sm: str) -> tuple[bool, str]:
    """Can this torch run row-wise-scaled fp8 `torch._scaled_mm` on this sm? A pure function of the
    two facts, so a plan on a machine without a GPU answers it; (supported, why)."""
    number = sm_number(sm)
    release = torch_release(torch_version)
    if number is None:
        return False, f"row-wise scaled_mm is a CUDA kernel; {sm} is not a CUDA architecture"
    if release is None:
        return False, f"cannot read a torch release from {torch_version!r}"
    first = SCALED_MM_ROWWISE_FIRST_TORCH.get(number)
    if first is None:
        known = ", ".join(f"sm_{n}" for n in sorted(SCALED_MM_ROWWISE_FIRST_TORCH))
        return False, f"no record of a row-wise scaled_mm kernel for {sm} (known: {known})"
    if release < first:
        return False, (
            f"torch {torch_version} has no usable row-wise scaled_mm on {sm} "
            f"(first usable: torch {first[0]}.{first[1]})"
        )
    return True, f"torch {torch_version} runs row-wise scaled_mm on {sm}"


CAPABILITIES = {"scaled_mm-rowwise": scaled_mm_rowwise}


def floor_refusal(rule: QuantRule, sm: str, torch_version: str | None) -> tuple[Code, str] | None:
    """(reason code, detail) when a target of this rule on this sm must not be minted, else None.

    `layout-below-sm-floor`: the device kind or the sm is below what the rule's matmul needs (a
    fact of the rule). `layout-toolchain-unsupported`: the sm is high enough but the toolchain's
    torch has no kernel for it there. An unknown torch decides nothing here (the graph is
    unknown then anyway, and a mint probes the device).
    """
    device = device_of(sm)
    if device not in rule.devices:
        return Code.LAYOUT_BELOW_SM_FLOOR, (
            f"{rule.display} runs only on {' and '.join(rule.devices)}; {sm} targets are never minted"
        )
    floor = rule.min_sm
    number, need = sm_number(sm), sm_number(floor) if floor else None
    if need is not None and number is not None and number < need:
        return Code.LAYOUT_BELOW_SM_FLOOR, f"{rule.display} needs {floor} or newer; {sm} is below its floor"
    check = CAPABILITIES.get(rule.facts.get("capability") or "")
    if check is not None and torch_version is not None:
        ok, why = check(torch_version, sm)
        if not ok:
            return Code.LAYOUT_TOOLCHAIN_UNSUPPORTED, f"{rule.display}: {why}"
    return None
