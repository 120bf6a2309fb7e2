"""Publisher keys for the signed shared store: the keys a workspace trusts, and the one a
publishing process signs with."""

from __future__ import annotations

from pathlib import Path

import pytest


def keypair(folder: Path, name: str) -> tuple[Path, str]:
    """(private key path, trusted entry) of a new publisher key."""
    from cgbuild.store.trust import keygen

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.pem"
    return path, keygen(path, name)


def trusted(*entries: str) -> dict[str, bytes]:
    """A shared store's trusted keys, from Cgfile `trusted` entries (`name:base64 key`)."""
    from cgbuild.store.trust import public_key_bytes

    return {e.split(":")[0]: public_key_bytes(e.split(":", 1)[1]) for e in entries}


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """Two publishers: `ci` (trusted by the workspaces here) and `stranger` (trusted by none)."""
    folder = tmp_path_factory.mktemp("keys")
    return {name: keypair(folder, name) for name in ("ci", "stranger")}


@pytest.fixture
def signing(keys: dict[str, tuple[Path, str]], monkeypatch: pytest.MonkeyPatch) -> None:
    """This process publishes as `ci`."""
    from cgbuild.store.trust import SIGNING_KEY_ENV

    monkeypatch.setenv(SIGNING_KEY_ENV, str(keys["ci"][0]))
