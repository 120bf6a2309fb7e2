"""The workspace: a loaded Cgfile and the toolchain lock named on the command line.

Kept apart from the planner so that what only needs the workspace (a plan served from its memo,
the commands that read the store) does not import the planner's machinery.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cgbuild.config.cgfile import Cgfile

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

    def planned_from(self) -> list[Path]:
        """The state files a plan reads (its memo's inputs): the last plan and the trace cache."""
        return [self.last_plan, self.traces, self.traces.with_name(self.traces.name + "-wal")]


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
        from cgbuild.core.errors import UserError

        shared = self.shared()
        if shared is None:
            raise UserError(why, file=str(self.cg.path), field="workspace.remote")
        return shared
