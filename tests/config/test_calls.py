"""An entry's call adapters (`CALLS`): read without importing the entry, refused by field when
malformed, carried through the manifest unchanged, refused there when a manifest's is bad."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cgbuild.config.calls import CallAdapter, adapter_from_json, read_calls
from cgbuild.core.errors import UserError
from cgbuild.protocol.manifest import SCHEMA, BadManifest, read_modules

GOOD = {"passes": {"return_dict": False}, "first_row": ["img_ids"], "returns": "tuple"}


def _entry(tmp_path: Path, table: str) -> Path:
    (tmp_path / "entry.py").write_text(f"import torch  # never imported by the reader\n\nCALLS = {table}\n")
    return tmp_path


def test_the_table_is_read_without_importing_the_entry(tmp_path: Path) -> None:
    calls = read_calls(_entry(tmp_path, repr({"transformer": GOOD})), "entry:build")
    assert calls == {"transformer": CallAdapter({"return_dict": False}, ("img_ids",), "tuple")}
    assert calls["transformer"].to_json() == GOOD


def test_a_table_is_keyed_by_cgfile_module_names_hyphens_and_dots_included(tmp_path: Path) -> None:
    """A module is named as the Cgfile names it (`wan-range`, `vae.decode`), not as an attribute."""
    calls = read_calls(_entry(tmp_path, repr({"wan-range": GOOD, "vae.decode": GOOD})), "entry:build")
    assert sorted(calls) == ["vae.decode", "wan-range"]


def test_an_entry_without_a_table_has_no_adapters(tmp_path: Path) -> None:
    (tmp_path / "entry.py").write_text("LANES = {}\n")
    assert read_calls(tmp_path, "entry:build") == {}


@pytest.mark.parametrize(
    ("adapter", "field"),
    [
        ({"passes": {"return_dict": [1]}}, "passes"),  # not a scalar
        ({"passes": {"not a name": 1}}, "passes"),
        ({"first_row": "img_ids"}, "first_row"),  # a string, not a list
        ({"first_row": ["a", "a"]}, "first_row"),
        ({"passes": {"a": 1}, "first_row": ["a"]}, "first_row"),
        ({"returns": "dict"}, "returns"),
        ({"traced_class": "not a class"}, "traced_class"),
        ({"squeeze": ["a"]}, "squeeze"),  # unknown field
        ({}, "non-empty"),
    ],
)
def test_a_bad_adapter_is_refused_naming_its_field(tmp_path: Path, adapter: Any, field: str) -> None:
    root = _entry(tmp_path, repr({"transformer": adapter}))
    with pytest.raises(UserError) as caught:
        read_calls(root, "entry:build")
    assert field in str(caught.value)
    assert caught.value.file is not None and caught.value.file.endswith("entry.py")
    assert caught.value.line == 3


@pytest.mark.parametrize("table", ["{'transformer': GOOD}", "[1]", "{'bad name!': {'returns': 'tuple'}}"])
def test_a_table_that_is_not_a_literal_of_modules_is_refused(tmp_path: Path, table: str) -> None:
    with pytest.raises(UserError):
        read_calls(_entry(tmp_path, table), "entry:build")


def _manifest(call: Any) -> dict[str, Any]:
    entry = {
        "graph_class": "64x64-t8-b1",
        "layout": "fp32",
        "sm": "cpu",
        "key": "k" * 64,
        "stamp": "s",
        "compiled_only": False,
        "envelope": {"shape": "64x64", "text_len": 8, "batch": 1, "guidance": []},
    }
    return {
        "schema": SCHEMA,
        "family": "f",
        "modules": {"transformer": {"serves": "transformer", "entries": [entry], "call": call}},
    }


def test_a_manifest_carries_the_adapter() -> None:
    assert read_modules(_manifest(GOOD))["transformer"].call == adapter_from_json(GOOD, "x")


@pytest.mark.parametrize("call", [{"returns": "list"}, "tuple", {"first_row": [3]}])
def test_a_manifests_bad_adapter_is_a_bad_manifest(call: Any) -> None:
    with pytest.raises(BadManifest, match=r"modules\.transformer\.call"):
        read_modules(_manifest(call))
