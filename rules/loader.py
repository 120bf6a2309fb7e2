"""Loading an AOTI package without the slow path, and never calling it before it is bound.

`torch._inductor.aoti_load_package` first runs `get_device_information`, whose vec-ISA pick
starts ten compiler probes; in a new process that costs about 2 s and its result is only used to
log a warning. The package's C++ loader (`torch._C._aoti.AOTIModelPackageLoader`) does the real
work in milliseconds, so this module uses it directly; the host checks that the warning stood in
for are done, stricter, by `cgbuild_rules.adopt` before anything is loaded.

A weightless package called before its constants are bound segfaults (no exception, exit 139):
`Package.__call__` therefore refuses until `bind` has run. Bound tensors are user-managed (no copy:
the package reads the live module's storage), so `Package` keeps references to them for as long
as it lives.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

MODEL_NAME = "model"
# One pattern per name: a literal prefix lets `re` skip ahead, 5x faster than one alternation
# over a 2 MB libstdc++ (8 ms vs 40 ms), and this runs on every adopt.
_VERSION_RES = {
    name: re.compile(name.encode() + rb"_(\d+(?:\.\d+)+)") for name in ("GLIBC", "GLIBCXX", "CXXABI")
}


class NotBound(RuntimeError):
    """The package was called before its constants were bound (that would segfault)."""


class Package:
    """One loaded AOTI model: constant table, call spec, and a guarded call."""

    def __init__(self, pt2: str | os.PathLike[str], *, device_index: int = -1) -> None:
        self.path = os.fspath(pt2)
        self.loader = torch._C._aoti.AOTIModelPackageLoader(self.path, MODEL_NAME, False, 1, device_index)
        in_spec, out_spec = self.loader.get_call_spec()
        self.in_spec = pytree.treespec_loads(in_spec)
        self.out_spec = pytree.treespec_loads(out_spec)
        self.constant_fqns: list[str] = list(self.loader.get_constant_fqns())
        self.aoti_metadata: dict[str, str] = dict(self.loader.get_metadata())
        self._held: dict[str, torch.Tensor] | None = None

    @property
    def bound(self) -> bool:
        return self._held is not None

    def bind(self, constants: Mapping[str, torch.Tensor]) -> None:
        """Bind every constant by FQN, without copying (the caller's tensors are used in place)."""
        missing = sorted(set(self.constant_fqns) - set(constants))
        if missing:
            raise KeyError(f"no tensor for constants {missing[:5]}{' …' if len(missing) > 5 else ''}")
        held = {fqn: constants[fqn] for fqn in self.constant_fqns}
        # (map, use_inactive, check_full_update, user_managed)
        self.loader.load_constants(held, False, True, True)
        self._held = held

    def run_flat(self, flat: Sequence[torch.Tensor]) -> Any:
        """Run on already-flattened tensor inputs; returns the unflattened outputs."""
        if self._held is None:
            raise NotBound("constants are not bound: calling a weightless package now would segfault")
        return pytree.tree_unflatten(self.loader.boxed_run(list(flat)), self.out_spec)

    def flatten(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[Any] | None:
        """The call's leaves in the package's order, or None if the structure differs."""
        kw_spec = self.in_spec.child(1)
        names = list(kw_spec.context or [])
        if set(kwargs) != set(names):
            return None
        leaves, spec = pytree.tree_flatten((tuple(args), {k: kwargs[k] for k in names}))
        return leaves if spec == self.in_spec else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves = self.flatten(args, kwargs)
        if leaves is None:
            raise TypeError("call structure differs from the compiled program's inputs")
        return self.run_flat([x for x in leaves if isinstance(x, torch.Tensor)])


def state_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `module` under EVERY name it has.

    `named_parameters()` reports a tied tensor (an embedding shared with an LM head) under its
    first name only, but a package may bind it under the other: both names must resolve.
    """
    return {
        **dict(module.named_parameters(remove_duplicate=False)),
        **dict(module.named_buffers(remove_duplicate=False)),
    }


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """One tensor under two names: the same storage, offset, dtype, shape and stride."""
    return (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


def _versions(data: bytes) -> dict[str, tuple[int, ...]]:
    """Highest GLIBC / GLIBCXX / CXXABI symbol version named in a binary."""
    best: dict[str, tuple[int, ...]] = {}
    for name, pattern in _VERSION_RES.items():
        found = [tuple(int(x) for x in ver.split(b".")) for ver in pattern.findall(data)]
        if found:
            best[name] = max(found)
    return best


def required_runtime(so_bytes: bytes) -> dict[str, str]:
    """{"GLIBC": "2.34", "GLIBCXX": "3.4.30", ...}: what a package's `.so` asks of the host."""
    return {k: ".".join(map(str, v)) for k, v in sorted(_versions(so_bytes).items())}


@functools.cache
def host_runtime() -> dict[str, tuple[int, ...]]:
    """What this process provides: glibc's version and the loaded libstdc++'s symbol versions.

    A package built on a newer distribution fails to load on an older one (`GLIBC_2.38 not
    found`); comparing these with `required_runtime` names that before loading.
    """
    found: dict[str, tuple[int, ...]] = {}
    glibc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    if glibc.startswith("glibc "):
        found["GLIBC"] = tuple(int(x) for x in glibc.split()[1].split("."))
    with open("/proc/self/maps") as maps:
        libs = {line.split()[-1] for line in maps if "libstdc++" in line}
    for lib in sorted(libs):
        with open(lib, "rb") as f:
            for k, v in _versions(f.read()).items():
                if k != "GLIBC" and v > found.get(k, ()):
                    found[k] = v
    return found
