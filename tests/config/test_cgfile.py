"""Cgfile validation: every malformed input names file, line and field; exit code 2, no traceback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.cgfiles import error_of, write
from support.cli import cli

from cgbuild.config import cgfile
from cgbuild.config.tomlpos import KeyLines
from cgbuild.core.errors import UserError

GOOD = """\
[workspace]
state = ".state"

[sku.cpu]
sm = "cpu"
memory_gib = 24

[sku.h200]
sm = "sm_90"
memory_gib = 141

[layout.fp32]
quant = "plain.fp32"

[family.toy]
entry = "toy_models:build"
sources = ["*.py"]
skus = ["cpu", "h200"]
layouts = ["fp32"]
config = { hidden = 8 }

[family.toy.module.mlp]
shapes = ["8x64", "16x64"]
batch_sizes = [1, 2]
guidance = [3.5, 4]
"""


def test_good_cgfile_loads(tmp_path: Path) -> None:
    cg = cgfile.load(write(tmp_path, GOOD))
    assert cg.state_dir == tmp_path / ".state"
    assert cg.store_dir == tmp_path / ".state" / "store"
    fam = cg.families["toy"]
    assert fam.skus == ("cpu", "h200")
    env = fam.modules["mlp"].envelope
    assert env.shapes == ((8, 64), (16, 64))
    assert env.text_lengths is None
    assert env.guidance == ("3.5", "4")
    assert cg.skus["h200"].memory_bytes == 141 << 30


@pytest.mark.parametrize(
    ("old", "new", "line", "field", "message"),
    [
        ('sm = "sm_90"', 'sm = "hopper"', 9, "sku.h200.sm", "bad sm"),
        ("memory_gib = 24", 'memory_gib = "24"', 6, "sku.cpu.memory_gib", "expected a number"),
        ('skus = ["cpu", "h200"]', 'skus = ["cpu", "h100"]', 18, "family.toy.skus", "unknown sku 'h100'"),
        ('layouts = ["fp32"]', 'layouts = ["int8"]', 19, "family.toy.layouts", "unknown layout 'int8'"),
        ('shapes = ["8x64", "16x64"]', "shapes = []", 23, "family.toy.module.mlp.shapes", "empty envelope"),
        (
            'shapes = ["8x64", "16x64"]',
            'shapes = ["8x64", "8by64"]',
            23,
            "family.toy.module.mlp.shapes",
            "bad shape",
        ),
        (
            "batch_sizes = [1, 2]",
            "batch_sizes = [1, 1]",
            24,
            "family.toy.module.mlp.batch_sizes",
            "duplicate",
        ),
        ('sources = ["*.py"]', 'source = ["*.py"]', 17, "family.toy.source", "unknown key 'source'"),
        ("[family.toy]", "[family.Toy]", 15, "family.Toy", "bad name"),
        ('quant = "plain.fp32"', 'quant = "fp4.magic"', 13, "layout.fp32.quant", "unknown quant rule"),
        ('entry = "toy_models:build"', 'entry = "toy_models"', 16, "family.toy.entry", "bad entry"),
        ('skus = ["cpu", "h200"]', 'skus = ["cpu", "cpu"]', 18, "family.toy.skus", "duplicate name 'cpu'"),
    ],
)
def test_errors_name_file_line_field(
    tmp_path: Path, old: str, new: str, line: int, field: str, message: str
) -> None:
    assert old in GOOD
    err = error_of(tmp_path, GOOD.replace(old, new, 1))
    assert err.file == str(tmp_path / "Cgfile")
    assert err.line == line, str(err)
    assert err.field == field, str(err)
    assert message in err.message
    assert f"Cgfile:{line}" in str(err)


TOY_LANES = """\
LANES = {
    "linear": {"baseline": {}, "chunked": {}, "triton": {"device": "cuda", "triton": True}},
    "norm": {"fused": {"min_sm": 100}, "plain": {}},
}
"""


def test_lanes_load_in_declaration_order_with_the_entrys_needs(tmp_path: Path) -> None:
    (tmp_path / "toy_models.py").write_text(TOY_LANES)
    text = GOOD + '\n[family.toy.lanes]\nnorm = ["plain", "fused"]\nlinear = ["triton", "baseline"]\n'
    fam = cgfile.load(write(tmp_path, text)).families["toy"]
    assert fam.lanes == (("norm", ("plain", "fused")), ("linear", ("triton", "baseline")))
    assert list(fam.lane_table["linear"]) == ["baseline", "triton"]  # the entry's order, declared only
    assert fam.lane_table["linear"]["triton"].to_json() == {"device": "cuda", "triton": True}
    assert fam.lane_table["norm"]["fused"].min_sm == 100


@pytest.mark.parametrize(
    ("lanes", "line", "field", "message"),
    [
        ('linear = ["baseline", "fused"]', 28, "family.toy.lanes.linear", "unknown lane value 'fused'"),
        ('linear = ["baseline", "baseline"]', 28, "family.toy.lanes.linear", "duplicate lane value"),
        ("linear = []", 28, "family.toy.lanes.linear", "empty lane axis"),
        ('attn = ["flash"]', 28, "family.toy.lanes.attn", "unknown lane axis 'attn'"),
        ('linear = "baseline"', 28, "family.toy.lanes.linear", "expected an array"),
        ('linear = ["triton"]', 28, "family.toy.lanes.linear", "no value that builds everywhere"),
        ("", 27, "family.toy.lanes", "empty lanes table"),
    ],
)
def test_lane_errors_name_file_line_field(
    tmp_path: Path, lanes: str, line: int, field: str, message: str
) -> None:
    (tmp_path / "toy_models.py").write_text(TOY_LANES)
    err = error_of(tmp_path, GOOD + f"\n[family.toy.lanes]\n{lanes}\n")
    assert (err.line, err.field) == (line, field), str(err)
    assert message in err.message
    assert err.file == str(tmp_path / "Cgfile")


def test_lanes_need_a_literal_table_in_the_entry(tmp_path: Path) -> None:
    text = GOOD + '\n[family.toy.lanes]\nlinear = ["baseline"]\n'
    err = error_of(tmp_path, text)  # no toy_models.py at all
    assert "declares no LANES table" in err.message and err.field == "family.toy.lanes"
    (tmp_path / "toy_models.py").write_text("import torch\n\nLANES = make_lanes()\n")
    err = error_of(tmp_path, text)
    assert err.file == str(tmp_path / "toy_models.py") and err.line == 3 and "literal" in err.message
    (tmp_path / "toy_models.py").write_text('LANES = {"linear": {"baseline": {"gpu": True}}}\n')
    assert "unknown need 'gpu'" in error_of(tmp_path, text).message


def test_module_lane_key_refused(tmp_path: Path) -> None:
    err = error_of(tmp_path, GOOD.replace("batch_sizes = [1, 2]", 'batch_sizes = [1, 2]\nlanes = "x"'))
    assert "declared per family" in err.message


def test_syntax_error_has_line(tmp_path: Path) -> None:
    err = error_of(tmp_path, GOOD.replace("memory_gib = 24", "memory_gib = = 24"))
    assert err.line == 6
    assert "TOML syntax error" in err.message


def test_no_family_refused(tmp_path: Path) -> None:
    err = error_of(tmp_path, '[sku.cpu]\nsm = "cpu"\nmemory_gib = 1\n')
    assert "no [family.*]" in err.message


def test_cli_bad_cgfile_exits_2_without_traceback(tmp_path: Path) -> None:
    write(tmp_path, GOOD.replace('skus = ["cpu", "h200"]', 'skus = ["cpu", "h100"]'))
    proc = cli(tmp_path, "plan")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "Cgfile:18" in proc.stderr and "family.toy.skus" in proc.stderr


def test_keylines_dotted_quoted_and_inline() -> None:
    text = '[a]\nx = 1\n"b.c".d = { e = 2, f = 3 }\n[a."m.n"]\ny = 4\n[[arr]]\nz = 5\n[[arr]]\nz = 6\n'
    kl = KeyLines(text)
    assert kl.line("a", "x") == 2
    assert kl.line("a", "b.c", "d", "f") == 3
    assert kl.line("a", "m.n", "y") == 5
    assert kl.line("arr", "1", "z") == 9
    assert kl.line("a", "m.n", "missing") == 4


def test_schema_accepts_examples() -> None:
    import json
    import tomllib

    jsonschema = pytest.importorskip("jsonschema")
    root = Path(__file__).resolve().parents[2]
    schema = json.loads((root / "docs" / "cgfile.schema.json").read_text())
    for path in [
        root / "Cgfile.example",
        *sorted((root / "examples").glob("*/Cgfile")),
        root / "tests" / "zoo" / "Cgfile",
    ]:
        jsonschema.validate(tomllib.loads(path.read_text()), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(
            {
                "family": {
                    "x": {"entry": "a:b", "skus": [], "layouts": ["l"], "module": {}},
                },
                "bogus": 1,
            },
            schema,
        )


@pytest.mark.parametrize(
    ("old", "new", "line", "field", "message"),
    [
        ("memory_gib = 24", "memory_gib = inf", 6, "sku.cpu.memory_gib", "not a finite number"),
        ("memory_gib = 24", "memory_gib = nan", 6, "sku.cpu.memory_gib", "not a finite number"),
        ("memory_gib = 24", "memory_gib = 1e300", 6, "sku.cpu.memory_gib", "out of range"),
        ("memory_gib = 24", "memory_gib = 1e-300", 6, "sku.cpu.memory_gib", "less than a byte"),
        ('sm = "sm_90"', 'sm = "sm_90\\n"', 9, "sku.h200.sm", "bad sm"),
        ('sm = "cpu"', 'sm = "cpu "', 5, "sku.cpu.sm", "bad sm"),
        ("[sku.h200]", '[sku."h200\\n"]', 8, "sku.h200\n", "bad name"),
        ("[family.toy]", '[family."to y"]', 15, "family.to y", "bad name"),
        ('entry = "toy_models:build"', 'entry = "toy_models:build\\n"', 16, "family.toy.entry", "bad entry"),
        ('entry = "toy_models:build"', 'entry = "toy..models:build"', 16, "family.toy.entry", "bad entry"),
        (
            'shapes = ["8x64", "16x64"]',
            'shapes = ["8x64\\n"]',
            23,
            "family.toy.module.mlp.shapes",
            "bad shape",
        ),
        ('shapes = ["8x64", "16x64"]', 'shapes = ["8x9999999"]', 23, "family.toy.module.mlp.shapes", "range"),
        (
            "batch_sizes = [1, 2]",
            "batch_sizes = [1, 99999999999]",
            24,
            "family.toy.module.mlp.batch_sizes",
            "range",
        ),
        ("guidance = [3.5, 4]", "guidance = [3.5, inf]", 25, "family.toy.module.mlp.guidance", "finite"),
        ("guidance = [3.5, 4]", "guidance = [nan]", 25, "family.toy.module.mlp.guidance", "finite"),
        ("sku.cpu]", "sku]\ncpu = 5\n[sku.x]", 5, "sku.cpu", "expected a table"),
        ('state = ".state"', 'state = "a\\u0000b"', 2, "workspace.state", "control character"),
        ('state = ".state"', 'state = ""', 2, "workspace.state", "empty path"),
        ('state = ".state"', f'state = "{"a" * 300}"', 2, "workspace.state", "too long"),
        ('state = ".state"', f'store = "{"a/" * 2100}"', 2, "workspace.store", "too long"),
        ('state = ".state"', 'state = "Cgfile"', 2, "workspace.state", "is not a folder"),
        ('state = ".state"', 'state = "Cgfile/below"', 2, "workspace.state", "which is not a folder"),
        ('state = ".state"', 'store = "/dev/null"', 2, "workspace.store", "is not a folder"),
        ('sources = ["*.py"]', 'sources = ["**a.py"]', 17, "family.toy.sources", "whole path component"),
        ('sources = ["*.py"]', 'sources = ["/etc/*"]', 17, "family.toy.sources", "relative"),
        ('sources = ["*.py"]', 'sources = ["../*.py"]', 17, "family.toy.sources", "outside the workspace"),
        ('sources = ["*.py"]', 'sources = [""]', 17, "family.toy.sources", "empty glob"),
        ('sources = ["*.py"]', 'sources = ["./"]', 17, "family.toy.sources", "names no file"),
        (
            "config = { hidden = 8 }",
            "config = { at = 1979-05-27T07:32:00Z }",
            20,
            "family.toy.config.at",
            "datetime",
        ),
        ("config = { hidden = 8 }", "config = { at = 07:32:00 }", 20, "family.toy.config.at", "time"),
        ("config = { hidden = 8 }", "config = { r = inf }", 20, "family.toy.config.r", "finite"),
        (
            "config = { hidden = 8 }",
            f"config = {{ d = {'[' * 40}{']' * 40} }}",
            20,
            "family.toy.config.d",
            "deeper",
        ),
        (
            "batch_sizes = [1, 2]",
            'component = "../x"',
            24,
            "family.toy.module.mlp.component",
            "bad component",
        ),
        (
            "[sku.cpu]",
            '[toolchain]\ncxx = "g++\\u0007"\n[sku.cpu]',
            5,
            "toolchain.cxx",
            "control",
        ),
    ],
)
def test_hostile_values_name_file_line_field(
    tmp_path: Path, old: str, new: str, line: int, field: str, message: str
) -> None:
    assert old in GOOD
    err = error_of(tmp_path, GOOD.replace(old, new, 1))
    assert (err.line, err.field) == (line, field), str(err)
    assert message in err.message, str(err)


def test_a_table_of_the_wrong_type(tmp_path: Path) -> None:
    err = error_of(tmp_path, 'sku = 5\n[family.a]\nentry = "m:f"\n')
    assert (err.line, err.field) == (1, "sku") and "expected a table, got integer" in err.message


def test_invalid_utf8_names_its_line(tmp_path: Path) -> None:
    (tmp_path / "Cgfile").write_bytes(b'[family.a]\nentry="m:f"\n\xff\n')
    with pytest.raises(UserError) as info:
        cgfile.load(tmp_path / "Cgfile")
    assert info.value.line == 3 and "not UTF-8" in info.value.message


def test_deep_nesting_is_refused_not_a_recursion_error(tmp_path: Path) -> None:
    err = error_of(tmp_path, "x = " + "[" * 5000 + "]" * 5000 + "\n" + GOOD)
    assert "nested too deeply" in err.message


def test_cgfile_path_that_is_a_folder_or_holds_nul(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="cannot read the Cgfile: a directory"):
        cgfile.load(tmp_path)
    with pytest.raises(UserError, match="cannot read the Cgfile"):
        cgfile.load(str(tmp_path / "Cg\x00file"))


def test_a_cgfile_that_never_ends_or_never_comes_is_refused_before_reading(tmp_path: Path) -> None:
    """`/dev/zero` would be read until memory runs out, a FIFO no one writes would block forever."""
    with pytest.raises(UserError, match="cannot read the Cgfile: not a regular file"):
        cgfile.load("/dev/zero")
    fifo = tmp_path / "Cgfile"
    os.mkfifo(fifo)
    with pytest.raises(UserError, match="cannot read the Cgfile: not a regular file"):
        cgfile.load(fifo)


def test_an_oversized_cgfile_is_refused_by_its_size(tmp_path: Path) -> None:
    big = tmp_path / "Cgfile"
    with open(big, "wb") as f:
        f.truncate(cgfile.MAX_BYTES + 1)  # sparse: no disk, and never read
    with pytest.raises(UserError, match=f"Cgfile too large: {cgfile.MAX_BYTES + 1} bytes"):
        cgfile.load(big)


def test_keylines_count_only_newlines() -> None:
    """U+2028 and form feeds may sit in a comment or string; they do not start a TOML line."""
    kl = KeyLines('a = 1 # one\u2028two\fthree\nb = "x\u2028y"\nc = 3\n')
    assert (kl.line("b"), kl.line("c")) == (2, 3)


def test_error_text_escapes_control_characters(tmp_path: Path) -> None:
    err = error_of(tmp_path, GOOD.replace('sm = "cpu"', 'sm = "\\u001b[2Jcpu"', 1))
    assert "\x1b" not in str(err) and "\\x1b[2Jcpu" in str(err)


def test_cgfile_example_plans_from_the_checkout_root(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As `cgbuild plan --cgfile Cgfile.example` at the checkout's root, with no network: its
    entry is the toy's, its shared store is commented out (a declared one would be contacted)."""
    import json
    import shutil

    from cgbuild.cli.main import main

    root = Path(__file__).resolve().parents[2]
    shutil.copy(root / "Cgfile.example", tmp_path / "Cgfile.example")
    shutil.copytree(
        root / "examples" / "toy",
        tmp_path / "examples" / "toy",
        ignore=shutil.ignore_patterns(".cgbuild", "__pycache__", "reference"),
    )
    assert main(["-C", str(tmp_path), "plan", "--cgfile", str(tmp_path / "Cgfile.example"), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    cpu = [t for t in plan["targets"] if t["sm"] == "cpu"]
    assert cpu and all(t["status"] == "mint" and t["key"] for t in cpu)
    codes = {t["reasons"][0]["code"] for t in plan["targets"] if t["status"] == "blocked"}
    assert codes <= {"no-cuda-torch"}  # blocked only by a CPU-only torch, never by the file
    assert cgfile.load(tmp_path / "Cgfile.example").remote is None


def test_an_unquoted_dotted_module_name_gets_the_quoting_hint(tmp_path: Path) -> None:
    err = error_of(tmp_path, GOOD + '\n[family.toy.module.vae.decode]\nshapes = ["8x8"]\n')
    assert err.field == "family.toy.module.vae.decode" and err.line is not None
    assert 'a module name with a dot is quoted in TOML, [family.toy.module."vae.decode"]' in err.message
