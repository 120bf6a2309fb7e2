"""The shared store's remote is chosen by URL scheme through one registry, imported lazily."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cgbuild.store import backend


def test_a_scheme_no_backend_serves_is_named() -> None:
    with pytest.raises(ValueError, match="no store backend for 'gs'"):
        backend.open_backend("gs://bucket/prefix")


def test_s3_opens_its_backend_with_every_method_the_shared_store_uses() -> None:
    remote = backend.open_backend("s3://bucket/prefix")
    assert type(remote).__module__ == "cgbuild.store.s3"
    wanted = [n for n in dir(backend.Backend) if not n.startswith("_")]
    wanted += list(backend.Backend.__annotations__)
    assert [n for n in wanted if not hasattr(remote, n)] == []
    assert remote.ref_name("k") == "prefix/refs/k.json"


def test_a_workspace_without_a_remote_never_imports_a_backend() -> None:
    code = "import sys, cgbuild.store.backend; assert 'cgbuild.store.s3' not in sys.modules, 's3 imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
