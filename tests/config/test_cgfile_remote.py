"""A Cgfile's shared store: `workspace.remote` and the publisher keys it trusts, and every malformed
declaration named by file, line and field.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.cgfiles import load_ws

from cgbuild.core.errors import UserError


def test_cgfile_declares_remote_and_trusted_keys(tmp_path: Path, keys: dict[str, tuple[Path, str]]) -> None:
    entry = keys["ci"][1]
    cg = load_ws(tmp_path, f'remote = "s3://my-bucket/cg/main/"\ntrusted = ["{entry}"]')
    assert cg.remote == "s3://my-bucket/cg/main" and set(cg.trusted) == {"ci"}
    plain = load_ws(tmp_path, 'state = ".cgbuild"')
    assert plain.remote is None and plain.trusted == {}


@pytest.mark.parametrize(
    ("workspace", "line", "field", "needle"),
    [
        ('remote = "s3://B/x"\ntrusted = ["{e}"]', 2, "workspace.remote", "bad remote"),
        ('remote = "https://x/y"\ntrusted = ["{e}"]', 2, "workspace.remote", "bad remote"),
        ('remote = "s3://bucket/x"', 2, "workspace.remote", "needs trusted publisher keys"),
        ('trusted = ["{e}"]', 2, "workspace.trusted", "without a remote"),
        ('remote = "s3://bucket/x"\ntrusted = ["nocolon"]', 3, "workspace.trusted", "expected 'name:"),
        ('remote = "s3://bucket/x"\ntrusted = ["ci:AAAA"]', 3, "workspace.trusted", "32 bytes"),
        ('remote = "s3://bucket/x"\ntrusted = ["ci:%%%"]', 3, "workspace.trusted", "not base64"),
        ('remote = "s3://bucket/x"\ntrusted = ["Bad Name:{k}"]', 3, "workspace.trusted", "bad name"),
        ('remote = "s3://bucket/x"\ntrusted = ["{e}", "{e}"]', 3, "workspace.trusted", "duplicate"),
        ('remote = "s3://bucket/x"\ntrusted = "{e}"', 3, "workspace.trusted", "expected an array"),
    ],
)
def test_cgfile_shared_store_errors_name_file_line_field(
    tmp_path: Path, keys: dict[str, tuple[Path, str]], workspace: str, line: int, field: str, needle: str
) -> None:
    entry = keys["ci"][1]
    with pytest.raises(UserError) as info:
        load_ws(tmp_path, workspace.format(e=entry, k=entry.split(":", 1)[1]))
    e = info.value
    assert (e.line, e.field) == (line, field) and needle in e.message, str(e)
    assert e.file and e.file.endswith("Cgfile")
