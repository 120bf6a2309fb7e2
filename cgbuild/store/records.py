"""What the store answers with: a ref, an admission, a resolved artifact, a verdict, a gc report."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from cgbuild.store.refs import REF_SCHEMA


@dataclass(frozen=True)
class Ref:
    """One key's entry: which object holds its artifact, and a small summary for listings."""

    key: str
    object: str
    size: int
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": REF_SCHEMA,
            "key": self.key,
            "object": self.object,
            "size": self.size,
            "metadata": self.metadata,
        }


@dataclass(frozen=True)
class Admission:
    """Typed outcome of `admit`: `admitted` (this call created the ref), `already` (the key holds
    this very object), `conflict` (the key holds a different object, which stands)."""

    status: Literal["admitted", "already", "conflict"]
    key: str
    object: str
    size: int
    existing: str | None = None  # the standing object, on conflict

    @property
    def ok(self) -> bool:
        return self.status != "conflict"


@dataclass(frozen=True)
class Resolved:
    """A key's artifact, found and (when asked) re-hashed: `path` is the read-only object file."""

    ref: Ref
    path: Path


@dataclass(frozen=True)
class Verdict:
    """Result of verifying one key: `ok`, or why not (`missing`, `quarantined`, `corrupt`)."""

    key: str
    status: str
    """`ok`, `missing`, `quarantined`, `corrupt`, `malformed-ref`, or (from `check_sealed_key`)
    `key-mismatch` and the seal's refusal codes."""
    detail: str = ""


@dataclass
class GCReport:
    """What gc removed (or, with dry_run, would remove)."""

    dry_run: bool
    refs_dropped: list[str] = field(default_factory=list)
    objects_removed: list[str] = field(default_factory=list)
    bytes_freed: int = 0
    temps_removed: int = 0
    objects_kept: int = 0
    evidence_removed: list[str] = field(default_factory=list)
    """Keys whose lane evidence went: no ref and no quarantine record names them any more."""
    refs_quarantined: list[str] = field(default_factory=list)
    """Keys whose ref was malformed or named another key's artifact: quarantined with the
    reason, never a root."""
