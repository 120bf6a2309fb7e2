"""Host-code facts the toolchain keys on: the C++ compiler and the x86-64 ISA level.

Inductor builds every package's host code (a CPU package's kernels and wrapper, a CUDA package's
wrapper `.so`) with a C++ compiler it takes from `CXX` unless told otherwise. An image once set
`CXX` to a wrapper around a separately built gcc and every package built with it segfaulted at
load. So the compiler is chosen here on purpose — the distribution's, or an explicit override —
never from `CXX`, and it is identified by what it says it is (family, version, `--version`
output), not by its path, which differs across machines.

The ISA component is the policy's clamp (`cgbuild.identity.policy.ISA_CLAMP`), not the host's own level:
the clamp fixes the emitted code, so an AVX-512 host and an AVX2 host key alike. The host level
only decides whether this host can mint the clamped code at all (`isa_refusal`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cgbuild.core import fs
from cgbuild.core.platform import normalize_arch
from cgbuild.identity import policy

DEFAULT_CXX = "/usr/bin/g++"

# Levels by the flag names /proc/cpuinfo prints (not psABI names: Linux prints LZCNT as `abm`
# and SSE3 as `pni`; a psABI-spelled table silently demotes every host to v2).
_X86_LEVELS: tuple[tuple[str, frozenset[str]], ...] = (
    ("x86-64-v2", frozenset({"cx16", "lahf_lm", "pni", "popcnt", "sse4_1", "sse4_2", "ssse3"})),
    (
        "x86-64-v3",
        frozenset({"abm", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave"}),
    ),
    ("x86-64-v4", frozenset({"avx512bw", "avx512cd", "avx512dq", "avx512f", "avx512vl"})),
)


class CompilerError(ValueError):
    """The host compiler could not be chosen or identified; `path` names the compiler tried."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


def choose_cxx(override: str | None = None, search_path: str | None = None) -> str:
    """The host C++ compiler to mint with, as an absolute path.

    `override` (the Cgfile's `[toolchain] cxx`) is a path or a name looked up on `search_path`
    (default: `PATH`). Without it: `/usr/bin/g++`, else `g++` on the search path. `CXX` is never
    read: it is exactly how a foreign compiler got into packages before.
    """
    search = os.environ.get("PATH", os.defpath) if search_path is None else search_path
    if override:
        if os.sep in override:
            if not (os.path.isfile(override) and os.access(override, os.X_OK)):
                raise CompilerError(override, "not an executable file")
            return os.path.abspath(override)
        found = shutil.which(override, path=search)
        if found is None:
            raise CompilerError(override, "not found on PATH")
        return os.path.abspath(found)
    if os.path.isfile(DEFAULT_CXX) and os.access(DEFAULT_CXX, os.X_OK):
        return DEFAULT_CXX
    found = shutil.which("g++", path=search)
    if found is None:
        raise CompilerError("g++", f"no {DEFAULT_CXX} and no g++ on PATH; set [toolchain] cxx")
    return os.path.abspath(found)


def cxx_component(path: str) -> dict[str, Any]:
    """{"family", "version", "banner", "digest"} of the compiler at `path` (runs `--version`).

    Memoised per (path, mtime, size, inode) in this process; `cgbuild.identity.toolchain` also keeps it in
    the on-disk probe cache. The digest covers the whole `--version` output, so a patched
    distribution build (its banner names the package revision) moves it.
    """
    stamp = fs.stat_stamp(path)
    if stamp is None:
        raise FileNotFoundError(path)
    return dict(_cxx_component(path, tuple(stamp)))


