"""CUDA graph digests banked from the H200 mint (docs/gpu.md).

The H200 (torch 2.11.0+cu130, diffusers 0.42.1) minted the klein-4B-shaped transformer's bf16 and
fp8 targets at 1024x1024 on sm_90; its sealed store is committed as
`benchmarks/results/gpu_sm90_store.tgz` and the fp8 mint's record as
`benchmarks/results/gpu_fp8.json`. The digests below are what that machine traced. A CPU-only
machine with the same CUDA build of torch traces the same CUDA graphs under fake tensors and must
compute the same digests: the re-trace test checks that where such a torch is installed.

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

from cgbuild.keys import AXES, IDENTITY_FIELDS, Axis, key_of
from cgbuild.seal import read_metadata
from cgbuild.store import Store

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
FLUX = ROOT / "examples" / "flux2_klein"

BF16 = "//flux2-klein/transformer/1024x1024-t512-b1@bf16:sm_90"
FP8 = "//flux2-klein/transformer/1024x1024-t512-b1@fp8:sm_90"

# What the H200 traced and keyed. Layout identities are the digest pair of each layout axis.
H200: dict[str, dict[str, Any]] = {
    BF16: {
        "key": "233b70e71f8ae3f80afee1a28033669a3dceb7a35de1b46ea75ca7b3f9916b97",
        "graph": "4b064c1b117318e4def48fd97045124fda8eb1391d40c754b3ecc3137e93a37a",
        "nodes": 2754,
        "layout": {
            "topology": "d2d480dde58a927e9c068ffdf590ce95a2af4d04ef93bdedc7d206e1720130a0",
            "quant": "3ca7b07bac9894cf438176e186ca1e9e5dc3a7aeadfd9b3311a3f2c9d186de6b",
        },
    },
    FP8: {
        "key": "0df3634be441b051a3331cfb642212cdb3c76091f1ebe9fe10ae8698d8e8512b",
        "graph": "63f1930cea93dc0426e434963cdf37e4d29c132311453eac75d9340062dceb0d",
        "nodes": 4389,
        "layout": {
            "topology": "f2e7ee8bb0c3c09b255a6d3ca1d57b20e830ea8dce7ad3dd2807c89cef5e5d8c",
            "quant": "27107d26d12780551b2aaa1fdcb841d85b3abb978de3fa27054e9e7f6ce6c59d",
        },
    },
}
H200_TORCH = "2.11.0"
H200_DIFFUSERS = "0.42.1"


def _axis(name: str, readable: dict[str, Any]) -> Axis:
    return Axis({f: readable[f] for f in IDENTITY_FIELDS[name]}, readable)


@pytest.fixture(scope="module")
def sealed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The sealed metadata of the bf16 artifact in the committed H200 store (hash-verified)."""
    dest = tmp_path_factory.mktemp("h200-store")
    with tarfile.open(RESULTS / "gpu_sm90_store.tgz") as tar:
        tar.extractall(dest, filter="data")
    resolved = Store(dest / "store").resolve(H200[BF16]["key"], verify=True)
    assert BF16 in resolved.ref.metadata["labels"]
    return read_metadata(resolved.path)


def h200_key(graph: str, layout: dict[str, Any], sealed: dict[str, Any]) -> str:
    """A key from a graph digest and layout pair, with the H200's sm and toolchain axes."""
    axes = {name: _axis(name, sealed["axes"][name]) for name in ("sm", "toolchain")}
    axes["graph"] = Axis({"digest": graph}, {})
    axes["layout"] = Axis(dict(layout), {})
    return key_of(axes)


def test_sealed_metadata_carries_the_banked_digest(sealed: dict[str, Any]) -> None:
    banked = H200[BF16]
    assert sealed["key"] == banked["key"]
    assert sealed["axes"]["graph"]["digest"] == banked["graph"]
    assert sealed["graph"]["digest"] == banked["graph"]
    assert sealed["axes"]["graph"]["nodes"] == banked["nodes"]
    assert {f: sealed["axes"]["layout"][f] for f in IDENTITY_FIELDS["layout"]} == banked["layout"]
    assert sealed["axes"]["sm"] == {"sm": "sm_90"}
    assert sealed["device"] == "cuda"
    # The versions the re-trace below must match.
    assert sealed["axes"]["graph"]["traced_with"].split("+")[0] == H200_TORCH
    assert sealed["forensics"]["diffusers"] == H200_DIFFUSERS


def test_sealed_key_recomputes_from_its_axes(sealed: dict[str, Any]) -> None:
    axes = {name: _axis(name, sealed["axes"][name]) for name in AXES}
    assert key_of(axes) == sealed["key"]
    assert h200_key(H200[BF16]["graph"], H200[BF16]["layout"], sealed) == sealed["key"]


def test_fp8_key_recomputes_from_the_banked_digest(sealed: dict[str, Any]) -> None:
    """The fp8 mint (same machine, same toolchain) recorded only its key: the banked fp8 graph
    digest and layout pair, with the bf16 artifact's sm and toolchain axes, must give that key."""
    record = json.loads((RESULTS / "gpu_fp8.json").read_text())
    assert record["label"] == FP8
    (minted,) = record["phases"]["mint"]["summary"]["minted"]
    assert minted["key"] == H200[FP8]["key"]
    assert h200_key(H200[FP8]["graph"], H200[FP8]["layout"], sealed) == minted["key"]


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


@pytest.mark.parametrize("label", [BF16, FP8])
def test_retrace_gives_the_h200_digest(label: str, tmp_path: Path, sealed: dict[str, Any]) -> None:
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
    banked = H200[label]
    assert graph["digest"] == banked["graph"], f"traced with torch {graph['traced_with']}"
    assert graph["nodes"] == banked["nodes"]
    layout = {f: lay[f] for f in IDENTITY_FIELDS["layout"]}
    assert layout == banked["layout"]
    assert h200_key(graph["digest"], layout, sealed) == banked["key"]
