"""CUDA graph digests banked from the H200 (docs/gpu.md, docs/lanes.md).

The H200 (torch 2.11.0+cu130, diffusers 0.42.1) planned every sm_90 target of flux2-klein with
its lanes (`attention`; `fp8-gemm` on the fp8 layout) and minted the 1024x1024 bf16 and fp8
targets; the plan is `benchmarks/results/gpu_sm90_plan_lanes.json` and the sealed store
`benchmarks/results/gpu_sm90_store_lanes.tgz`. The digests below are what that machine traced. A
CPU-only machine with the same CUDA build of torch traces the same CUDA graphs under fake
tensors and must compute the same digests: the re-trace test checks that where such a torch is
installed. The archives of the program before lanes (gpu_sm90_store.tgz, *_768.tgz, *_fp8.tgz)
are history: they must still verify and their keys recompute from their own axes.

Every banked target carries lanes, and these are the programs whose switches read a one-hot
literal. Programs traced since branch on the lane selector's size (docs/lanes.md, "The switch"):
another graph, so the re-trace gives other digests until a plan and store traced on the H200
with the selector are banked here in their place.

The archive checks read only the committed files (no torch): they are cheap enough for every run.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from cgbuild.identity.keys import AXES, KINDS, LAYOUT, Axis, key_of
from cgbuild.store.local import Store
from cgbuild.store.seal import read_metadata

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
FLUX = ROOT / "examples" / "flux2_klein"
STORE = "gpu_sm90_store_lanes.tgz"
PLAN = "gpu_sm90_plan_lanes.json"

BF16 = "//flux2-klein/transformer/1024x1024-t512-b1@bf16:sm_90"
FP8 = "//flux2-klein/transformer/1024x1024-t512-b1@fp8:sm_90"

# What the H200 traced and keyed. Layout identities are the digest pair of each layout axis.
H200: dict[str, dict[str, Any]] = {
    BF16: {
        "key": "028ac177de07c3b9a666fa0a3f2ab33e26957a0233f299461acf8c6f18f7b1cd",
        "graph": "0d246cdcabca02ac920f2b84d0def26667b74dd449306acf6ad039272496254a",
        "nodes": 2780,
        "layout": {
            "topology": "d2d480dde58a927e9c068ffdf590ce95a2af4d04ef93bdedc7d206e1720130a0",
            "quant": "3ca7b07bac9894cf438176e186ca1e9e5dc3a7aeadfd9b3311a3f2c9d186de6b",
        },
    },
    FP8: {
        "key": "4915cdaed829464fb45871636c25e8017e4be29054f1b55a4181f74735264e87",
        "graph": "41f74b2457d2a093a4bc5cce5ce1aee99a7bd183aee73d2a6f0e9b4c98696fc9",
        "nodes": 3653,
        "layout": {
            "topology": "f2e7ee8bb0c3c09b255a6d3ca1d57b20e830ea8dce7ad3dd2807c89cef5e5d8c",
            "quant": "a956d90fe9b2fa72c2918165dbed398f119fcf3657ebc95ec224d0074c4f40c9",
        },
    },
}
# Every sm_90 target's graph digest, from `cgbuild plan '//flux2-klein:sm_90' --json` on the H200.
H200_GRAPHS = {
    "//flux2-klein/transformer/768x768-t512-b1@bf16:sm_90": (
        "256a7ec605b666dfd55fac883e72916d32155ddda95065124ca4f81a88a2e46c"
    ),
    "//flux2-klein/transformer/768x768-t512-b1@int8:sm_90": (
        "74cb8deadf2ea3c94d497e4e7e3ab817f75325739a55ad0ad9c604b0ea69648a"
    ),
    "//flux2-klein/transformer/768x768-t512-b1@fp8:sm_90": (
        "66155132d4a96da680507c9dd83dd10340f8391fbe14ee5c8c11eafcba0a8919"
    ),
    BF16: H200[BF16]["graph"],
    "//flux2-klein/transformer/1024x1024-t512-b1@int8:sm_90": (
        "25eb5de6c1c7c870b8f75766b1eb43fe8a7edef9699c393332b198da8724792f"
    ),
    FP8: H200[FP8]["graph"],
}
EARLIER = ("gpu_sm90_store.tgz", "gpu_sm90_store_768.tgz", "gpu_sm90_store_fp8.tgz")
H200_TORCH = "2.11.0"
H200_DIFFUSERS = "0.42.1"


def _axis(name: str, readable: dict[str, Any]) -> Axis:
    return KINDS[name].axis(readable)


def _sealed_from(archive: str, key: str, label: str, dest: Path) -> dict[str, Any]:
    """The sealed metadata of `key` in a committed H200 store archive (hash-verified)."""
    with tarfile.open(RESULTS / archive) as tar:
        tar.extractall(dest, filter="data")
    resolved = Store(dest / "store").resolve(key, verify=True)
    assert label in resolved.ref.metadata["labels"]
    return read_metadata(resolved.path)


@pytest.fixture(scope="module")
def sealed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The sealed metadata of the 1024x1024 bf16 artifact in the committed H200 store."""
    return _sealed_from(STORE, H200[BF16]["key"], BF16, tmp_path_factory.mktemp("h200"))


