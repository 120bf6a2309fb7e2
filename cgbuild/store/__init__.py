"""Stores: the local content-addressed store, its shared (remote) cache layer, seals and trust.

`cgbuild.store` stays the public path of the local store's types; the implementation lives in
`cgbuild.store.local`, imported on first use of one of them: a warm plan served from its memo
reads refs (`cgbuild.store.refs`) without paying for the store.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Admission", "Corrupt", "Missing", "Quarantined", "Ref", "Resolved", "Store", "StoreError"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from cgbuild.store import local

        return getattr(local, name)
    raise AttributeError(f"module 'cgbuild.store' has no attribute {name!r}")
