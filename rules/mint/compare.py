"""Compiled outputs against eager: relative RMS error under a per-dtype tolerance, or the quant
rule's own (identity blocks hold no floats: tolerances are text).
"""

from __future__ import annotations

from typing import Any

from cgbuild_rules.mint.failure import MintFailure

from cgbuild.core.codes import Code
from cgbuild.identity.quantrule import QUANT_RULES

# Relative RMS error allowed against eager, by output dtype (as text: identity blocks hold no
# floats). fp32 compiles measured ~1e-7; klein-4B bf16 measured 2.3% from rounding alone.
TOLERANCE = {"float32": "1e-4", "float64": "1e-9", "float16": "1e-2", "bfloat16": "5e-2"}


def _rel_rms(got: Any, want: Any) -> float:

    diff = (got.double() - want.double()).pow(2).mean().sqrt()
    return float(diff / want.double().pow(2).mean().sqrt().clamp_min(1e-30))


def rule_tolerance(quant: str) -> dict[str, str]:
    """{"rule": tolerance} when the layout's quant rule states its own (fp8-rowwise), else {}."""
    stated = tolerance_of(quant)
    return {"rule": stated} if stated else {}


def compare_outputs(got: Any, want: Any, tolerance: str | None = None) -> list[dict[str, Any]]:
    """Compiled vs eager, leaf by leaf: same structure, dtype, shape and non-finite pattern, and a
    relative RMS error within the output dtype's tolerance, or within `tolerance` where the
    layout's quant rule states one (W8A8 is not bf16); raises `verify-mismatch` otherwise."""
    import torch
    from torch.utils import _pytree as pytree

    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(want)
    if got_spec != want_spec:
        raise MintFailure(Code.VERIFY_MISMATCH, f"output structure {got_spec} differs from eager {want_spec}")
    errors = []
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves, strict=True)):
        if not isinstance(w, torch.Tensor):
            continue
        if g.shape != w.shape or g.dtype != w.dtype:
            raise MintFailure(
                Code.VERIFY_MISMATCH,
                f"output {i}: {g.dtype}{list(g.shape)} vs eager {w.dtype}{list(w.shape)}",
            )
        tol = float(tolerance or TOLERANCE.get(str(w.dtype).removeprefix("torch."), "1e-2"))
        finite = torch.isfinite(w)
        if not torch.equal(torch.isfinite(g), finite):
            raise MintFailure(Code.VERIFY_MISMATCH, f"output {i}: non-finite values differ from eager")
        err = _rel_rms(g[finite], w[finite]) if finite.any() else 0.0
        if err > tol:
            raise MintFailure(
                Code.VERIFY_MISMATCH, f"output {i}: relative RMS error {err:.3g} > {tol:g} ({w.dtype})"
            )
        errors.append(
            {
                "output": i,
                "dtype": str(w.dtype).removeprefix("torch."),
                "rel_rms": err,
                "tolerance": tol,
                "max_abs": float((g - w).abs().max()) if g.numel() else 0.0,
            }
        )
    return errors


def tolerance_of(quant: str) -> str | None:
    """The tolerance the layout's quant rule states, or None (the compute dtype's applies)."""
    return QUANT_RULES[quant].tolerance
