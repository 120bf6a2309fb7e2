"""Stores: the local content-addressed store, its shared (remote) cache layer, seals and trust.

`cgbuild.store` stays the public path of the local store's types; the implementation lives in
`cgbuild.store.local`.
"""

from cgbuild.store.local import Admission, Corrupt, Missing, Quarantined, Ref, Resolved, Store, StoreError

__all__ = ["Admission", "Corrupt", "Missing", "Quarantined", "Ref", "Resolved", "Store", "StoreError"]
