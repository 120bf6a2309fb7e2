"""The one sealed compile policy: the Inductor settings and the environment every mint applies.

Declared here as plain data (no torch) so the engine can key on it at plan time and the mint
applies exactly what was keyed. `settings_block()` is the toolchain's `settings` component: any
change to this module's declarations moves every fold, on purpose ("the compiler as we configure
it"). Only integers, strings and booleans: identity blocks refuse floats (`cgbuild.core.canon`).

How the x86 host-code clamp is made to take effect (read from torch 2.13's
`_inductor/config.py`, `cpu_vec_isa.py` and `cpp_builder.py`, then checked by a real compile):

* The compiler flag comes from `cpp.march`: unset means `-march=native`, so a package built on an
  AVX-512/AMX host carries those instructions and dies with SIGILL on an older one. Setting
  `cpp.march = "x86-64-v3"` emits `-march=x86-64-v3` for both the kernel and the wrapper `.so`.
* The vectorised code Inductor writes comes from `pick_vec_isa()`: with `cpp.simdlen` set it takes
  the host-supported ISA of that bit width, so `cpp.simdlen = 256` picks AVX2 (`-mavx2 -mfma
  -mf16c`, `CPU_CAPABILITY_AVX2`) even on an AMX host; the AMX/AVX-512 micro-GEMMs are skipped
  because they are chosen by the picked ISA's class.
* `ATEN_CPU_CAPABILITY` is NOT a clamp: it is read only while `cpp.simdlen` is None, leaves
  `-march=native` in place, and also changes ATen's eager dispatch in the mint process. It is
  scrubbed from the mint environment instead.
* Checked on torch 2.13.0+cpu, tiny MLP: the clamped package's sources say `-march=x86-64-v3 -mavx2`,
  its metadata `AOTI_CPU_ISA: "AVX2"`, and its `.so` has no zmm register; the default build of the
  same graph says `-march=native`.

A host below the clamp cannot mint the clamped code (its vec-ISA probe rejects AVX2 and Inductor
silently falls back to scalar code): `cgbuild.identity.compiler.isa_refusal` says so before any compile.

CPU code also specialises on the compiling host's thread count (`parallel_num_threads()` decides
parallel depth and bakes `num_threads(N)` into kernels), so two machines with one toolchain would
emit different kernels. `cpp.dynamic_threads` keeps the count a runtime value, and `cpp.threads`
fixes the count the heuristics plan for, whatever the mint host has. Checked: one graph compiled
under OMP_NUM_THREADS=1 and =2 gives different kernels by default, and the same kernels (comments
aside) with these two settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from cgbuild.core.platform import normalize_arch

SCHEME: Final = "cgbuild.policy/1"

# The x86-64 psABI level host code is clamped to, and the Inductor knobs that enforce it. Above
# v3 nothing is gained that a fleet can rely on; one v3 artifact serves AVX2 and AVX-512 hosts.
ISA_CLAMP: Final[Mapping[str, Mapping[str, str | int]]] = {
    "x86_64": {"level": "x86-64-v3", "march": "x86-64-v3", "simdlen": 256},
}

# Inductor/AOTInductor settings, by their `torch._inductor.config` names. `aot_inductor.package`
# is left out: the packaging API sets it itself. `cpp.cxx` is set by the mint to the chosen host
# compiler; its identity is the toolchain's `cxx` component, never a path.
_INDUCTOR: Final[Mapping[str, bool | int | str]] = {
    # Weightless: constants are bound at adopt from the live module, never packaged.
    "aot_inductor.package_constants_in_so": False,
    # Keep small tensor constants as named, bindable constants instead of folding them into code.
    "always_keep_tensor_constants": True,
    # Folded constants would be derived from weights the package must not depend on.
    "aot_inductor.use_runtime_constant_folding": False,
    # See the module docstring: thread count is a runtime value, heuristics plan for a fixed one.
    "cpp.dynamic_threads": True,
    "cpp.threads": 8,
}

# Mint environment. Scrubbed: anything that changes what Inductor, Triton, nvcc or the host
# compiler emit, or where they look for headers and libraries. A deny-list rather than an
# allow-list because a GPU mint needs the driver's own environment (LD_LIBRARY_PATH for
# libcuda, CUDA_VISIBLE_DEVICES) to pass untouched.
SCRUB_PREFIXES: Final = (
    "GOMP_",
    "KMP_",
    "MKL_",
    "NVCC_",
    "OMP_",
    "TORCHDYNAMO_",
    "TORCHINDUCTOR_",
    "TORCH_COMPILE_",
    "TORCH_INDUCTOR_",
    "TRITON_",
)
SCRUB_NAMES: Final = (
    "ATEN_CPU_CAPABILITY",
    "CC",
    "CFLAGS",
    "COMPILER_PATH",
    "CONDA_PREFIX",
    "CPATH",
    "CPLUS_INCLUDE_PATH",
    "CPP",
    "CPPFLAGS",
    "CUDACXX",
    "CUDA_HOME",
    "CUDA_INC_PATH",
    "CUDA_PATH",
    "CXX",
    "CXXFLAGS",
    "C_INCLUDE_PATH",
    "GCC_EXEC_PREFIX",
    "LDFLAGS",
    "LD_PRELOAD",
    "LIBRARY_PATH",
    "PYTORCH_NVCC",
    "TEMP",
    "TMP",
    "TMPDIR",
    "TORCH_CUDA_ARCH_LIST",
)
# Let through although they match a scrubbed prefix: Triton's ptxas overrides. They are not
# trusted blindly: the toolchain's `ptxas` component records the bytes they point at.
PASS_RECORDED: Final = ("TRITON_PTXAS_BLACKWELL_PATH", "TRITON_PTXAS_PATH")
# Set to fixed values.
SET: Final[Mapping[str, str]] = {
    "LC_ALL": "C",
    "PYTHONHASHSEED": "0",
    "SOURCE_DATE_EPOCH": "0",
    "TZ": "UTC",
}
# Set by the mint to paths of its own sandbox (fixed paths under `mint --check`).
SANDBOX: Final = ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


class PolicyError(ValueError):
    """The policy has nothing declared for what was asked (e.g. an unclamped architecture)."""


def isa_clamp(arch: str) -> Mapping[str, str | int] | None:
    """The clamp declared for `arch` (a `platform.machine()` spelling), or None if there is none."""
    return ISA_CLAMP.get(normalize_arch(arch))


def inductor_configs(arch: str = "x86_64", *, clamps: bool = True) -> dict[str, bool | int | str]:
    """The `inductor_configs` a mint passes to the packaging API on `arch` (the clamp included).

    Refuses an architecture with no declared clamp: unclamped host code would be `-march=native`,
    an artifact keyed on nothing the plan can know.
    """
    if isa_clamp(arch) is None:
        raise PolicyError(f"no host ISA clamp is declared for {arch!r}")
    return _inductor(arch, clamps)


def _inductor(arch: str, clamps: bool = True) -> dict[str, bool | int | str]:
    """The knobs; without `cpp.march` in this torch (`clamps=False`) the level is keyed instead."""
    clamp = isa_clamp(arch)
    if clamp is None:
        return dict(_INDUCTOR)
    if not clamps:
        return {**_INDUCTOR, "cpp.simdlen": clamp["simdlen"]}
    return {**_INDUCTOR, "cpp.march": clamp["march"], "cpp.simdlen": clamp["simdlen"]}


def settings_block(arch: str = "x86_64", *, clamps: bool = True) -> dict[str, Any]:
    """The `settings` toolchain component: every declared knob and the mint environment.

    On an architecture with no declared clamp the block simply lacks the clamp knobs; such a host
    is refused at mint by `cgbuild.identity.compiler.isa_refusal`, never silently built `-march=native`.
    """
    return {
        "scheme": SCHEME,
        "inductor": _inductor(arch, clamps),
        "env": {
            "scrub_prefixes": list(SCRUB_PREFIXES),
            "scrub": list(SCRUB_NAMES),
            "pass_recorded": list(PASS_RECORDED),
            "set": dict(SET),
            "sandbox": list(SANDBOX),
        },
    }


def mint_environment(environ: Mapping[str, str], sandbox: Mapping[str, str]) -> dict[str, str]:
    """The environment a mint child starts with: `environ` scrubbed, declared values set.

    `sandbox` must name exactly the `SANDBOX` variables (the mint's own temp and cache folders),
    so no compile ever falls back to a shared default cache or `/tmp`.
    """
    if set(sandbox) != set(SANDBOX):
        raise PolicyError(f"sandbox must set exactly {', '.join(SANDBOX)}; got {', '.join(sorted(sandbox))}")
    env = {
        name: value
        for name, value in environ.items()
        if name in PASS_RECORDED or not (name in SCRUB_NAMES or name.startswith(SCRUB_PREFIXES))
    }
    env.update(SET)
    env.update(sandbox)
    return env
