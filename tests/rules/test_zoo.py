"""The serving zoo: each model planned, minted, adopted and served compiled, on the CPU.

Tiny configs, random weights, real compiles (one per model, about 10-30 s each on two cores).
Each model carries a state table real models have and adopt once refused: BatchNorm counters
the program never reads, an encoder a `decode` graph never uses (and a decoder an `encode`
graph never uses), an output head tied to the input embedding, non-persistent rotary buffers,
a batch exported as a symbol. The mint itself adopts every artifact in a fresh process before
sealing (`stage_serve`); here a serving module with weights of its own (another seed than the
mint's) adopts each from the store and must be served compiled on every call, within the verify
tolerance of eager.

The heavy zoo (`zoo-heavy`: a diffusers UNet, a transformers GPT-2 and CLIP text encoder) is
marked `zoo_heavy`, deselected by default: `python -m pytest -m zoo_heavy tests/rules/test_zoo.py`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from cgbuild_rules.adopt import AdoptRefused, adopt
from cgbuild_rules.mint import TOLERANCE
from support.cli import cli
from support.zoo import artifact, minted, rel_rms, served_module

from cgbuild.store.seal import read_metadata

pytestmark = pytest.mark.slow
LABELS = {
    "bnconv": "//zoo/bnconv/16x16-b1@fp32:cpu",
    "vae.decode": "//zoo/vae.decode/8x8-b1@fp32:cpu",
    "lm": "//zoo/lm/1x8-b1@fp32:cpu",
    "rotary": "//zoo/rotary/1x8-b1@fp32:cpu",
    "vae.encode": "//zoo/vae.encode/8x8-b1@fp32:cpu",
    "dynbatch": "//zoo/dynbatch/1x16-b4@fp32:cpu",
}
HEAVY = {
    "unet": "//zoo-heavy/unet/8x8-t4-b1@fp32:cpu",
    "gpt2": "//zoo-heavy/gpt2/1x8-b1@fp32:cpu",
    "clip": "//zoo-heavy/clip/1x8-b1@fp32:cpu",
}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The default zoo minted: six compiles."""
    return minted(tmp_path_factory, "zoo", LABELS)


