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

from cgbuild.identity.keys import AXES, IDENTITY_FIELDS, Axis, key_of
from cgbuild.store.local import Store
from cgbuild.store.seal import read_metadata

ROOT = Path(__file__).resolve().parents[2]
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
# Every sm_90 target's graph digest, from `cgbuild plan '//flux2-klein:sm_90' --json` on the H200
# (benchmarks/results/gpu_sm90_plan.json); the 768x768 bf16 target was minted there too
# (benchmarks/results/gpu_sm90_store_768.tgz).
BF16_768 = "//flux2-klein/transformer/768x768-t512-b1@bf16:sm_90"
H200_GRAPHS = {
    BF16_768: "84d19532d1ae1549c4741a2dfbf69e328ac94265da7f7284f3e0057a16778b53",
    "//flux2-klein/transformer/768x768-t512-b1@int8:sm_90": (
        "bc5a60559211434e57d3a86a44736bfef85306d576f9b7ff098c7c467363c40f"
    ),
    "//flux2-klein/transformer/768x768-t512-b1@fp8:sm_90": (
        "645c4883f1df475d86b33b18d6ab4d7a492bbd17d1e6463dd93dc932106f8d16"
    ),
    BF16: H200[BF16]["graph"],
    "//flux2-klein/transformer/1024x1024-t512-b1@int8:sm_90": (
        "79e4a4b5715517f4ece1238b246d19585296abfa2b23926573be9da5a90471ee"
    ),
    FP8: H200[FP8]["graph"],
}
H200_TORCH = "2.11.0"
H200_DIFFUSERS = "0.42.1"


def _axis(name: str, readable: dict[str, Any]) -> Axis:
    return Axis({f: readable[f] for f in IDENTITY_FIELDS[name]}, readable)


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
    return _sealed_from("gpu_sm90_store.tgz", H200[BF16]["key"], BF16, tmp_path_factory.mktemp("h200"))


@pytest.fixture(scope="module")
def h200_plan() -> dict[str, dict[str, Any]]:
    """label → target of the plan the H200 computed for every sm_90 target."""
    plan = json.loads((RESULTS / "gpu_sm90_plan.json").read_text())
    return {t["label"]: t for t in plan["targets"]}


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


def test_h200_plan_carries_the_banked_digests(h200_plan: dict[str, dict[str, Any]]) -> None:
    assert {label: t["axes"]["graph"]["digest"] for label, t in h200_plan.items()} == H200_GRAPHS
    for label in (BF16, FP8):
        assert h200_plan[label]["key"] == H200[label]["key"]


def test_h200_plan_keys_recompute_from_their_axes(h200_plan: dict[str, dict[str, Any]]) -> None:
    for target in h200_plan.values():
        axes = {name: _axis(name, target["axes"][name]) for name in AXES}
        assert key_of(axes) == target["key"], target["label"]


def test_int8_mint_is_the_planned_key(h200_plan: dict[str, dict[str, Any]]) -> None:
    record = json.loads((RESULTS / "gpu_int8.json").read_text())
    (minted,) = record["phases"]["mint"]["summary"]["minted"]
    assert minted["labels"] == [record["label"]]
    assert minted["key"] == h200_plan[record["label"]]["key"]


def test_768_artifact_is_the_planned_key(
    h200_plan: dict[str, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    planned = h200_plan[BF16_768]
    meta = _sealed_from("gpu_sm90_store_768.tgz", planned["key"], BF16_768, tmp_path_factory.mktemp("h200"))
    assert meta["key"] == planned["key"]
    assert meta["axes"]["graph"]["digest"] == H200_GRAPHS[BF16_768]


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
    layout = {f: lay[f] for f in IDENTITY_FIELDS["layout"]}
    assert layout == {f: there["layout"][f] for f in IDENTITY_FIELDS["layout"]}
    assert h200_key(graph["digest"], layout, sealed) == h200_plan[label]["key"]
