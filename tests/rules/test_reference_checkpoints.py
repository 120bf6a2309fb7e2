"""Real checkpoints as layout references: folders the libraries' own savers write.

A diffusers `save_pretrained` folder names the component's own tensors (`decoder.conv_in.weight`)
where the entry's wrapper names them `vae.decoder.conv_in.weight`, and with `variant="fp16"` it
holds a second, complete set of files beside the full ones. safetensors' `save_model` drops a
tied tensor (`lm_head.weight`, tied to the embedding) and records the alias in the header's
metadata; transformers' `save_pretrained` drops it the same way but records nothing (written
here with `save_file` of the state dict without the head, which is what that saver writes:
transformers is not installed).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file, save_model
from support.cli import cli

from cgbuild.core.errors import UserError
from cgbuild.identity.topology import Reading, safetensors_dtype, topology_from_reference, topology_mismatch

ZOO = Path(__file__).resolve().parents[1] / "zoo"
sys.path.insert(0, str(ZOO))
import zoo_models  # noqa: E402


def rows(module: torch.nn.Module) -> list[list[Any]]:
    """The module's topology as the trace records it (every name, tied ones included)."""
    return sorted(
        [n, safetensors_dtype(str(t.dtype).removeprefix("torch.")), list(t.shape)]
        for n, t in module.state_dict(keep_vars=True).items()
    )


def write_vae(folder: Path, **kw: Any) -> torch.nn.Module:
    """The zoo's VAE wrapper; its `AutoencoderKL` saved by diffusers, full and fp16 variant."""
    torch.manual_seed(0)
    wrapper = zoo_models.VAEDecode()
    wrapper.vae.save_pretrained(folder, **kw)
    half = zoo_models.VAEDecode()
    half.vae.to(torch.float16).save_pretrained(folder, variant="fp16", **kw)
    return wrapper


@pytest.mark.parametrize("sharded", [False, True])
def test_a_variant_folder_reads_one_variant_never_both(tmp_path: Path, sharded: bool) -> None:
    kw = {"max_shard_size": "20KB"} if sharded else {}
    wrapper = write_vae(tmp_path / "ref" / "vae", **kw)
    names = {p.name for p in (tmp_path / "ref" / "vae").iterdir()}
    assert any(".fp16" in n for n in names) and any(".fp16" not in n and "safetensors" in n for n in names)
    full = sorted(topology_from_reference(tmp_path / "ref", "vae", Reading(prefix="vae.")))
    assert full == rows(wrapper)  # the module's names, all F32: the full files alone
    half = sorted(topology_from_reference(tmp_path / "ref", "vae", Reading(prefix="vae.", variant="fp16")))
    assert [r[0] for r in half] == [r[0] for r in full] and {r[1] for r in half} == {"F16"}
    with pytest.raises(UserError, match="no variant 'bf16' here; it holds fp16, full"):
        topology_from_reference(tmp_path / "ref", "vae", Reading(variant="bf16"))


