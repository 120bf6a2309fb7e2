"""Crafted artifacts against the real loader: nothing escapes, adopt refuses by name, never raises.

Every artifact here is forged from the session's real mint (`art_a`, support/minted.py, no extra
compile): its real AOTI package with an entry added, its real metadata bent out of shape, its
archive cut short. Adopt must return a named refusal and serve eager; `cgbuild inspect` must
report the refusal in one line.
"""

from __future__ import annotations

import io
import json
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cgbuild_rules.adopt import adopt
from support.cli import cli
from support.minted import served_eager, tiny

from cgbuild.cli import main
from cgbuild.store.local import Store
from cgbuild.store.seal import METADATA, PACKAGE, read_metadata, unseal

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real(art_a: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Path]]:
    """The real artifact's metadata and unsealed members."""
    return read_metadata(art_a), unseal(art_a, tmp_path_factory.mktemp("real"))


def forge(path: Path, meta: Any, members: dict[str, bytes], *, record: bool = True) -> Path:
    """A sealed-looking artifact with no check at all; with `record`, a truthful size record."""
    if record and isinstance(meta, dict):
        with zipfile.ZipFile(io.BytesIO(members[PACKAGE])) as z:
            infos = z.infolist()
        meta = {
            **meta,
            "sealed": {
                "members": {n: len(d) for n, d in members.items()},
                "package": {"entries": len(infos), "bytes": sum(i.file_size for i in infos)},
            },
        }
    with tarfile.open(path, "w:gz") as tar:
        for name, data in [(METADATA, json.dumps(meta).encode()), *members.items()]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def with_entry(pt2: Path, name: str, data: bytes = b"escaped") -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(pt2) as src, zipfile.ZipFile(buf, "w") as out:
        for info in src.infolist():
            out.writestr(info, src.read(info))
        out.writestr(name, data)
    return buf.getvalue()


def members_of(files: dict[str, Path]) -> dict[str, bytes]:
    return {name: p.read_bytes() for name, p in files.items() if name != METADATA}