@functools.lru_cache(maxsize=8)
def _cxx_component(path: str, _stamp: tuple[int, ...]) -> tuple[tuple[str, str], ...]:
    # LC_ALL=C: gcc translates its banner; the identity must not depend on the locale.
    env = {"PATH": os.environ.get("PATH", os.defpath), "LC_ALL": "C"}
    try:
        proc = subprocess.run(
            [path, "--version"], capture_output=True, text=True, env=env, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CompilerError(path, f"cannot run --version: {exc}") from None
    out = proc.stdout
    if proc.returncode != 0 or not out.strip():
        raise CompilerError(path, f"--version failed (exit {proc.returncode})")
    banner = out.strip().splitlines()[0].strip()
    family, version = _identify(banner)
    if family is None or version is None:
        raise CompilerError(path, f"not recognised as gcc or clang: {banner!r}")
    digest = hashlib.sha256(out.encode()).hexdigest()
    return (("banner", banner), ("digest", digest), ("family", family), ("version", version))


def _identify(banner: str) -> tuple[str | None, str | None]:
    if m := re.search(r"clang version (\d+(?:\.\d+)*)", banner):
        return "clang", m.group(1)
    if re.match(r"(\S*-)?(g\+\+|gcc|c\+\+)(-\d+)?\s", banner) or "GCC" in banner:
        # "g++ (Debian 12.2.0-14+deb12u1) 12.2.0": the release is the last version-like token.
        versions = re.findall(r"(?<![\w.+-])(\d+\.\d+(?:\.\d+)?)(?![\w.+-])", banner)
        return "gcc", versions[-1] if versions else None
    return None, None


def x86_level(flags: Iterable[str]) -> str:
    """The highest x86-64 psABI level whose features all appear in `flags` (cpuinfo spelling)."""
    have = set(flags)
    level = "x86-64-v1"
    for name, needed in _X86_LEVELS:
        if not needed <= have:
            break
        level = name
    return level


def host_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first CPU's feature flags; stops at the first `flags` line (the file is per core)."""
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def host_isa(machine: str | None = None, cpuinfo: str = "/proc/cpuinfo") -> str:
    """This host's own level (`x86-64-vN`), or the bare architecture off x86. Never an identity."""
    arch = normalize_arch(machine or platform.machine())
    return x86_level(host_flags(cpuinfo)) if arch == "x86_64" else arch


def torch_clamps_march(paths: list[str] | None = None) -> bool:
    """Whether the installed torch's Inductor has a `cpp.march` setting (torch 2.13 does; 2.11,
    read on an H200 image, hard-codes `-march=native`). Read from its config file, never imported."""
    from importlib import metadata

    try:
        dist = next(
            iter(
                metadata.distributions(name="torch", path=paths)
                if paths is not None
                else metadata.distributions(name="torch")
            )
        )
        text = Path(str(dist.locate_file("torch/_inductor/config.py"))).read_text()
    except (StopIteration, OSError):
        return False
    return re.search(r"^\s+march\s*:", text, re.M) is not None


def isa_component(
    machine: str | None = None, *, clamps: bool = True, host_level: str | None = None
) -> dict[str, Any]:
    """{"arch", "level"}: the CLAMPED level host code is built for, independent of this host.

    A torch that cannot clamp (`clamps=False`) builds `-march=native`: then the level is KEYED
    instead — this host's own level, marked `"keyed": "host"` so such artifacts never share a key
    with clamped ones, and only hosts of that level mint them. An architecture without a declared
    clamp records level "unclamped" (and cannot mint).
    """
    arch = normalize_arch(machine or platform.machine())
    if not clamps:
        return {"arch": arch, "level": host_level or host_isa(arch), "keyed": "host"}
    clamp = policy.isa_clamp(arch)
    return {"arch": arch, "level": str(clamp["level"]) if clamp else "unclamped"}


def _rank(level: str) -> int:
    m = re.fullmatch(r"x86-64-v(\d)", level)
    return int(m.group(1)) if m else 0


def isa_refusal(
    component: dict[str, Any], host_level: str | None = None, machine: str | None = None
) -> str | None:
    """Why this host cannot mint code for the ISA `component`, or None when it can.

    Below the clamp, Inductor's vec-ISA probe rejects the clamped ISA and falls back to scalar
    code without an error: different bytes under the same key. So the mint refuses instead.
    `host_level` and `machine` default to this host's.
    """
    arch = str(component.get("arch", ""))
    level = str(component.get("level", ""))
    if level == "unclamped":
        return f"no host ISA clamp is declared for {arch}: its code would be -march=native"
    here = normalize_arch(machine or platform.machine())
    if here != arch:
        return f"host is {here}, the toolchain builds {arch} code"
    host = host_level if host_level is not None else host_isa(here)
    if component.get("keyed") == "host" and host != level:
        return f"host ISA {host} differs from the keyed level {level} (this torch builds -march=native)"
    if _rank(host) < _rank(level):
        return f"host ISA {host} is below the clamp {level}"
    return None
