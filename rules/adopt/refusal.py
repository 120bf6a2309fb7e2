"""Why an artifact, or one call, is served eager: a stable code and a sentence; the codes a
re-bind may clear; the error `strict` raises.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from cgbuild.core.codes import Code

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