def test_a_package_entry_that_climbs_out_is_refused_before_the_loader_unpacks_it(
    real: tuple[dict[str, Any], dict[str, Path]], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The AOTI loader writes `model/data/aotinductor/model/../../…/x` wherever it points."""
    meta, files = real
    outside = tmp_path / "outside" / "x"
    climb = "model/data/aotinductor/model/" + "../" * 40 + str(outside).lstrip("/")
    members = {**members_of(files), PACKAGE: with_entry(files[PACKAGE], climb)}
    art = forge(tmp_path / "climb.tar.gz", meta, members)
    served_eager(art, tiny(tmp_path_factory), "bad-package")
    assert not outside.exists()
    absolute = {**members_of(files), PACKAGE: with_entry(files[PACKAGE], str(outside))}
    served_eager(forge(tmp_path / "abs.tar.gz", meta, absolute), tiny(tmp_path_factory), "bad-package")
    assert not outside.exists()


def _bend(path: str, value: Any) -> Callable[[dict[str, Any]], Any]:
    def edit(meta: dict[str, Any]) -> Any:
        *parents, leaf = path.split(".")
        node = meta
        for p in parents:
            node = node[p]
        node[leaf] = value
        return meta

    return edit


_SEL = {"input": "_cgbuild_lanes", "axes": ["linear"], "base": 2}


def _lanes(fqn: str | None = "lanes.linear.onehot", selector: dict[str, Any] | None = None) -> dict[str, Any]:
    """A lanes block of one two-valued axis, switched by a one-hot (`fqn`), a selector, both or neither."""
    block: dict[str, Any] = {
        "axes": [{"axis": "linear", "values": ["a", "b"], "fqn": fqn}],
        "verdict": {"winner": "a"},
    }
    return block if selector is None else {**block, "selector": selector}


def _x(tree: Any = "*", **leaf: Any) -> dict[str, Any]:
    """The toy's input `x` as traced, its leaf's fields replaced by `leaf`."""
    traced = {"dtype": "float32", "device": "cpu", "shape": [1, 8, 64], "stride": [512, 64, 1]}
    return {"name": "x", "keyword": False, "tree": tree, "leaves": [{**traced, **leaf}]}


def _deep(depth: int) -> Any:
    tree: Any = "*"
    for _ in range(depth):
        tree = ["tuple", None, [tree]]
    return tree


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (_bend("host", "x86"), "host: not an object"),
        (_bend("host.runtime", {"GLIBC": "new"}), "host.runtime.GLIBC"),
        (_bend("graph.contract.inputs", "garbage"), "graph.contract.inputs: not a list"),
        (_bend("graph.contract.inputs", [{"name": "x", "leaves": [{"dtype": 1}]}]), "leaves[0].dtype"),
        (_bend("graph.contract.symbols", [{"name": "S0", "min": "0"}]), "symbols[0].min"),
        (_bend("constants.state", [7]), "constants.state[0]: not an object"),
        (
            _bend("constants.state", [{"fqn": "a", "dtype": "f", "shape": [], "stride": [], "aliases": "b"}]),
            "constants.state[0].aliases: not a list",
        ),
        (
            _bend("layout", {"tensors": [["fc1.weight", "F32", [1]]], "stamp": 3}),
            "layout.stamp: not a string",
        ),
        (_bend("cgbuild", ["0.1"]), "cgbuild: not a string"),
        (_bend("layout", {"tensors": [["fc1.weight", "F32"]]}), "layout.tensors[0]"),
        (
            _bend("lanes", {"axes": [{"axis": "linear", "values": ["a"]}], "verdict": {"winner": "b"}}),
            "lane 'b'",
        ),
        (_bend("lanes", _lanes(fqn=None)), "axes[0]: not switched by exactly one selector or one-hot"),
        (_bend("lanes", _lanes(selector=_SEL)), "axes[0]: not switched by exactly one selector or one-hot"),
        (_bend("lanes", _lanes(fqn=None, selector={**_SEL, "axes": "linear"})), "selector.axes: not a list"),
        (_bend("lanes", _lanes(fqn=None, selector={**_SEL, "axes": ["linear"] * 2})), "repeat an axis"),
        (_bend("lanes", _lanes(selector={**_SEL, "axes": ["other"]})), "names 'other', not an axis"),
        (_bend("host.isa", []), "host.isa: not an object"),
        (_bend("graph.contract.inputs", [{"name": "x", "leaves": "abc"}]), "inputs[0].leaves: not a list"),
        (_bend("graph.contract.inputs", [_x(shape=["S5", 8, 64])]), "names 'S5', not a declared symbol"),
        (_bend("graph.contract.inputs", [_x(stride=[512, -64, 1])]), "leaves[0].stride[1]: not a size"),
        (_bend("graph.contract.inputs", [_x(tree=_deep(40))]), "nested deeper than 32"),
        (_bend("graph.contract.inputs", [_x(tree=["tuple", None, ["*", "*"]])]), "holds 2 leaves, 1 listed"),
        (
            _bend("lanes", {"axes": [{"axis": "linear", "values": ["a"]}], "verdict": 3}),
            "verdict: not an object",
        ),
        (_bend("facets", [{"shape": 8}]), "facets[0].shape: not a string"),
        (_bend("toolchain", None), "toolchain: not an object"),
        (lambda meta: [meta], "not a JSON object"),
    ],
)
def test_metadata_of_the_wrong_shape_is_a_named_refusal_not_an_exception(
    real: tuple[dict[str, Any], dict[str, Path]],
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    edit: Callable[[dict[str, Any]], Any],
    needle: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    meta, files = real
    bent = edit(json.loads(json.dumps(meta)))
    art = forge(tmp_path / "bent.tar.gz", bent, members_of(files), record=isinstance(bent, dict))
    served_eager(art, tiny(tmp_path_factory), "bad-metadata")
    assert needle in next(iter(adopt(art, tiny(tmp_path_factory)).refusals.values())).detail
    # inspect reads the same metadata through the same check: the same refusal, never a traceback
    (tmp_path / "Cgfile").write_text('[workspace]\nname = "w"\n')
    assert main(["-C", str(tmp_path), "inspect", str(art)]) == 2
    err = capsys.readouterr().err
    assert "refused (bad-metadata)" in err and needle in err and "Traceback" not in err
    # and `verify` through the same check again: the stored copy is quarantined, named
    store = Store(tmp_path / "store")
    key = meta["key"]
    store.admit(key, art)
    verdict = store.check_sealed_key(key)
    assert verdict is not None and verdict.status == "bad-metadata" and needle in str(verdict.detail)
    assert store.ref_state(key) == "quarantined"


def test_inspect_shows_a_call_with_constant_arguments(
    real: tuple[dict[str, Any], dict[str, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A diffusers transformer traced as its pipeline calls it bakes `return_dict=False` (and
    `None`s) into its contract: inspect renders them as the constants they are."""
    meta, files = real
    honest = json.loads(json.dumps(meta))
    honest["graph"]["contract"]["inputs"] += [
        {"name": "return_dict", "keyword": True, "tree": None, "leaves": [False]},
        {"name": "mask", "keyword": True, "tree": None, "leaves": [None]},
    ]
    art = forge(tmp_path / "constants.tar.gz", honest, members_of(files))
    (tmp_path / "Cgfile").write_text('[workspace]\nname = "w"\n')
    assert main(["-C", str(tmp_path), "inspect", str(art)]) == 0
    out = capsys.readouterr().out
    assert "return_dict: False" in out and "mask: None" in out


def test_broken_archives_and_literals_are_refusals(
    real: tuple[dict[str, Any], dict[str, Path]], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    meta, files = real
    m = tiny(tmp_path_factory)
    good = forge(tmp_path / "good.tar.gz", meta, members_of(files))
    assert adopt(good, m).armed  # the forger itself makes loadable artifacts
    raw = good.read_bytes()
    (tmp_path / "cut.tar.gz").write_bytes(raw[: len(raw) * 2 // 3])  # metadata reads, the package does not
    served_eager(tmp_path / "cut.tar.gz", m, "bad-archive")
    extra = tmp_path / "extra.tar.gz"
    with tarfile.open(good) as src, tarfile.open(extra, "w:gz") as out:
        for info in src.getmembers():
            out.addfile(info, src.extractfile(info))
        link = tarfile.TarInfo("../../escape")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        out.addfile(link)
    served_eager(extra, m, "bad-member")
    assert not (tmp_path.parent / "escape").exists()
    garbage = {**members_of(files), "constants.safetensors": b"\x05\0\0\0\0\0\0\0{}xxx"}
    served_eager(forge(tmp_path / "lit.tar.gz", meta, garbage), m, "bad-literals")


def test_inspect_reports_a_refused_artifact_in_one_line(
    real: tuple[dict[str, Any], dict[str, Path]], tmp_path: Path
) -> None:
    meta, files = real
    climb = {**members_of(files), PACKAGE: with_entry(files[PACKAGE], "model/../../x")}
    art = forge(tmp_path / "climb.tar.gz", meta, climb)
    (tmp_path / "Cgfile").write_text('[workspace]\nname = "w"\n')
    out = cli(tmp_path, "inspect", str(art), timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "refused (bad-package)" in out.stderr and "model/../../x" in out.stderr
    as_json = cli(tmp_path, "inspect", str(art), "--json", timeout=120)
    assert as_json.returncode == 2
    assert json.loads(as_json.stdout)["refusal"]["code"] == "bad-package"