@pytest.fixture(scope="module")
def zoo_heavy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The heavy zoo minted: three compiles of real library models."""
    return minted(tmp_path_factory, "zoo-heavy", HEAVY)


@pytest.mark.parametrize(
    "module", [*sorted(LABELS), *(pytest.param(m, marks=pytest.mark.zoo_heavy) for m in sorted(HEAVY))]
)
def test_every_zoo_model_serves_compiled(request: pytest.FixtureRequest, module: str) -> None:
    label = LABELS.get(module) or HEAVY[module]
    ws, _ = request.getfixturevalue("zoo" if module in LABELS else "zoo_heavy")
    path = artifact(ws, label)
    m, args, _ = served_module(ws, label)
    served = adopt(path, m, strict=True)
    with torch.no_grad():
        for _ in range(3):
            x = tuple(
                torch.randn_like(a) if a.is_floating_point() else torch.randint_like(a, 64) for a in args
            )
            got, want = served(*x), m(*x)
            assert rel_rms(got, want) < float(TOLERANCE["float32"])
    assert served.counters == {"compiled": 3}


def test_the_sealed_table_is_what_the_package_binds(zoo: tuple[Path, dict[str, Any]]) -> None:
    """No BatchNorm counter, no encoder tensor; the tied head under one name, its alias named."""
    ws, _ = zoo
    from cgbuild_rules.loader import Package

    from cgbuild.store.seal import unseal

    tables = {}
    for module, label in LABELS.items():
        path = artifact(ws, label)
        meta = read_metadata(path)
        files = unseal(path, ws / "unsealed" / module)
        bound = set(Package(files["model.pt2"]).constant_fqns)
        constants = meta["constants"]
        assert {r["fqn"] for g in ("state", "literal") for r in constants[g]} == bound
        tables[module] = constants
    bn = {r["fqn"] for r in tables["bnconv"]["state"]}
    assert "bn1.running_mean" in bn and not any(f.endswith("num_batches_tracked") for f in bn)
    vae = {r["fqn"] for r in tables["vae.decode"]["state"]}
    assert vae and all(f.startswith(("vae.decoder.", "vae.post_quant_conv.")) for f in vae)
    (head,) = [r for r in tables["lm"]["state"] if r["aliases"]]
    assert {head["fqn"], *head["aliases"]} == {"embed.weight", "lm_head.weight"}
    literals = {r["fqn"] for r in tables["rotary"]["literal"]}
    assert literals == {"cos", "sin"} or literals == {"cos", "sin", "inv_freq"}
    assert "unused_cache" not in literals
    enc = {r["fqn"] for r in tables["vae.encode"]["state"]}
    assert enc and all(f.startswith(("vae.encoder.", "vae.quant_conv.")) for f in enc)


def test_one_dynamic_batch_artifact_serves_its_whole_range(zoo: tuple[Path, dict[str, Any]]) -> None:
    """The batch is a symbol in [2, 16]: every batch in it is served compiled by the one artifact
    (the traced batch, 4, among them), each within tolerance; outside it the module serves eager."""
    ws, _ = zoo
    path = artifact(ws, LABELS["dynbatch"])
    assert read_metadata(path)["graph"]["contract"]["symbols"]
    m, _, _ = served_module(ws, LABELS["dynbatch"])
    served = adopt(path, m, strict=True)
    with torch.no_grad():
        for batch in (2, 4, 9, 16):
            x = torch.randn(batch, 1, 16)
            assert rel_rms(served(x), m(x)) < float(TOLERANCE["float32"])
        assert served.counters == {"compiled": 4}
        for batch in (1, 17):  # strict: refused by name, never served otherwise
            with pytest.raises(AdoptRefused, match="symbol-range"):
                served(torch.randn(batch, 1, 16))
        lenient = adopt(path, m)
        for batch in (1, 17):
            x = torch.randn(batch, 1, 16)
            torch.testing.assert_close(lenient(x), m(x))
            why = lenient.last_reason
            assert why is not None and why.code == "out-of-envelope" and "(symbol-range)" in why.detail
    assert served.counters == {"compiled": 4}
    assert lenient.counters == {"eager:out-of-envelope": 2}


@pytest.mark.zoo_heavy
def test_library_models_seal_what_their_packages_bind(zoo_heavy: tuple[Path, dict[str, Any]]) -> None:
    """GPT-2's head is one row aliased to the token embedding; CLIP's non-persistent
    `position_ids` is a literal, never a state row; the UNet binds its cross-attention and its
    added-embedding projection."""
    ws, _ = zoo_heavy
    from cgbuild_rules.loader import Package

    from cgbuild.store.seal import unseal

    tables = {}
    for module, label in HEAVY.items():
        path = artifact(ws, label)
        files = unseal(path, ws / "unsealed" / module)
        constants = read_metadata(path)["constants"]
        bound = set(Package(files["model.pt2"]).constant_fqns)
        assert {r["fqn"] for g in ("state", "literal") for r in constants[g]} == bound
        tables[module] = constants
    (head,) = [r for r in tables["gpt2"]["state"] if r["aliases"]]
    assert {head["fqn"], *head["aliases"]} == {"lm.transformer.wte.weight", "lm.lm_head.weight"}
    (position_ids,) = tables["clip"]["literal"]
    assert position_ids["fqn"] == "text.embeddings.position_ids"
    assert position_ids["fqn"] not in {r["fqn"] for r in tables["clip"]["state"]}
    unet = {r["fqn"] for r in tables["unet"]["state"]}
    assert any(".attn2." in f for f in unet) and any(f.startswith("unet.add_embedding.") for f in unet)


def test_an_untied_head_is_refused(zoo: tuple[Path, dict[str, Any]]) -> None:
    """The program reads the head through the embedding's storage: untied, it would serve the
    embedding for both, so adopt refuses it and the module serves eager."""
    ws, _ = zoo
    m, args, _ = served_module(ws, LABELS["lm"])
    m.lm_head.weight = torch.nn.Parameter(m.embed.weight.detach().clone() * 2)
    served = adopt(artifact(ws, LABELS["lm"]), m)
    (refusal,) = served.refusals.values()
    assert refusal.code == "weights-untied" and "lm_head.weight" in refusal.detail + "embed.weight"
    with torch.no_grad():
        torch.testing.assert_close(served(*args), m(*args))
    assert served.counters == {"eager:weights-untied": 1}


def test_live_literals_bind_in_place_and_a_changed_one_is_refused(zoo: tuple[Path, dict[str, Any]]) -> None:
    ws, _ = zoo
    path = artifact(ws, LABELS["rotary"])
    m, args, _ = served_module(ws, LABELS["rotary"])
    served = adopt(path, m, strict=True)
    with torch.no_grad():
        m.cos.mul_(0.5)  # in place: the package reads the module's own buffer
        torch.testing.assert_close(served(*args), m(*args), rtol=1e-4, atol=1e-5)
    m2, _, _ = served_module(ws, LABELS["rotary"])
    m2.sin = m2.sin * 2  # another value than the program was traced with
    (refusal,) = adopt(path, m2).refusals.values()
    assert refusal.code == "literal-mismatch" and refusal.detail.startswith("sin:")


def test_verify_run_adopts_and_prints_what_it_compared(zoo: tuple[Path, dict[str, Any]]) -> None:
    ws, _ = zoo
    proc = cli(ws, "verify", LABELS["bnconv"], "--run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "output 0 (float32): rel-rms" in proc.stdout and "served compiled 1" in proc.stdout


def test_a_mint_adopt_would_refuse_seals_nothing(zoo: tuple[Path, dict[str, Any]]) -> None:
    """A literal drawn at random on construction: the serving process's module holds another
    value than the sealed one, so the mint fails with adopt's own refusal and stores nothing."""
    ws, _ = zoo
    proc = cli(ws, "mint", "//zoo-random:cpu", "--json")
    assert proc.returncode != 0
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    (failed,) = summary["failed"]
    assert failed["code"] == "literal-mismatch" and "jitter" in failed["detail"], failed
    plan = json.loads(cli(ws, "plan", "//zoo-random", "--json").stdout)
    assert plan["targets"][0]["status"] == "mint"
