"""Stores: the local content-addressed store, its shared (remote) cache layer, seals and trust.

`cgbuild.store` stays the public path of the local store's types; they live in
`cgbuild.store.local` (the store), `records` (its answers) and `errors` (its refusals), each
imported on first use: a warm plan served from its memo reads refs (`cgbuild.store.refs`) without
paying for the store.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Admission", "Corrupt", "Missing", "Quarantined", "Ref", "Resolved", "Store", "StoreError"]


_HOME = {"Store": "local", "Admission": "records", "Ref": "records", "Resolved": "records"}


def __getattr__(name: str) -> Any:
    if name in __all__:
        import importlib

        return getattr(importlib.import_module(f"cgbuild.store.{_HOME.get(name, 'errors')}"), name)
    raise AttributeError(f"module 'cgbuild.store' has no attribute {name!r}")
