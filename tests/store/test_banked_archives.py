"""The H200 store archives committed under benchmarks/results/ are artifacts real serving processes
adopted: every check of sealed metadata added since must still accept them, and they still
resolve under the keys they were banked with. Adopting them needs an sm_90 GPU; on this machine
adopt must refuse them for their sm alone, before loading anything."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest
from cgbuild_rules.adopt import load_artifact
from torch import nn

from cgbuild.store.local import Store
from cgbuild.store.seal import read_metadata
from cgbuild.store.sealed import parse

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
ARCHIVES = sorted(p.name for p in RESULTS.glob("gpu_sm90_store*.tgz"))
# What each banked artifact was sealed with decides what adopt cannot verify: the oldest carry no
# configuration record; the VAE decoder's carries one from before the traced structure; the klein
# transformers re-minted since carry both. A new archive's keys get a line here.
UNVERIFIED: dict[str, tuple[str, ...]] = {
    "233b70e7": ("config", "structure"),
    "401220d2": ("config", "structure"),
    "0df3634b": ("config", "structure"),
    "028ac177": ("config", "structure"),
    "4915cdae": ("config", "structure"),
    "08e6a523": ("structure",),
    "b06c7f2e": ("structure",),
    "19c96a2f": (),
    "bbacaf57": (),
    "74a32bb7": (),
    "fb2f69e3": (),
}


@pytest.mark.parametrize("archive", ARCHIVES)
def test_a_banked_archive_reads_resolves_and_is_refused_only_for_its_sm(archive: str, tmp_path: Path) -> None:
    with tarfile.open(RESULTS / archive) as tar:
        tar.extractall(tmp_path, filter="data")
    store = Store(tmp_path / "store")
    keys = list(store.ref_keys())
    assert keys, archive
    for key in keys:
        path = store.resolve(key, verify=True).path  # re-hashed: the bytes banked are the bytes sealed
        meta = read_metadata(path)
        sealed = parse(meta)  # every check of sealed metadata added since accepts it
        assert sealed.contract.to_json() == meta["graph"]["contract"]  # what a mint seals now
        assert (sealed.key, sealed.sm, sealed.kind) == (key, "sm_90", "aot-inductor"), archive
        art = load_artifact(key, nn.Linear(1, 1), store=store)
        assert art.refusal is not None and art.refusal.code == "wrong-sm", art.refusal
        assert art.unverified == UNVERIFIED[key[:8]], (archive, key[:8], art.unverified)
