"""This host's facts against an artifact's recorded ones, checked BEFORE anything is loaded (a
package that cannot load here may segfault rather than raise): the device's sm, the torch
version, the ISA, the compiler family, the C/C++ runtime versions.
"""

from __future__ import annotations

import re

import torch
from cgbuild_rules.adopt.refusal import Refusal
from cgbuild_rules.loader import host_runtime
from torch import nn

from cgbuild.core.codes import Code
from cgbuild.identity import compiler
from cgbuild.store.sealed import Sealed


# ---- host facts --------------------------------------------------------------------------------
def device_sm(device: torch.device) -> str:
    """`cpu`, or `sm_<major><minor>` of a CUDA device: the only hardware key axis."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"sm_{major}{minor}"
    return device.type


def module_device(module: nn.Module) -> torch.device:
    for t in module.parameters():
        return t.device
    for b in module.buffers():
        return b.device
    return torch.device("cpu")


def torch_compiler_family() -> str | None:
    """The compiler family this torch was built with (from its build configuration)."""
    config = torch.__config__.show()
    if re.search(r"\bGCC\b", config):
        return "gcc"
    if re.search(r"\bclang\b", config, re.IGNORECASE):
        return "clang"
    return None


def host_refusal(sealed: Sealed, device: torch.device) -> Refusal | None:
    """The first recorded fact this host or device contradicts, checked before any load."""
    if sealed.kind != "aot-inductor":
        return Refusal(Code.BAD_ARTIFACT, f"kind {sealed.kind!r} is not an AOTInductor artifact")
    here = device_sm(device)
    if sealed.sm != here:
        return Refusal(Code.WRONG_SM, f"artifact is for {sealed.sm}, the module is on {device} ({here})")
    if sealed.torch != torch.__version__:
        return Refusal(
            Code.TORCH_VERSION,
            f"artifact was built with torch {sealed.torch}, "
            f"this process runs {torch.__version__} (packages are ABI-locked)",
        )
    isa = compiler.isa_refusal(dict(sealed.host.isa))
    if isa:
        return Refusal(Code.HOST_ISA, isa)
    family = sealed.host.cxx_family
    built_with = torch_compiler_family()
    if family and built_with and family != built_with:
        return Refusal(Code.COMPILER_FAMILY, f"package built with {family}, torch with {built_with}")
    provided = host_runtime()
    for name, need in sealed.host.runtime.items():
        want = tuple(int(x) for x in need.split("."))
        if name in provided and provided[name] < want:
            have = ".".join(map(str, provided[name]))
            return Refusal(Code.HOST_RUNTIME, f"package needs {name}_{need}, this host provides {have}")
    return None
