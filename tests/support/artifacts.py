"""Sealed artifacts made for a test: stand-ins sealed from scratch, and real ones edited to be
refused."""

from __future__ import annotations

import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cgbuild.store.seal import read_metadata, seal, unseal


def stand_in_metadata(key: str) -> dict[str, Any]:
    """The least sealed metadata every reader accepts (`cgbuild.store.metadata`): a store test's
    artifact is judged by the store's checks, not refused for its metadata."""
    contract = {"inputs": [], "outputs": {"leaves": []}}
    return {
        "key": key,
        "kind": "aot-inductor",
        "sm": "cpu",
        "torch": "2.13.0",
        "graph": {"digest": "0" * 64, "contract": contract},
        "toolchain": {"fold": "0" * 16},
    }


def sealed_for(tmp: Path, key: str) -> Path:
    """A real sealed artifact for `key` (a tiny zip stands in for the AOTI package)."""
    pkg = tmp / f"{key[:4]}.pt2"
    with zipfile.ZipFile(pkg, "w") as z:
        z.writestr("model/data/x", key)
    out = tmp / f"{key[:4]}.tar.gz"
    seal(out, stand_in_metadata(key), {"model.pt2": pkg})
    return out


def edited(src: Path, dest: Path, edit: Callable[[dict[str, Any]], Any]) -> Path:
    """A copy of a sealed artifact with its metadata changed by `edit(meta)`."""
    files = unseal(src, dest.with_suffix(".d"))
    meta = read_metadata(src)
    edit(meta)
    seal(dest, meta, {k: v for k, v in files.items() if k != "metadata.json"})
    return dest


HOST_READS = ("item_bool", "aoti_torch_item")
"""How AOTInductor's generated C++ reads a tensor's value on the host (a device→host sync on a GPU)."""


def compile_package(ep: Any, path: Path) -> Path:
    """`ep` AOTI-compiled under the mint's compile policy (weightless) into `path` (`model.pt2`:
    the loader reads the package's `model` folder)."""
    import platform

    import torch

    from cgbuild.core.platform import normalize_arch
    from cgbuild.identity import compiler, policy

    configs: dict[str, Any] = policy.inductor_configs(normalize_arch(platform.machine()))
    configs["cpp.cxx"] = (None, compiler.choose_cxx(None))
    torch._inductor.aoti_compile_and_package(ep, package_path=str(path), inductor_configs=configs)
    return path


def wrapper_source(pt2: Path) -> str:
    """The generated C++ that runs a package's calls (AOTInductor keeps it in the package)."""
    with zipfile.ZipFile(pt2) as z:
        (name,) = [n for n in z.namelist() if n.endswith("wrapper.cpp")]
        return z.read(name).decode()


def host_read_ops(call: Callable[[], Any]) -> set[str]:
    """The ops `call()` ran that read a tensor's value back to the host (`item`), as torch's
    profiler records them."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, torch.no_grad():
        call()
    return {e.name for e in prof.events()} & {"aten::item", "aten::_local_scalar_dense"}
