"""A module says where it attaches in a pipeline (`serves`) and which of its family's layouts it
is minted in (`layouts`); both take effect in the targets, or are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.cgfiles import error_of, write
from support.cli import cli

from cgbuild.config import cgfile
from cgbuild.config.targets import expand

PIPELINE = """\
sku.cpu = {{ sm = "cpu", memory_gib = 4 }}
layout.bf16 = {{ quant = "plain.bf16" }}
layout.fp8 = {{ quant = "fp8-rowwise" }}

[family.klein]
entry = "m:build"
skus = ["cpu"]
layouts = ["bf16", "fp8"]
module.transformer = {{ shapes = ["64x64"] }}

[family.klein.module.decoder]
shapes = ["64x64"]
{decoder}
"""


def test_a_module_serves_its_name_unless_it_says_where(tmp_path: Path) -> None:
    cg = cgfile.load(write(tmp_path, PIPELINE.format(decoder='serves = "vae.decode"\nlayouts = ["bf16"]')))
    modules = cg.families["klein"].modules
    assert modules["transformer"].serves == "transformer"
    assert modules["decoder"].serves == "vae.decode"
    layouts = {(t.id.module, t.id.layout) for t in expand(cg)}
    # the decoder stays bf16 beside an fp8 transformer: no fp8 decoder target exists
    assert layouts == {("transformer", "bf16"), ("transformer", "fp8"), ("decoder", "bf16")}


def test_a_dotted_module_name_serves_that_attribute(tmp_path: Path) -> None:
    text = PIPELINE.format(decoder="").replace("module.decoder]", 'module."vae.decode"]')
    assert cgfile.load(write(tmp_path, text)).families["klein"].modules["vae.decode"].serves == "vae.decode"


HYPHENATED = PIPELINE.format(decoder="").replace("module.decoder]", "module.vae-decode]")


def test_a_module_named_with_a_hyphen_plans_without_a_pipeline_attachment(tmp_path: Path) -> None:
    """Any name a label takes is a module's name; `serves` defaults to it only where it is an
    attribute path, and is otherwise absent rather than refused."""
    cg = cgfile.load(write(tmp_path, HYPHENATED))
    assert cg.families["klein"].modules["vae-decode"].serves is None
    assert "//klein/vae-decode/64x64-b1@bf16:cpu" in {t.label for t in expand(cg)}
    written = cgfile.load(write(tmp_path, HYPHENATED + 'serves = "vae.decode"\n'))
    assert written.families["klein"].modules["vae-decode"].serves == "vae.decode"


def test_a_manifest_of_a_module_without_an_attachment_asks_for_serves(tmp_path: Path) -> None:
    """Refused before anything is traced, at the module's line: the manifest records where each
    module attaches, and this one's name is no attribute path."""
    write(tmp_path, HYPHENATED)
    proc = cli(tmp_path, "manifest", "//klein/vae-decode")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    line = HYPHENATED.splitlines().index("[family.klein.module.vae-decode]") + 1
    assert f"Cgfile:{line}: field 'family.klein.module.vae-decode.serves'" in proc.stderr
    assert 'write serves = "..."' in proc.stderr
    assert not (tmp_path / ".cgbuild" / "traces.sqlite").exists()  # refused before any trace


def test_a_written_serves_is_checked_whatever_the_module_is_named(tmp_path: Path) -> None:
    text = HYPHENATED + 'serves = "vae-decode"\n'
    err = error_of(tmp_path, text)
    assert "bad serves 'vae-decode'" in str(err) and err.field == "family.klein.module.vae-decode.serves"
    assert err.line == len(text.splitlines()) and err.file == str(tmp_path / "Cgfile")


@pytest.mark.parametrize(
    ("decoder", "needle"),
    [
        ('serves = "vae..decode"', "bad serves 'vae..decode'"),
        ('serves = "1vae"', "bad serves '1vae'"),
        ("serves = 3", "serves"),
        ('layouts = ["int8"]', "layout 'int8' is not one of the family's layouts (bf16, fp8)"),
        ("layouts = []", "'layouts' is empty"),
        ('layouts = ["bf16", "bf16"]', "duplicate name 'bf16'"),
    ],
)
def test_a_bad_serving_declaration_is_refused_by_name(tmp_path: Path, decoder: str, needle: str) -> None:
    err = error_of(tmp_path, PIPELINE.format(decoder=decoder))
    assert needle in str(err) and str(err.field).startswith("family.klein.module.decoder.")
    assert err.line == PIPELINE.format(decoder=decoder).splitlines().index(decoder) + 1