@pytest.fixture(scope="module")
def h200_plan() -> dict[str, dict[str, Any]]:
    """label → target of the plan the H200 computed for every sm_90 target."""
    plan = json.loads((RESULTS / PLAN).read_text())
    return {t["label"]: t for t in plan["targets"]}


def h200_key(graph: str, layout: dict[str, Any], sealed: dict[str, Any]) -> str:
    """A key from a graph digest and layout pair, with the H200's sm and toolchain axes."""
    axes = {name: _axis(name, sealed["axes"][name]) for name in ("sm", "toolchain")}
    axes["graph"] = Axis({"digest": graph}, {})
    axes["layout"] = Axis(dict(layout), {})
    return key_of(axes)


@pytest.mark.parametrize("label", [BF16, FP8])
def test_sealed_metadata_carries_the_banked_digest(label: str, tmp_path: Path) -> None:
    meta = _sealed_from(STORE, H200[label]["key"], label, tmp_path)
    banked = H200[label]
    assert meta["key"] == banked["key"]
    assert meta["axes"]["graph"]["digest"] == banked["graph"]
    assert meta["graph"]["digest"] == banked["graph"]
    assert meta["axes"]["graph"]["nodes"] == banked["nodes"]
    assert LAYOUT.identity(meta["axes"]["layout"]) == banked["layout"]
    assert meta["axes"]["sm"] == {"sm": "sm_90"}
    assert meta["device"] == "cuda"
    # The versions the re-trace below must match.
    assert meta["axes"]["graph"]["traced_with"].split("+")[0] == H200_TORCH
    assert meta["forensics"]["diffusers"] == H200_DIFFUSERS
    axes = {name: _axis(name, meta["axes"][name]) for name in AXES}
    assert key_of(axes) == meta["key"]


def test_sealed_lanes_are_the_measured_verdicts(tmp_path: Path) -> None:
    """Both artifacts carry their lane switches and the verdict their mint measured on the H200
    (benchmarks/results/klein_lanes_gpu.json); the fp8-gemm axis is the fp8 artifact's only."""
    record = json.loads((RESULTS / "klein_lanes_gpu.json").read_text())
    for label, layout in ((BF16, "bf16"), (FP8, "fp8")):
        lanes = _sealed_from(STORE, H200[label]["key"], label, tmp_path / layout)["lanes"]
        axes = [row["axis"] for row in lanes["axes"]]
        assert axes == (["attention", "fp8-gemm"] if layout == "fp8" else ["attention"])
        assert lanes["axes"][0]["values"] == ["flash", "cudnn", "efficient"]
        assert lanes["verdict"] == record["mints"][layout]["evidence"]["verdict"]
        assert lanes["verdict"]["sku"]["name"] == "h200"
    assert record["mints"]["fp8"]["evidence"]["verdict"]["winner"] == "cudnn+scaled-mm"
    assert record["mints"]["bf16"]["evidence"]["verdict"]["winner"] == "cudnn"


def test_sealed_key_recomputes_from_the_banked_pair(sealed: dict[str, Any]) -> None:
    for label in (BF16, FP8):
        assert h200_key(H200[label]["graph"], H200[label]["layout"], sealed) == H200[label]["key"]


def test_h200_plan_carries_the_banked_digests(h200_plan: dict[str, dict[str, Any]]) -> None:
    assert {label: t["axes"]["graph"]["digest"] for label, t in h200_plan.items()} == H200_GRAPHS
    for label in (BF16, FP8):
        assert h200_plan[label]["key"] == H200[label]["key"]


def test_h200_plan_keys_recompute_from_their_axes(h200_plan: dict[str, dict[str, Any]]) -> None:
    for target in h200_plan.values():
        axes = {name: _axis(name, target["axes"][name]) for name in AXES}
        assert key_of(axes) == target["key"], target["label"]


