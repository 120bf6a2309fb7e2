"""Platform facts every layer agrees on: an sm's device kind and number, the host's names.

Each fact has this one producer. A second spelling (`"cpu" if sm == "cpu" else "cuda"` written
again elsewhere) could drift from it and then key, trace or refuse for the wrong device.
"""

from __future__ import annotations

import re
import socket

CPU = "cpu"
CUDA = "cuda"
_SM = re.compile(r"sm_([0-9]{2,3})[a-z]?")
_X86_SPELLINGS = frozenset({"x86_64", "AMD64", "amd64"})


def device_of(sm: str) -> str:
    """The device kind a target of `sm` runs on (the `platform` its toolchain is resolved for)."""
    return CPU if sm == CPU else CUDA


def sm_number(sm: str) -> int | None:
    """`sm_90` → 90, `sm_90a` → 90, `cpu` (or anything else) → None."""
    m = _SM.fullmatch(sm)
    return int(m.group(1)) if m else None


def normalize_arch(machine: str) -> str:
    """One spelling per architecture (`platform.machine()` says AMD64 on some hosts)."""
    return "x86_64" if machine in _X86_SPELLINGS else machine


def host_name() -> str:
    """This host's name, safe as a file name (lane evidence is filed under it)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()).lstrip(".")
    return name or "host"
