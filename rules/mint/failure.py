"""The typed failure of a mint, raised where it is found in any room and answered as the
worker's `MintFailed` (`cgbuild.protocol.mint`).
"""

from __future__ import annotations

from typing import Any

from cgbuild.core.codes import Code
from cgbuild.protocol.mint import (
    MintFailed,
    Phase,
)


class MintFailure(Exception):
    """A typed mint failure raised where it is found; `extra` carries the facts its code names
    (`old`/`new` of a drift, a `signal`); `phase` is the one a stage reported it in (None: the
    phase the worker is in)."""

    def __init__(self, code: Code, detail: str, *, phase: Phase | None = None, **extra: Any) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = Code(code)
        self.detail = detail
        self.phase = phase
        self.extra = extra

    def result(self, job_id: str | None, phase: Phase) -> MintFailed:
        return MintFailed(self.code, self.phase or phase, self.detail, self.extra, job_id)
