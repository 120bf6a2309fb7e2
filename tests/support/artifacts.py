"""Crafting sealed artifacts from real ones, for the refusals adopt must make."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from cgbuild.store.seal import read_metadata, seal, unseal


def edited(src: Path, dest: Path, edit: Callable[[dict[str, Any]], Any]) -> Path:
    """A copy of a sealed artifact with its metadata changed by `edit(meta)`."""
    files = unseal(src, dest.with_suffix(".d"))
    meta = read_metadata(src)
    edit(meta)
    seal(dest, meta, {k: v for k, v in files.items() if k != "metadata.json"})
    return dest