def test_a_folder_of_variants_only_asks_for_one(tmp_path: Path) -> None:
    write_vae(tmp_path / "ref" / "vae")
    (tmp_path / "ref" / "vae" / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(UserError, match=r"no full \(variant-less\) files here; it holds fp16: declare"):
        topology_from_reference(tmp_path / "ref", "vae")
    assert topology_from_reference(tmp_path / "ref", "vae", Reading(variant="fp16"))


def test_names_one_prefix_apart_say_so(tmp_path: Path) -> None:
    wrapper = write_vae(tmp_path / "ref" / "vae")
    bare = topology_from_reference(tmp_path / "ref", "vae")
    why = topology_mismatch(bare, rows(wrapper))
    assert why is not None and "the names match after adding the prefix 'vae.' to the checkpoint's" in why
    why = topology_mismatch(rows(wrapper), bare)  # a checkpoint holding more than the component
    assert why is not None and "after stripping the prefix 'vae.' from the checkpoint's" in why
    other = [["x." + n, d, s] for n, d, s in bare[:-1]]  # one tensor short: no prefix explains it
    assert "prefix" not in (topology_mismatch(other, rows(wrapper)) or "")


def test_tied_tensors_a_checkpoint_omits(tmp_path: Path) -> None:
    lm = zoo_models.TiedLM()
    save_model(lm, str(tmp_path / "lm.safetensors"))  # drops lm_head.weight, records the alias
    assert sorted(topology_from_reference(tmp_path, "lm")) == rows(lm)

    state = {k: v for k, v in lm.state_dict().items() if k != "lm_head.weight"}
    (tmp_path / "bare").mkdir()
    save_file(state, str(tmp_path / "bare" / "lm.safetensors"), metadata={"format": "pt"})
    bare = topology_from_reference(tmp_path / "bare", "lm")
    assert topology_mismatch(bare, rows(lm)) == (
        "lm_head.weight: the traced module has it, the layout's topology does not"
    )
    declared = Reading(tied=(("lm_head.weight", "embed.weight"),))
    assert sorted(topology_from_reference(tmp_path / "bare", "lm", declared)) == rows(lm)
    with pytest.raises(UserError, match=r"tied to 'head\.weight', which the checkpoint does not have"):
        topology_from_reference(tmp_path / "bare", "lm", Reading(tied=(("lm_head.weight", "head.weight"),)))


# ---- the plan keys a real checkpoint's layout as it keys the trace's ------------------------------
CKPT = """
[layout.ckpt]
quant = "plain.fp32"
reference = "ckpt"
prefix = { vae = "vae." }

[family.zoo-ckpt]
entry = "zoo_models:build"
sources = ["*.py"]
skus = ["cpu"]
layouts = ["fp32", "ckpt"]

[family.zoo-ckpt.module."vae.decode"]
shapes = ["8x8"]

[family.zoo-ckpt.module.lm]
shapes = ["1x8"]
"""


def plan(ws: Path, label: str) -> subprocess.CompletedProcess[str]:
    return cli(ws, "plan", label, "--json")


@pytest.mark.slow
def test_a_save_pretrained_reference_keys_like_the_trace(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    shutil.copytree(ZOO, ws, ignore=shutil.ignore_patterns(".cgbuild", "__pycache__"))
    write_vae(ws / "ckpt" / "vae")
    save_model(zoo_models.TiedLM(), str(ws / "ckpt" / "lm.safetensors"))
    cgfile = ws / "Cgfile"
    cgfile.write_text(cgfile.read_text() + CKPT)
    proc = plan(ws, "//zoo-ckpt")
    assert proc.returncode == 0, proc.stderr
    targets = {(t["module"], t["layout"]): t for t in json.loads(proc.stdout)["targets"]}
    for module in ("vae.decode", "lm"):
        traced, ckpt = targets[(module, "fp32")], targets[(module, "ckpt")]
        assert ckpt["status"] == "mint" and ckpt["axes"]["layout"]["topology_source"] == "reference"
        assert ckpt["key"] is not None and ckpt["key"] == traced["key"]  # one topology, one key

    cgfile.write_text(cgfile.read_text().replace('prefix = { vae = "vae." }\n', ""))
    (target,) = json.loads(plan(ws, "//zoo-ckpt/vae.decode@ckpt").stdout)["targets"]
    (reason,) = [r for r in target["reasons"] if r["code"] == "layout-topology-mismatch"]
    assert target["status"] == "blocked" and "adding the prefix 'vae.'" in reason["detail"]

    cgfile.write_text(
        cgfile.read_text().replace('reference = "ckpt"\n', 'reference = "ckpt"\nprefix = { vea = "vae." }\n')
    )
    proc = plan(ws, "//zoo-ckpt")
    assert proc.returncode == 2 and "no module using layout 'ckpt' has component 'vea'" in proc.stderr


def test_reading_keys_need_a_reference(tmp_path: Path) -> None:
    from cgbuild.config import cgfile

    path = tmp_path / "Cgfile"
    base = '[sku.cpu]\nsm = "cpu"\nmemory_gib = 8\n'
    base += '[family.f]\nentry = "m:build"\nskus = ["cpu"]\nlayouts = ["l"]\n'
    base += '[family.f.module.unet]\nshapes = ["8x8"]\n'
    for extra, message in (
        ('variant = "fp16"', "'variant' says how a reference names its tensors, and this layout has none"),
        ('reference = "r"\nvariant = "fp.16"', "bad variant 'fp.16'"),
        ('reference = "r"\nprefix = { unet = "" }', "expected a tensor-name prefix"),
        ('reference = "r"\ntied = { unet = { "a" = "a" } }', "the name of the tensor 'a' is tied to"),
    ):
        path.write_text(f'[layout.l]\nquant = "plain.fp32"\n{extra}\n' + base)
        with pytest.raises(UserError, match=message.replace("(", r"\(")):
            cgfile.load(path)
    path.write_text(
        '[layout.l]\nquant = "plain.fp32"\nreference = "r"\nvariant = "fp16"\nprefix = { unet = "unet." }\n'
        + base
    )
    lay = cgfile.load(path).layouts["l"]
    assert lay.reading("unet") == Reading("unet.", "fp16") and lay.reading("vae") == Reading("", "fp16")
