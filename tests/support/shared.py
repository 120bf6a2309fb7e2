"""Shared stores on a test module's S3 endpoint (the `s3` fixture), each test under a prefix of
its own so that no test sees another's refs, and the small artifacts they publish."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import pytest

from cgbuild.core.canon import canonical_json, sha256_file
from cgbuild.store.local import Store
from cgbuild.store.s3 import Remote
from cgbuild.store.shared import SharedStore
from support.publishers import trusted
from support.s3 import BUCKET, S3


def shared_at(
    root: Path,
    prefix: str,
    keys: dict[str, tuple[Path, str]],
    host: str = "host-a",
    probes: Path | None = None,
) -> SharedStore:
    """A machine `host` caching under `root`, on the bucket's `prefix`, trusting `ci` only, that
    remembers passed probes in `probes` (as a workspace does in its state folder)."""
    remote = Remote(f"s3://{BUCKET}/{prefix}")
    return SharedStore(Store(root), remote, trusted(keys["ci"][1]), host, probes)


def artifact(folder: Path, size: int = 4096) -> Path:
    """A new file of `size` random bytes: what the shared store moves, never opened as a package."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{secrets.token_hex(4)}.bin"
    path.write_bytes(secrets.token_bytes(size))
    return path


def new_key() -> str:
    return secrets.token_hex(32)


def prefix_of(request: pytest.FixtureRequest) -> str:
    """The test's own prefix: its name (readable in the bucket) and a random tail (unique)."""
    return request.node.name.replace("[", "-").replace("]", "")[:60] + "-" + secrets.token_hex(3)


def publish_one(
    tmp_path: Path, keys: dict[str, tuple[Path, str]], request: pytest.FixtureRequest, host: str = "host-a"
) -> tuple[str, SharedStore, str, Path]:
    """(prefix, the publisher's shared store, key, artifact): one small artifact, admitted."""
    prefix = prefix_of(request)
    a = shared_at(tmp_path / "a", prefix, keys, host=host)
    key, art = new_key(), artifact(tmp_path)
    assert a.admit(key, art, metadata={"labels": ["//t"]}).status == "admitted"
    return prefix, a, key, art


def forge(shared: SharedStore, key: str, art: Path, signature: Any, *, size: int | None = None) -> None:
    """Put `art` and a ref for it with this signature record, straight through the S3 API."""
    sha = sha256_file(str(art))
    shared.remote.upload(art, sha)
    doc = {"schema": "cgbuild.remote-ref/1", "key": key, "object": sha, "size": size or art.stat().st_size}
    if signature is not None:
        doc["signature"] = signature
    assert shared.remote.create(shared.remote.ref_name(key), canonical_json(doc).encode())


def overwrite_flipped(s3: S3, shared: SharedStore, key: str, art: Path, at: int) -> str:
    """Overwrite in the bucket, in place, the object `key`'s ref names with `art`'s bytes but the one
    at `at` flipped: the same size, other bytes, no sha256 tag. Returns the object's sha256."""
    sha = shared.local.read_ref(key).object  # type: ignore[union-attr]
    bad = bytearray(art.read_bytes())
    bad[at] ^= 0xFF
    s3.client().put_object(Bucket=BUCKET, Key=shared.remote.object_name(sha), Body=bytes(bad))
    return sha
