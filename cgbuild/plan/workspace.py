"""The workspace: a loaded Cgfile and the toolchain lock named on the command line.

Kept apart from the planner so that what only needs the workspace (a plan served from its memo,
the commands that read the store) does not import the planner's machinery.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from cgbuild.config.cgfile import Cgfile
from cgbuild.core import statefile

if TYPE_CHECKING:
    from cgbuild.store.backend import Backend
    from cgbuild.store.local import Store
    from cgbuild.store.shared import SharedStore


@dataclass(frozen=True)
class StateDir:
    """Every path in a workspace's state folder, named here once: the planner, the memo, the
    executors, `gc` and `inspect` all find a file by asking for it, never by joining names."""

    root: Path

    @property
    def mints(self) -> Path:
        """Each key's mint record and logs."""
        return self.root / "mint"

    def record(self, key: str) -> Path:
        return self.mints / f"{key}.json"

    def read_record(self, key: str) -> dict[str, Any] | None:
        """A key's mint record, None when none was written here. Nothing rebuilds a record, so
        one that cannot be read is refused by name rather than set aside."""
        doc = statefile.read_json(self.record(key), _is_record, "mint record", fix=RECORD_FIX)
        return cast(dict[str, Any] | None, doc)

    def log(self, key: str, what: str = "") -> Path:
        """A key's worker log (`what`: `check` for a `mint --check` re-mint)."""
        return self.mints / f"{key}{'.' + what if what else ''}.log"

    @property
    def build(self) -> Path:
        """Where workers seal `<key>.tar.gz` before admission, and keep their work folders."""
        return self.root / "build"

    @property
    def cache(self) -> Path:
        return self.root / "cache"

    @property
    def plans(self) -> Path:
        """The plan memo's entries."""
        return self.cache / "plans"

    @property
    def remotes(self) -> Path:
        """Each shared store's passed capability probe, by endpoint, bucket and prefix (a file per
        store, `cgbuild.store.s3.Remote.probe`): a mint need not probe a store again within the hour."""
        return self.cache / "remotes"

    @property
    def last_plan(self) -> Path:
        return self.root / "last-plan.json"

    @property
    def traces(self) -> Path:
        return self.root / "traces.sqlite"

    def unwritable(self) -> str | None:
        """Why this user cannot write the state folder (created here when absent), or None.
        Every command but `query` writes it (a cache, the last plan, a record): probed once, by
        creating and removing a file, so a folder that refuses writes is named at the start
        instead of failing a plan or a mint half-way."""
        probe = self.root / f".write-probe-{os.getpid()}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
            os.unlink(probe)
        except OSError as exc:
            return f"{exc.filename or self.root}: {exc.strerror}"
        return None

    def planned_from(self) -> list[Path]:
        """The state files a plan reads (its memo's inputs): the last plan and the trace cache."""
        return [self.last_plan, self.traces, self.traces.with_name(self.traces.name + "-wal")]


RECORD_FIX = (
    "remove it (it is this machine's account of the key's mint: the artifact in the store does not "
    "depend on it, and the key's next mint writes it again)"
)


def _is_record(doc: Any) -> bool:
    """The fields of a mint record its readers use (`inspect`, `gc`, the fleet) have their types."""
    if not isinstance(doc, dict):
        return False
    labels, result = doc.get("labels") or [], doc.get("result") or {}
    return (
        isinstance(labels, list)
        and all(isinstance(label, str) for label in labels)
        and isinstance(doc.get("state") or "", str)
        and isinstance(result, dict)
        and isinstance(result.get("phases") or {}, dict)
    )


@dataclass
class Workspace:
    cg: Cgfile
    toolchain_lock: str | None = None

    @property
    def state(self) -> StateDir:
        return StateDir(self.cg.state_dir)

    def store(self) -> Store:
        from cgbuild.store.local import Store

        return Store(self.cg.store_dir)

    def writable_store(self) -> Store:
        """The local store, proven writable: one this user cannot lay out or lock is refused
        (exit 2) naming the Cgfile field that put it there, and what to do."""
        from cgbuild.store.errors import StoreError

        store = self.store()
        try:
            store.prove_writable()
        except StoreError as e:
            raise self.cg.error(e.detail, "workspace", self.cg.store_field) from None
        return store

    @functools.cached_property
    def remote(self) -> Backend | None:
        """The declared shared store's S3 side (one client per workspace), or None."""
        if not self.cg.remote:
            return None
        from cgbuild.store.backend import open_backend

        return open_backend(self.cg.remote)

    def shared(self, local: Store | None = None) -> SharedStore | None:
        """The local store (`local`, or the workspace's) as a cache in front of the declared
        remote, with the workspace's trusted keys; None when no remote is declared, so a
        workspace without one never imports boto3 or cryptography."""
        if self.remote is None:
            return None
        from cgbuild.core.platform import host_name
        from cgbuild.store.shared import SharedStore

        return SharedStore(
            local or self.store(), self.remote, self.cg.trusted, host_name(), self.state.remotes
        )

    def require_shared(self, why: str) -> SharedStore:
        """The shared store, for a command that means nothing without one (bad input: exit 2)."""
        shared = self.shared()
        if shared is None:
            raise self.cg.error(why, "workspace", "remote")
        return shared
