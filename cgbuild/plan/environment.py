"""What the tracing interpreter has installed, read without importing it.

Trace inputs are over-keyed on the full set of installed distributions (a diffusers patch release
re-traces, then stops at the unchanged graph digest). Enumerating distributions costs ~0.1 s, so
the set is cached on the mtimes of the import path's folders: installing or removing a
distribution touches its site-packages folder.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import sys
from pathlib import Path
from typing import Any

from cgbuild.core import fs, statefile
from cgbuild.core.canon import digest


def _path_stamp() -> list[list[Any]]:
    stamps = []
    for entry in sys.path:
        try:
            stamps.append([entry, os.stat(entry or ".").st_mtime_ns])
        except OSError:
            continue
    return stamps


def _valid_cache(doc: Any) -> bool:
    return (
        isinstance(doc, dict) and isinstance(doc.get("stamp"), str) and statefile.is_str_map(doc.get("dists"))
    )


def installed(cache: Path | None = None) -> dict[str, str]:
    """name → version of every distribution importable by this interpreter."""
    stamp = digest({"python": sys.version, "paths": _path_stamp()})
    if cache is not None:
        data = statefile.read_json(cache, _valid_cache, "distribution cache")
        if data is not None and data["stamp"] == stamp:
            return dict(data["dists"])
    dists: dict[str, str] = {}
    for d in md.distributions():
        name = (d.metadata["Name"] or "").lower().replace("_", "-")
        if name and name not in dists:
            dists[name] = d.version
    if cache is not None:
        fs.write_json(cache, {"stamp": stamp, "dists": dists})
    return dists


_CUDA = re.compile(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", re.M)


def torch_build() -> dict[str, Any] | None:
    """{'version', 'cuda'} of the torch that would trace, read from its files (no import)."""
    try:
        dist = md.distribution("torch")
    except md.PackageNotFoundError:
        return None
    try:
        m = _CUDA.search(Path(str(dist.locate_file("torch/version.py"))).read_text())
    except OSError:
        m = None
    cuda = m.group(1) if m else None
    return {"version": dist.version, "cuda": cuda}
