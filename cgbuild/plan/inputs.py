"""Family inputs: the digest of what a family's code is made of, for over-keyed trace inputs.

Source files are hashed by content, with each file's digest cached on (mtime_ns, size, inode) so a
warm plan reads no source it has read before.
"""

from __future__ import annotations

import hashlib
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

    def family_inputs(self, cg: Cgfile, fam: Family) -> tuple[str, dict[str, str]]:
        """(digest, {relative path: sha256}) over entry, config and the family's source files.

        The entry's own module file is always included, globs or not: a missed input is a wrong key.
        """
        files: set[Path] = set()
        for pattern in fam.sources:
            files.update(p for p in cg.root.glob(pattern) if p.is_file())
        files.update(entry_files(cg.root, fam.entry))
        shas = {p.relative_to(cg.root).as_posix(): self.file_digest(p) for p in sorted(files)}
        return digest({"entry": fam.entry, "config": hexfloats(fam.config), "files": shas}), shas

    def save(self) -> None:
        if not self._dirty:
            return
        fs.write_json(self._cache_path, self._cache)
