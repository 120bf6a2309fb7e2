"""What the shared store needs of a remote: one interface, one file per backend (S3 the first).

`SharedStore` (cgbuild/store/shared.py) talks to its remote only through `Backend`. A backend is
chosen by the remote URL's scheme (`BACKENDS`), imported only when a workspace declares a remote
of that scheme, so a workspace without one never imports boto3. Names are `/`-separated keys
under the remote's prefix; refs are created create-only (`create` returns False when the name
exists: mint-once across machines rests on it); objects are addressed by their sha256.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Protocol

if TYPE_CHECKING:
    from cgbuild.store.s3 import RemoteRef

# scheme → "module:class"; adding a backend is one file beside this one and one line here.
BACKENDS = {"s3": "cgbuild.store.s3:Remote"}


class Backend(Protocol):
    url: str
    probed: bool
    """Set once `probe` has passed, so a process probes each store once."""
    seen: set[str] | None
    """The keys a recent listing or publish saw (the shared store's remembered listing)."""
    listed: bool
    """Set once this process has listed `refs/`: `seen` is then that listing, kept current."""
    seen_unsaved: bool
    """Publishes added to `seen` since it was last written."""

    def name(self, *parts: str) -> str: ...
    def ref_name(self, key: str) -> str: ...
    def object_name(self, sha: str) -> str: ...
    def facts_name(self, inputs: str) -> str: ...
    def list_names(self, sub: str) -> Iterator[str]: ...
    def list_keys(self) -> set[str]: ...
    def get_json(self, name: str) -> RemoteRef | None: ...
    def has_object(self, sha: str, size: int) -> bool: ...
    def list_stamps(self, sub: str) -> tuple[float, dict[str, float]]: ...
    def stamp(self, name: str) -> tuple[float, str, str] | None: ...
    def list_uploads(self, sub: str) -> tuple[float, list[tuple[str, str, float]]]: ...
    def abort_upload(self, name: str, upload_id: str) -> None: ...
    def download(self, sha: str, out: BinaryIO) -> tuple[str, int]: ...
    def create(self, name: str, body: bytes) -> bool: ...
    def upload(self, path: Path, sha: str) -> None: ...
    def touch(self, sha: str, size: int) -> bool: ...
    def delete(self, name: str, *, etag: str | None = None) -> bool: ...
    def probe(self, host: str, memo: Path | None = None) -> None: ...


def open_backend(url: str) -> Backend:
    """The backend for `url` by its scheme; ValueError for a scheme no backend serves."""
    scheme = url.partition("://")[0]
    if scheme not in BACKENDS:
        raise ValueError(f"no store backend for {scheme!r} URLs (known: {', '.join(sorted(BACKENDS))})")
    module, _, cls = BACKENDS[scheme].partition(":")
    backend: Backend = getattr(importlib.import_module(module), cls)(url)
    return backend
