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
    (`old`/`new` of a drift, a `signal`)."""

    def __init__(self, code: Code, detail: str, **extra: Any) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = Code(code)  # a stage's code read back: an unregistered one is `mint-error`
        self.detail = detail
        self.extra = extra

    def result(self, job_id: str | None, phase: Phase) -> MintFailed:
        return MintFailed(self.code, phase, self.detail, self.extra, job_id)
