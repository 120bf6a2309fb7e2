"""Family inputs: the digest of what a family's code is made of, for over-keyed trace inputs.

Source files are hashed by content, with each file's digest cached on (mtime_ns, size, inode) so a
warm plan reads no source it has read before.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cgbuild.config.cgfile import Cgfile, Family
from cgbuild.core import fs, statefile
from cgbuild.core.canon import digest, hexfloats
from cgbuild.core.entry import entry_files


def _valid_cache(doc: Any) -> bool:
    """path → [mtime_ns, size, inode, sha256]."""
    return isinstance(doc, dict) and all(
        isinstance(v, list)
        and len(v) == 4
        and all(isinstance(x, int) for x in v[:3])
        and isinstance(v[3], str)
        for v in doc.values()
    )


def family_files(cg: Cgfile, fam: Family) -> set[Path]:
    """The files a family's code is made of: its `sources` globs and its entry's own module files
    (always, globs or not: a missed input is a wrong key). The trace-input digest hashes them and
    the plan memo stats them: one list, so the two cannot disagree."""
    files: set[Path] = set()
    for pattern in fam.sources:
        files.update(p for p in cg.root.glob(pattern) if p.is_file())
    files.update(entry_files(cg.root, fam.entry))
    return files


@dataclass(frozen=True)
class FamilyInputs:
    """A family's trace inputs as read once: the record its digest is computed from is the
    snapshot a later plan names moves from, so a move is never keyed without being named."""

    entry: str
    config: Mapping[str, Any]
    lanes: list[list[Any]]
    files: dict[str, str]
    """relative path → sha256"""

    @functools.cached_property
    def digest(self) -> str:
        """Over entry, config (floats exact) and files; lanes key through the snapshot's id."""
        return digest({"entry": self.entry, "config": hexfloats(self.config), "files": self.files})

    @property
    def snapshot(self) -> dict[str, Any]:
        return {"entry": self.entry, "config": self.config, "lanes": self.lanes, "files": self.files}

    @property
    def id(self) -> str:
        """The snapshot's name in a recorded plan."""
        return digest([self.digest, self.lanes])[:16]


class SourceHasher:
    def __init__(self, cache: Path) -> None:
        self._cache_path = cache
        self._cache: dict[str, list[Any]] = (
            statefile.read_json(cache, _valid_cache, "source digest cache") or {}
        )
        self._dirty = False

    def file_digest(self, path: Path) -> str:
        stamp = fs.stat_stamp(path)
        if stamp is None:
            raise FileNotFoundError(path)
        hit = self._cache.get(str(path))
        if hit and hit[:3] == stamp:
            return str(hit[3])
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
        self._cache[str(path)] = [*stamp, sha]
        self._dirty = True
        return sha

    def family_inputs(self, cg: Cgfile, fam: Family) -> FamilyInputs:
        files = sorted(family_files(cg, fam))
        shas = {p.relative_to(cg.root).as_posix(): self.file_digest(p) for p in files}
        lanes = [[axis, list(values)] for axis, values in fam.lanes]
        return FamilyInputs(fam.entry, fam.config, lanes, shas)

    def save(self) -> None:
        if not self._dirty:
            return
        fs.write_json(self._cache_path, self._cache)