@pytest.mark.parametrize("archive", EARLIER)
def test_earlier_archives_still_verify(archive: str, tmp_path: Path) -> None:
    """The stores minted before lanes: every object hashes to its ref and every key recomputes
    from the axes it sealed (they were keyed for a program without switches)."""
    with tarfile.open(RESULTS / archive) as tar:
        tar.extractall(tmp_path, filter="data")
    store = Store(tmp_path / "store")
    keys = store.ref_keys()
    assert keys
    for key in keys:
        meta = read_metadata(store.resolve(key, verify=True).path)
        assert key_of({name: _axis(name, meta["axes"][name]) for name in AXES}) == key
        assert "lanes" not in meta


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _retrace_skip() -> str | None:
    """Why the re-trace cannot run here (None when it can): it needs the H200's CUDA build of
    torch and its diffusers, not a GPU. torch is imported only when its version already fits."""
    need = f"torch=={H200_TORCH} (a CUDA build, e.g. +cu130) and diffusers=={H200_DIFFUSERS}"
    installed = _version("torch")
    if installed.split("+")[0] != H200_TORCH:
        return f"re-trace needs {need}; installed torch is {installed}"
    if _version("diffusers") != H200_DIFFUSERS:
        return f"re-trace needs {need}; installed diffusers is {_version('diffusers')}"
    import torch

    if torch.version.cuda is None:
        return f"re-trace needs {need}; installed torch is {torch.__version__}, a CPU-only build"
    return None


@pytest.mark.parametrize("label", sorted(H200_GRAPHS))
def test_retrace_gives_the_h200_digest(
    label: str, tmp_path: Path, sealed: dict[str, Any], h200_plan: dict[str, dict[str, Any]]
) -> None:
    """`cgbuild plan` traces the CUDA graph under fake tensors (no GPU needed) and must compute
    the H200's graph digest and layout pair, hence its key under the H200's toolchain."""
    why = _retrace_skip()
    if why is not None:
        pytest.skip(why)
    ws = tmp_path / "flux2_klein"
    shutil.copytree(FLUX, ws, ignore=shutil.ignore_patterns(".cgbuild", "__pycache__"))
    proc = subprocess.run(
        [sys.executable, "-m", "cgbuild.cli", "-C", str(ws), "plan", label, "--json"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    (target,) = json.loads(proc.stdout)["targets"]
    assert target["label"] == label
    graph, lay = target["axes"]["graph"], target["axes"]["layout"]
    there = h200_plan[label]["axes"]
    assert graph["digest"] == H200_GRAPHS[label], f"traced with torch {graph['traced_with']}"
    assert graph["nodes"] == there["graph"]["nodes"]
    layout = LAYOUT.identity(lay)
    assert layout == LAYOUT.identity(there["layout"])
    assert h200_key(graph["digest"], layout, sealed) == h200_plan[label]["key"]


# The klein sm_90 store re-minted since the traced strides joined the key (benchmarks/
# klein_sm90_mint.sh; benchmarks/results/klein_sm90_mint.json): the transformers trace the
# transposed hidden states the stock pipeline passes; the VAE decoders kept their keys.
KLEIN_STORE = "gpu_sm90_store_klein.tgz"
KLEIN_PLAN = "gpu_sm90_plan_klein.json"
KLEIN = {
    BF16: "19c96a2fa4ab40766b8e2d01eaf2b0e1e529fe4e0cb0fe1a41a62695d6c5bdc6",
    FP8: "bbacaf5799d3ea2ce0bf7eb4e9e6749315b3ae227f7de05a68091ae5b08126d2",
    "//flux2-klein/vae.decode/1024x1024-b1@bf16:sm_90": (
        "08e6a52341e41eebd34807d2793875f94a53d3b96d697deed37a68d0b44d7da3"
    ),
}


def test_the_re_minted_klein_store_resolves_under_its_planned_keys(tmp_path: Path) -> None:
    """Every key the H200 planned for the served klein targets resolves, hash-verified, to an
    artifact sealed for that label, recomputes from its own axes, and carries the traced
    structure; the transformers' traced strides are the pipeline's, and in their key."""
    plan = {t["label"]: t for t in json.loads((RESULTS / KLEIN_PLAN).read_text())["targets"]}
    assert {label: t["key"] for label, t in plan.items()} == KLEIN
    with tarfile.open(RESULTS / KLEIN_STORE) as tar:
        tar.extractall(tmp_path, filter="data")
    store = Store(tmp_path / "store")
    for label, target in plan.items():
        assert target["status"] == "fresh"
        resolved = store.resolve(target["key"], verify=True)
        assert label in resolved.ref.metadata["labels"]
        meta = read_metadata(resolved.path)
        assert key_of({name: _axis(name, meta["axes"][name]) for name in AXES}) == target["key"]
        assert meta["axes"]["graph"] == target["axes"]["graph"]
        if "/transformer/" in label:
            assert meta["axes"]["graph"]["strides"] == {"hidden_states": [524288, 1, 4096]}
            assert meta["module"]["global_hooks"] is False and "lanes" in meta
