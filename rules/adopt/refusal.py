"""Why an artifact, or one call, is served eager: a stable code and a sentence; the codes a
re-bind may clear; the error `strict` raises.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from cgbuild.core.codes import RETRYABLE, Code

log = logging.getLogger("cgbuild.adopt")


class AdoptRefused(RuntimeError):
    """Raised only with `strict=True`: the artifact cannot serve on this host or for this module."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(f"{refusal.code}: {refusal.detail}")
        self.refusal = refusal


@dataclass(frozen=True)
class Refusal:
    """Why an artifact (or one call) is served eager: a stable `code` and a sentence."""

    code: Code
    detail: str


class CompiledRequired(AdoptRefused):
    """A call to a compiled-only module (its layout's rule quantizes activations, so its eager
    module computes something else, or cannot run here) that no armed artifact serves: raised
    before any kernel of the module runs, never served eager. `label` names the module served,
    `reason` why no artifact took the call; retryable (another worker, another bucket may)."""

    code = Code.COMPILED_REQUIRED

    @property
    def retryable(self) -> bool:
        return self.code in RETRYABLE

    def __init__(self, label: str, reason: Refusal) -> None:
        RuntimeError.__init__(
            self, f"{Code.COMPILED_REQUIRED}: {label} is compiled-only: {reason.code}: {reason.detail}"
        )
        self.refusal = reason
        self.label = label
        self.reason = reason


REARMABLE = frozenset(
    {
        Code.MODULE_CHANGED,
        Code.CONFIG_DRIFT,
        Code.LAYOUT_MISMATCH,
        Code.WEIGHTS_MISSING,
        Code.WEIGHTS_MISMATCH,
        Code.WEIGHTS_UNTIED,
        Code.LITERAL_MISMATCH,
    }
)
"""Refusals for what the live module holds: `rebind()` (or, once the package is loaded, the
next call after the module moves) re-arms the artifact when the module matches it again."""
