"""Adopt: serve a live module through its sealed artifacts, compiled when a call fits, else eager.

`adopt(artifact, module)` checks the artifact's recorded facts against this host BEFORE loading
anything (a package that cannot load here may segfault rather than raise): the device (`sm`),
the torch version (a package is ABI-locked to one torch), the host ISA (the host must support the
clamp level the code was built for), the host compiler family and the C/C++ runtime versions the
package's `.so` requires. It then loads through the package's C++ loader (milliseconds; the
Python `aoti_load_package` adds a ~2 s ISA probe per process), and binds the live module's
weights by FQN without copying, after checking every tensor's dtype, shape, stride and device
against the table the mint recorded.

Nothing on the call path raises because of the artifact: a refused artifact, a call outside its
contract (shapes, dtypes, devices, symbol ranges) or a compiled call that fails is served eager,
and the reason is named and counted. `adopt_manifest` adopts every graph class of a module in one
call and routes each call to the artifact whose contract fits.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from cgbuild_rules import configured
from cgbuild_rules.bound import (
    ADAPTER_HINT,
    Moved,
    Structure,
    Watch,
    adapter_wrapped,
    structure,
    structure_moved,
)
from cgbuild_rules.lanes import bindings, device_memory_bytes
from cgbuild_rules.loader import Package, host_runtime, same_view, state_tensors
from cgbuild_rules.weights import ALIGN
from torch import nn
from torch.utils import _pytree as pytree

from cgbuild import lanes
from cgbuild.core.codes import Code
from cgbuild.identity import compiler
from cgbuild.identity.layout import safetensors_dtype
from cgbuild.lanes import Refit
from cgbuild.protocol.manifest import Entry as ManifestEntry
from cgbuild.protocol.manifest import read as read_manifest
from cgbuild.store.local import Store, StoreError
from cgbuild.store.metadata import metadata_problem
from cgbuild.store.s3 import RemoteError
from cgbuild.store.seal import LITERALS, PACKAGE, SealError, read_metadata, unseal
from cgbuild.store.shared import SharedStore

log = logging.getLogger("cgbuild.adopt")


class AdoptRefused(RuntimeError):
    """Raised only with `strict=True`: the artifact cannot serve on this host or for this module."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(f"{refusal.code}: {refusal.detail}")
        self.refusal = refusal


@dataclass(frozen=True)
class Refusal:
    """Why an artifact (or one call) is served eager: a stable `code` and a sentence."""

    code: Code
    detail: str


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


def host_refusal(meta: Mapping[str, Any], device: torch.device) -> Refusal | None:
    """The first recorded fact this host or device contradicts, checked before any load."""
    if meta.get("kind") != "aot-inductor":
        return Refusal(Code.BAD_ARTIFACT, f"kind {meta.get('kind')!r} is not an AOTInductor artifact")
    here = device_sm(device)
    if meta.get("sm") != here:
        return Refusal(Code.WRONG_SM, f"artifact is for {meta.get('sm')}, the module is on {device} ({here})")
    if meta.get("torch") != torch.__version__:
        return Refusal(
            Code.TORCH_VERSION,
            f"artifact was built with torch {meta.get('torch')}, "
            f"this process runs {torch.__version__} (packages are ABI-locked)",
        )
    host = meta.get("host") or {}
    isa = compiler.isa_refusal(host.get("isa") or {})
    if isa:
        return Refusal(Code.HOST_ISA, isa)
    family = (host.get("cxx") or {}).get("family")
    built_with = torch_compiler_family()
    if family and built_with and family != built_with:
        return Refusal(Code.COMPILER_FAMILY, f"package built with {family}, torch with {built_with}")
    provided = host_runtime()
    for name, need in (host.get("runtime") or {}).items():
        want = tuple(int(x) for x in need.split("."))
        if name in provided and provided[name] < want:
            have = ".".join(map(str, provided[name]))
            return Refusal(Code.HOST_RUNTIME, f"package needs {name}_{need}, this host provides {have}")
    return None


# ---- call contracts ----------------------------------------------------------------------------
def _dim_value(expr: str, bound: Mapping[str, int]) -> int | None:
    """Evaluate a rendered size (`7`, `S0`, `2*S0`, `S0 + 1`); None if it is not that simple."""
    total = 0
    for term in expr.replace(" ", "").split("+"):
        prod = 1
        for factor in term.split("*"):
            if factor.isdigit():
                prod *= int(factor)
            elif factor in bound:
                prod *= bound[factor]
            else:
                return None
        total += prod
    return total


def _contiguous(shape: list[int]) -> list[int]:
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= max(size, 1)
    return out[::-1]


def _as_traced(g: torch.Tensor, want: list[int]) -> torch.Tensor | None:
    """`g` itself when the package may read it as traced (the strides it was traced with on
    every dimension longer than one, an aligned start), else a copy laid out that way; None
    for an input that cannot be laid out so (overlapping traced strides)."""
    if g.numel() == 0:
        return g
    same = all(n <= 1 or s == w for n, s, w in zip(g.shape, g.stride(), want, strict=True))
    if same and g.data_ptr() % ALIGN == 0:
        return g
    try:
        out = torch.empty_strided(g.shape, want, dtype=g.dtype, device=g.device)
    except RuntimeError:
        return None
    return out.copy_(g)


def fit(
    contract: Mapping[str, Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    restrided: list[str] | None = None,
) -> tuple[Refusal | None, list[Any]]:
    """Does this call fit the contract? Returns (why not, or None) and the call's leaves in order.

    A package reads each input with the strides it was traced with, unchecked: an expanded
    (stride-0), transposed, sliced or channels-last view would be read as if laid out as traced.
    So an input whose strides (on dimensions longer than one) or 16-byte alignment differ is
    copied into the traced layout first, its name appended to `restrided`. Artifacts sealed
    before the contract recorded strides were traced with contiguous inputs (every entry then
    built them so) and are held to that.
    """
    inputs = contract.get("inputs") or []
    positional = [i for i in inputs if not i.get("keyword")]
    keywords = {i["name"] for i in inputs if i.get("keyword")}
    if len(args) != len(positional) or set(kwargs) != keywords:
        takes = f"{len(positional)} positional + {sorted(keywords)}"
        return Refusal(
            Code.CALL_STRUCTURE,
            f"call passes {len(args)} positional + {sorted(kwargs)}, artifact takes {takes}",
        ), []
    bounds = {s["name"]: (s.get("min"), s.get("max")) for s in contract.get("symbols") or []}
    bound: dict[str, int] = {}
    leaves: list[Any] = []
    pending: list[tuple[str, str, int]] = []
    tensors: list[tuple[str, torch.Tensor, Mapping[str, Any]]] = []
    positions: list[int] = []
    arg_iter = iter(args)
    for spec in inputs:
        value = kwargs[spec["name"]] if spec.get("keyword") else next(arg_iter)
        got = pytree.tree_leaves(value)
        want = spec.get("leaves") or []
        if len(got) != len(want):
            return Refusal(
                Code.CALL_STRUCTURE, f"{spec['name']}: {len(got)} leaves, artifact takes {len(want)}"
            ), []
        for j, (g, w) in enumerate(zip(got, want, strict=True)):
            where = f"{spec['name']}" + (f"[{j}]" if len(want) > 1 else "")
            if not isinstance(w, dict):
                if isinstance(g, torch.Tensor) or g != w:
                    return Refusal(Code.CONSTANT_ARG, f"{where}: {g!r} where the program baked {w!r}"), []
                leaves.append(g)
                continue
            if not isinstance(g, torch.Tensor):
                return Refusal(Code.NOT_A_TENSOR, f"{where}: {type(g).__name__}, artifact takes a tensor"), []
            dtype = str(g.dtype).removeprefix("torch.")
            if dtype != w["dtype"]:
                return Refusal(Code.DTYPE, f"{where}: {dtype}, artifact takes {w['dtype']}"), []
            if g.device.type != w["device"]:
                return Refusal(Code.DEVICE, f"{where}: on {g.device.type}, artifact takes {w['device']}"), []
            if g.dim() != len(w["shape"]):
                return Refusal(Code.SHAPE, f"{where}: rank {g.dim()}, artifact takes {len(w['shape'])}"), []
            for axis, (size, dim) in enumerate(zip(g.shape, w["shape"], strict=True)):
                if isinstance(dim, int):
                    if size != dim:
                        return Refusal(Code.SHAPE, f"{where} dim {axis}: {size}, artifact takes {dim}"), []
                elif dim in bounds:
                    lo, hi = bounds[dim]
                    if bound.setdefault(dim, size) != size:
                        return Refusal(Code.SHAPE, f"{where} dim {axis}: {size}, but {dim} = {bound[dim]}"), []
                    if (lo is not None and size < lo) or (hi is not None and size > hi):
                        return Refusal(
                            Code.SYMBOL_RANGE, f"{where} dim {axis}: {size} outside {dim} ∈ [{lo}, {hi}]"
                        ), []
                else:
                    pending.append((f"{where} dim {axis}", dim, size))
            positions.append(len(leaves))
            tensors.append((where, g, w))
            leaves.append(g)
    for where, expr, size in pending:
        value = _dim_value(expr, bound)
        if value is None:
            return Refusal(Code.SHAPE, f"{where}: size {expr!r} is not checkable here"), []
        if value != size:
            return Refusal(Code.SHAPE, f"{where}: {size}, artifact takes {expr} = {value}"), []
    for i, (where, g, w) in enumerate(tensors):
        recorded = w.get("stride")
        shape = list(g.shape)
        want = _contiguous(shape) if recorded is None else [_dim_value(str(d), bound) for d in recorded]
        if any(d is None for d in want) or len(want) != g.dim():
            return Refusal(Code.STRIDE, f"{where}: traced strides {recorded} are not checkable here"), []
        laid = _as_traced(g, want)  # type: ignore[arg-type]
        if laid is None:
            return Refusal(Code.STRIDE, f"{where}: cannot lay out {shape} with traced strides {want}"), []
        if laid is not g:
            leaves[positions[i]] = laid
            if restrided is not None:
                restrided.append(where)
    return None, leaves


# ---- artifacts ---------------------------------------------------------------------------------
@dataclass
class Artifact:
    """One sealed artifact as adopted for a module: armed (`package` set) or refused."""

    key: str
    label: str
    metadata: dict[str, Any]
    package: Package | None = None
    refusal: Refusal | None = None
    literals: dict[str, torch.Tensor] = field(default_factory=dict)
    seconds: float = 0.0
    lane: Refit | None = None
    """The kernel lane bound before the first call and why (None: the artifact has no lanes)."""
    watch: Watch | None = None
    """What the package is bound to; while refused for a binding reason, the module as refused
    (nothing is retried until something in it moves)."""
    baseline: Structure | None = None
    """The module tree as first bound: a re-arm requires the live tree to be it again."""
    unverified: tuple[str, ...] = ()
    """Checks this artifact cannot support (`config`: sealed before the configuration record)."""
    check_config: bool = True
    """False for a checkpoint's tensors: no model code, so no configuration beside the program's."""
    reload: Callable[[nn.Module], Artifact] | None = None
    """Load it again (an artifact refused before its package was loaded is re-armed so)."""

    @property
    def contract(self) -> dict[str, Any]:
        return self.metadata.get("graph", {}).get("contract", {})

    @property
    def dynamic(self) -> bool:
        return bool(self.contract.get("symbols"))


def _weights(
    module: nn.Module, meta: Mapping[str, Any], device: torch.device, names: Collection[str]
) -> tuple[dict[str, torch.Tensor], Refusal | None]:
    """The live module's tensors for the state constants the package binds (`names`), each
    checked; no copies.

    Only what the package names is bound and checked: artifacts sealed before the table was cut
    to the package's own constants list every tensor the export lifted (unused ones included).
    A row's `aliases` were the same tensor at mint (tied weights): the program reads them through
    the bound name, so each must still be that tensor in the live module (`weights-untied`).
    """
    live = state_tensors(module)
    out: dict[str, torch.Tensor] = {}
    for row in (meta.get("constants") or {}).get("state", []):
        fqn = row["fqn"]
        if fqn not in names:
            continue
        t = live.get(fqn)
        if t is None:
            return {}, Refusal(Code.WEIGHTS_MISSING, f"the module has no tensor {fqn!r}")
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype != row["dtype"]:
            return {}, Refusal(Code.WEIGHTS_MISMATCH, f"{fqn}: dtype {dtype}, artifact takes {row['dtype']}")
        if list(t.shape) != row["shape"]:
            return {}, Refusal(
                Code.WEIGHTS_MISMATCH, f"{fqn}: shape {list(t.shape)}, artifact takes {row['shape']}"
            )
        if list(t.stride()) != row["stride"]:
            return {}, Refusal(
                Code.WEIGHTS_MISMATCH,
                f"{fqn}: stride {list(t.stride())}, artifact takes {row['stride']} (never repacked silently)",
            )
        if t.device.type != device.type:
            return {}, Refusal(
                Code.WEIGHTS_MISMATCH, f"{fqn}: on {t.device}, the artifact runs on {device.type}"
            )
        for alias in row.get("aliases", []):
            other = live.get(alias)
            if other is None or not same_view(t, other):
                held = "no such tensor" if other is None else "a separate tensor"
                return {}, Refusal(
                    Code.WEIGHTS_UNTIED,
                    f"{alias} was tied to {fqn} at mint and the program reads it through {fqn}; "
                    f"the module holds {held}",
                )
        out[fqn] = t.detach()
    return out, None


def _attribute(module: nn.Module, fqn: str) -> torch.Tensor | None:
    """The tensor the live module holds at `fqn` (a buffer or a plain attribute), if any."""
    prefix, _, name = fqn.rpartition(".")
    try:
        owner = module.get_submodule(prefix) if prefix else module
    except AttributeError:
        return None
    value = getattr(owner, name, None)
    return value if isinstance(value, torch.Tensor) else None


def _literals(
    module: nn.Module, meta: Mapping[str, Any], sealed: Mapping[str, torch.Tensor], names: Collection[str]
) -> tuple[dict[str, torch.Tensor], Refusal | None]:
    """The trace-baked literals the package binds (non-persistent buffers, tensor attributes).

    The program was traced, digested and verified with the sealed values. A live module that
    holds the same value at that FQN has it bound in place (no copy: in-place updates reach
    both paths); one that holds another value would compute something else eager, so the
    artifact is refused (`literal-mismatch`); a literal the module does not hold (a constant
    created in `forward`) is bound from the artifact. Lane switches are the lane choice's to
    bind and are not compared.
    """
    switches = {r["fqn"] for r in (meta.get("lanes") or {}).get("axes") or []}
    out: dict[str, torch.Tensor] = {}
    for fqn, value in sealed.items():
        if fqn not in names:
            continue
        t = None if fqn in switches else _attribute(module, fqn)
        if t is None:
            out[fqn] = value
            continue
        same_value = t.dtype == value.dtype and t.shape == value.shape
        if not same_value or not torch.equal(t.detach().to(value.device), value):
            return {}, Refusal(
                Code.LITERAL_MISMATCH,
                f"{fqn}: the module holds another value than the one the program was traced with "
                f"({str(t.dtype).removeprefix('torch.')}{list(t.shape)})",
            )
        same = t.device == value.device and t.stride() == value.stride()
        out[fqn] = t.detach() if same else value
    return out, None


def _bindings(
    art: Artifact, package: Package, module: nn.Module, device: torch.device
) -> tuple[dict[str, torch.Tensor], Refusal | None]:
    """Everything the package binds, by FQN: live weights and literals, checked; no copies."""
    names = set(package.constant_fqns)
    weights, refusal = _weights(module, art.metadata, device, names)
    if refusal:
        return {}, refusal
    literals, refusal = _literals(module, art.metadata, art.literals, names)
    return ({}, refusal) if refusal else ({**weights, **literals}, None)


def config_refusal(meta: Mapping[str, Any], module: nn.Module) -> Refusal | None:
    """The first configuration value the live module holds otherwise than the module the
    artifact was minted from (`config-drift`; `cgbuild_rules.configured`), or None."""
    recorded = meta.get("module")
    if not isinstance(recorded, Mapping):
        return None
    why = configured.drift(recorded, module)
    return Refusal(Code.CONFIG_DRIFT, why) if why else None


def layout_refusal(meta: Mapping[str, Any], module: nn.Module) -> Refusal | None:
    """The first tensor (by name) of the artifact's layout that the live module lacks or holds
    with another dtype or shape, checked before anything is loaded or bound.

    The table is the layout's topology sealed at mint (reference headers or the traced state
    dict, quantized tensors included), so a plain module offered to an int8 artifact is refused
    as `layout-mismatch` naming its first float weight, not as an opaque bind failure.
    Artifacts sealed without a layout table are checked by their constant table alone.
    """
    block = meta.get("layout") or {}
    rows = block.get("tensors") or []
    if not rows:
        return None
    live = state_tensors(module)
    stamp = block.get("stamp") or "the artifact's layout"
    rule = (block.get("rule") or {}).get("name")
    hint = ""
    if rule and not str(rule).startswith("plain."):
        hint = f" (quantize it first: cgbuild_rules.quant.convert(module, {rule!r}, dtype))"
    for name, dtype, shape in sorted(rows):
        t = live.get(name)
        if t is None:
            return Refusal(Code.LAYOUT_MISMATCH, f"{stamp}: the module has no tensor {name!r}{hint}")
        have = safetensors_dtype(str(t.dtype).removeprefix("torch."))
        if have != dtype or list(t.shape) != list(shape):
            here, there = f"{have}{list(t.shape)}", f"{dtype}{list(shape)}"
            return Refusal(
                Code.LAYOUT_MISMATCH, f"{stamp}: {name} is {here} in the module, {there} in the layout{hint}"
            )
    return None


def choose_lane(
    meta: Mapping[str, Any], device: torch.device, *, memory_bytes: int | None = None, pin: str | None = None
) -> tuple[Refit | None, dict[str, torch.Tensor]]:
    """The lane this device serves and the switch values that bind it (docs/lanes.md).

    Re-applies the fit rule to THIS device's memory (`memory_bytes` overrides it: a smaller card,
    a share of a larger one) on the peaks the mint recorded, rounded up: `lane-adopted`,
    `lane-refit`, `lane-refit-no-fit` or `lane-unverified`. `pin` names a lane to serve instead
    (`lane-pinned`); it must be one the artifact carries. Never re-benchmarks.
    """
    block = meta.get("lanes")
    if not block or not block.get("axes"):
        return None, {}
    rows = block["axes"]
    axes = [r["axis"] for r in rows]
    carried = lanes.combinations([(r["axis"], r["values"]) for r in rows])
    if pin is not None:
        if pin not in carried:
            raise ValueError(f"lane {pin!r} is not in this artifact (it carries {', '.join(carried)})")
        choice = Refit(pin, Code.LANE_PINNED, f"{pin}: pinned by the caller")
    else:
        memory = memory_bytes if memory_bytes is not None else device_memory_bytes(device)
        choice = lanes.refit(block["verdict"], memory)
    return choice, bindings(rows, lanes.split(choice.lane, axes), device)


def _arm(
    art: Artifact,
    files: Mapping[str, Path],
    module: nn.Module,
    device: torch.device,
    memory_bytes: int | None = None,
    pin: str | None = None,
) -> None:
    if LITERALS in files:
        from safetensors.torch import load_file

        try:
            art.literals = {k: v.to(device) for k, v in load_file(str(files[LITERALS])).items()}
        except Exception as e:  # safetensors' own error type: the literals file is not one
            art.refusal = Refusal(Code.BAD_LITERALS, f"{LITERALS}: {type(e).__name__}: {e}")
            return
    art.lane, switch = choose_lane(art.metadata, device, memory_bytes=memory_bytes, pin=pin)
    art.literals.update(switch)  # bound with the rest below: before the first call, kept by rebind
    if art.lane is not None:
        log.info("%s: lane %s (%s: %s)", art.label, art.lane.lane, art.lane.code, art.lane.detail)
    try:
        package = Package(files[PACKAGE], device_index=device.index if device.index is not None else -1)
    except Exception as e:
        art.refusal = Refusal(Code.LOAD_FAILED, f"{type(e).__name__}: {e}")
        return
    table = {
        r["fqn"]
        for group in ("state", "literal")
        for r in (art.metadata.get("constants") or {}).get(group, [])
    }
    # The package's list is the truth of what it binds; the sealed table must describe each
    # (dtype, shape, stride to check). A table naming more is an artifact sealed before the
    # table was cut to the package's list: the extra rows are never bound.
    extra = sorted(set(package.constant_fqns) - table)
    if extra:
        art.refusal = Refusal(
            Code.CONSTANT_TABLE_MISMATCH, f"package binds {extra[:3]} that the sealed table does not describe"
        )
        return
    if refusal := _bind_live(art, package, module, device):
        art.refusal = refusal
        return
    art.package = package
    art.baseline = structure(module)


def _bind_live(art: Artifact, package: Package, module: nn.Module, device: torch.device) -> Refusal | None:
    """Bind `package` to the live module's tensors and watch them, when they and the module's
    configuration match the artifact; else the first reason they do not (an unfused adapter named)."""
    bound, refusal = _bindings(art, package, module, device)
    if refusal is None and art.check_config:
        refusal = config_refusal(art.metadata, module)
    if refusal is not None:
        return Refusal(refusal.code, f"{refusal.detail}{_adapter_hint(module)}")
    package.bind(bound)
    art.watch = _watch(art, module, bound)
    return None


def _watch(art: Artifact, module: nn.Module, bound: Collection[str]) -> Watch:
    """A watch over the bound names and every alias the table records for them."""
    names = set(bound)
    for row in (art.metadata.get("constants") or {}).get("state", []):
        if row["fqn"] in names:
            names.update(row.get("aliases", []))
    return Watch(module, names)


def load_artifact(
    source: str | os.PathLike[str],
    module: nn.Module,
    *,
    store: Store | SharedStore | None = None,
    label: str | None = None,
    memory_bytes: int | None = None,
    lane: str | None = None,
    check_config: bool = True,
) -> Artifact:
    """Resolve, check and arm one artifact for `module`; a refusal is recorded, never raised.

    `check_config=False` skips the configuration record (a checkpoint's tensors have none: the
    program is the artifact's own).

    `memory_bytes` / `lane`: the lane re-fit's device memory override and a pinned lane
    (`choose_lane`); a pinned lane the artifact does not carry raises ValueError. A
    `SharedStore` pulls a missing key first and refuses an artifact no trusted publisher signed
    (`unsigned`, `unknown-signer`, `bad-signature`), from the remote and from its cache alike.
    """
    t = time.perf_counter()
    device = module_device(module)
    key = str(source)
    path = Path(source)
    try:
        if store is not None:
            path = store.resolve(key, verify=True).path
        meta = read_metadata(path)
    except (StoreError, RemoteError, SealError, OSError, ValueError) as e:
        code = getattr(e, "code", Code.BAD_ARTIFACT)
        return Artifact(
            key, label or key[:12], {}, refusal=Refusal(code, str(e)), seconds=time.perf_counter() - t
        )
    art = Artifact(str(meta.get("key")), label or str(meta.get("key", ""))[:12], meta)
    if problem := metadata_problem(meta):
        art.refusal = Refusal(Code.BAD_METADATA, f"{path}: {problem}")
    elif store is not None and art.key != key:
        art.refusal = Refusal(
            Code.KEY_MISMATCH, f"store key {key[:12]} holds an artifact that says {art.key[:12]}"
        )
    else:
        art.refusal = host_refusal(meta, device) or layout_refusal(meta, module)
        if art.refusal is not None and art.refusal.code in REARMABLE:
            art.refusal = Refusal(art.refusal.code, f"{art.refusal.detail}{_adapter_hint(module)}")
    art.check_config = check_config
    if check_config and not isinstance(meta.get("module"), Mapping):
        art.unverified = ("config",)
        log.info("%s: sealed without a configuration record: its configuration is unverified", art.label)
    art.reload = functools.partial(
        load_artifact,
        source,
        store=store,
        label=label,
        memory_bytes=memory_bytes,
        lane=lane,
        check_config=check_config,
    )
    if art.refusal is None:
        scratch = Path(tempfile.mkdtemp(prefix="cgbuild-adopt-"))
        try:
            _arm(art, unseal(path, scratch), module, device, memory_bytes, lane)
        except SealError as e:  # a member, or an entry of the package, that must not be unpacked
            art.refusal = Refusal(e.code, str(e))
        except (RuntimeError, OSError) as e:  # constants the package would not take
            art.refusal = Refusal(Code.LOAD_FAILED, f"{type(e).__name__}: {e}")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)  # the loader has its own copy by now
    art.seconds = time.perf_counter() - t
    return art


REARMABLE = frozenset(
    {
        Code.MODULE_CHANGED,
        Code.CONFIG_DRIFT,
        Code.LAYOUT_MISMATCH,
        Code.WEIGHTS_MISSING,
        Code.WEIGHTS_MISMATCH,
        Code.WEIGHTS_UNTIED,
        Code.LITERAL_MISMATCH,
    }
)
"""Refusals for what the live module holds: `rebind()` (or, once the package is loaded, the
next call after the module moves) re-arms the artifact when the module matches it again."""


class Adopted:
    """A module served through its artifacts: `__call__` runs compiled when a call fits one, else
    eager, naming and counting the reason. Never raises because of an artifact.

    Before each compiled call the artifact's watch (`cgbuild_rules.bound`) proves the module
    still holds what the package was bound to. When something moved, the artifact is re-bound
    on the spot if the module still matches it (counted `rebound`), else refused for this call
    and the next (`module-changed`, naming what moved and why it cannot be re-bound) until the
    module matches again. A call whose inputs are laid out otherwise than traced is served on
    copies laid out as traced (counted `restrided`).
    """

    def __init__(self, module: nn.Module, artifacts: Iterable[Artifact], *, strict: bool = False) -> None:
        self.module = module
        self.strict = strict
        # strict: raise AdoptRefused instead of serving a call eager (a caller with no eager path)
        self._eager = type(module).forward.__get__(module)
        # Static classes before dynamic ones: an exact bucket beats a range that also covers it.
        self.artifacts = sorted(artifacts, key=lambda a: a.dynamic)
        self.counters: collections.Counter[str] = collections.Counter()
        self.last_reason: Refusal | None = None
        self._warned: set[str] = set()

    @property
    def armed(self) -> list[Artifact]:
        return [a for a in self.artifacts if a.package is not None and a.refusal is None]

    @property
    def refusals(self) -> dict[str, Refusal]:
        return {a.label: a.refusal for a in self.artifacts if a.refusal is not None}

    @property
    def unverified(self) -> dict[str, tuple[str, ...]]:
        """label → the checks an armed artifact cannot support (sealed before their record)."""
        return {a.label: a.unverified for a in self.armed if a.unverified}

    @property
    def lanes(self) -> dict[str, Refit]:
        """label → the lane each armed artifact serves and why (`lane-adopted`, `lane-refit`, …)."""
        return {a.label: a.lane for a in self.armed if a.lane is not None}

    def route(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any], restrided: list[str] | None = None
    ) -> tuple[Artifact | None, list[Any], Refusal | None]:
        """The artifact this call runs on (with its leaves), or None and the reason it runs eager."""
        armed = self.armed
        if not armed:
            first = next(iter(self.refusals.values()), Refusal(Code.NO_ARTIFACT, "no artifact adopted"))
            return None, [], first
        closest: Refusal | None = None
        for art in armed:
            copied: list[str] = []
            why, leaves = fit(art.contract, args, kwargs, copied)
            if why is None:
                if restrided is not None:
                    restrided.extend(copied)
                return art, leaves, None
            if closest is None:
                closest = Refusal(why.code, f"{art.label}: {why.detail}")
        assert closest is not None
        return None, [], closest

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._retry_refused()
        restrided: list[str] = []
        art, leaves, why = self.route(args, kwargs, restrided)
        if art is not None and art.watch is not None and (moved := art.watch.moved()) is not None:
            refusal = self._rearm(art)
            if refusal is None:
                self.counters["rebound"] += 1
            else:
                why = self._hold(art, moved, refusal)
        if art is not None and art.package is not None and art.refusal is None:
            try:
                out = art.package.run_flat([x for x in leaves if isinstance(x, torch.Tensor)])
                self.counters["compiled"] += 1
                if restrided:
                    self.counters["restrided"] += 1
                return out
            except Exception as e:  # a compiled failure disarms the artifact and serves eager
                art.refusal = Refusal(Code.COMPILED_ERROR, f"{type(e).__name__}: {e}")
                art.package = None
                why = art.refusal
        assert why is not None  # no artifact, or one refused on the way: each says why
        if self.strict:
            raise AdoptRefused(why)
        self.counters[f"eager:{why.code}"] += 1
        self.last_reason = why
        if why.code not in self._warned:
            self._warned.add(why.code)
            log.warning("serving %s eager: %s (%s)", type(self.module).__name__, why.code, why.detail)
        return self._eager(*args, **kwargs)

    def _rearm(self, art: Artifact) -> Refusal | None:
        """Bind `art` to the live module again if it matches it (tree as first bound, configuration,
        layout, every bound tensor); else the first reason it does not."""
        assert art.package is not None
        module = self.module
        if art.baseline is not None and (moved := structure_moved(art.baseline, module)) is not None:
            return Refusal(Code.MODULE_CHANGED, f"{moved}{_adapter_hint(module)}")
        refusal = layout_refusal(art.metadata, module)
        if refusal is not None:
            return Refusal(refusal.code, f"{refusal.detail}{_adapter_hint(module)}")
        if refusal := _bind_live(art, art.package, module, module_device(module)):
            return refusal
        art.refusal = None
        return None

    def _retry_refused(self) -> None:
        """Re-arm a loaded artifact refused for what the module held, once the module moved."""
        for art in self.artifacts:
            if art.package is None or art.refusal is None or art.refusal.code not in REARMABLE:
                continue
            moved = art.watch.moved() if art.watch is not None else None
            if art.watch is not None and moved is None:
                continue
            refusal = self._rearm(art)
            if refusal is None:
                self.counters["rebound"] += 1
            else:
                self._hold(art, moved, refusal)

    def _hold(self, art: Artifact, moved: Moved | None, refusal: Refusal) -> Refusal:
        """Refuse `art` for what the module holds now, and watch the module as it is refused (it
        is not retried until something in it moves). Returns the refusal it sets."""
        detail = f"{moved}; not re-bound: {refusal.code}: {refusal.detail}" if moved else refusal.detail
        art.refusal = held = Refusal(Code.MODULE_CHANGED, detail) if moved else refusal
        art.watch = Watch(self.module, art.watch.names if art.watch else ())
        return held

    def rebind(self) -> None:
        """Bind every artifact to the module's tensors again, re-arming those refused for what the
        module held once it matches them. Calls re-bind by themselves when something moved; this
        also re-arms an artifact refused before its package was loaded (e.g. adopted with an
        unfused adapter in place), and names each refusal in `refusals`."""
        for i, art in enumerate(self.artifacts):
            if art.refusal is not None and art.refusal.code not in REARMABLE:
                continue
            if art.package is None:
                if art.reload is not None:
                    self.artifacts[i] = art.reload(self.module)
                continue
            refusal = self._rearm(art)
            if refusal is not None:
                self._hold(art, None, refusal)

    def install(self) -> Adopted:
        """Serve `module(...)` through this object (an instance attribute; hooks stay intact)."""
        self.module.forward = self  # type: ignore[method-assign]
        return self

    def release(self) -> None:
        self.module.__dict__.pop("forward", None)


def _adapter_hint(module: nn.Module) -> str:
    """A pointer at the fix when the refusal's cause is an unfused adapter (`x.base_layer.w`)."""
    wrapped = adapter_wrapped(state_tensors(module))
    return f" ({wrapped}: {ADAPTER_HINT})" if wrapped is not None else ""


def adopt(
    artifact: str | os.PathLike[str],
    module: nn.Module,
    *,
    store: Store | SharedStore | None = None,
    strict: bool = False,
    memory_bytes: int | None = None,
    lane: str | None = None,
) -> Adopted:
    """Adopt one sealed artifact (a path, or a key when `store` is given) for `module`.

    With `strict`, a refused artifact raises `AdoptRefused`; otherwise it serves eager, named.
    The kernel lane is re-fitted to this device (`memory_bytes` overrides its memory) or pinned
    (`lane`) and bound before the first call; `Adopted.lanes` says which and why.
    """
    art = load_artifact(artifact, module, store=store, memory_bytes=memory_bytes, lane=lane)
    if strict and art.refusal is not None:
        raise AdoptRefused(art.refusal)
    return Adopted(module, [art], strict=strict)


class _CheckpointTensors(nn.Module):
    """A checkpoint's tensors under their state-dict names, and nothing else: the shape adopt's
    checks read (names, dtypes, strides, device), with no model code behind it.

    It has no forward: serving a call eager would need the module the entry builds, so the
    `Adopted` over it is strict (a call the artifact cannot serve raises `AdoptRefused`).
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        for fqn, tensor in tensors.items():
            *path, name = fqn.split(".")
            owner: nn.Module = self
            for part in path:
                child = owner._modules.get(part)
                if child is None:
                    child = nn.Module()
                    owner.add_module(part, child)
                owner = child
            owner.register_buffer(name, tensor)  # the caller's tensor itself: no copy


def _tie_aliases(meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint saves a tied tensor once (`save_model`, `save_pretrained`): give it back its
    other names from the sealed table, so adopt finds every alias tied as at mint."""
    out = dict(tensors)
    for row in (meta.get("constants") or {}).get("state", []):
        names = [row["fqn"], *row.get("aliases", [])]
        held = next((out[n] for n in names if n in out), None)
        if held is not None:
            for name in names:
                out.setdefault(name, held)
    return out


def serve_checkpoint(
    artifact: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    *,
    store: Store | SharedStore | None = None,
    memory_bytes: int | None = None,
    lane: str | None = None,
) -> Adopted:
    """Serve a sealed artifact from a checkpoint's tensors alone, without the model's code.

    The package carries the program and binds its constants by name, so a serving worker that
    has the weights (e.g. `cgbuild_rules.weights.read_checkpoint(path, "cuda")`) need not import
    the entry or its libraries. The same checks as `adopt` run on the tensors; what differs is
    the fallback: there is no eager path without the module, so an artifact this host or these
    tensors refuse raises `AdoptRefused`, and so does a call outside the artifact's contract.
    Trace-baked literals come from the artifact. Weight swaps: assign new tensors to
    `served.module` (same names) and call `served.rebind()`.
    """
    meta: Mapping[str, Any] = {}
    path = Path(artifact)
    with contextlib.suppress(StoreError, RemoteError, SealError, OSError, ValueError):
        meta = read_metadata(store.resolve(str(artifact), verify=True).path if store is not None else path)
    holder = _CheckpointTensors(_tie_aliases(meta, tensors))
    art = load_artifact(
        artifact, holder, store=store, memory_bytes=memory_bytes, lane=lane, check_config=False
    )
    if art.refusal is not None:
        raise AdoptRefused(art.refusal)
    return Adopted(holder, [art], strict=True)


def adopt_manifest(
    manifest: Mapping[str, Any],
    modules: Mapping[str, nn.Module],
    *,
    store: Store | SharedStore | None = None,
    memory_bytes: int | None = None,
    layouts: Mapping[str, str] | None = None,
) -> dict[str, Adopted]:
    """Adopt every graph class of every module a serving manifest names, in one call.

    The manifest (`cgbuild.protocol.manifest`: schema 2, or schema 1 read as before) may hold
    several sms and layouts of a module. Each module keeps the entries of its own device's sm
    (none: one `wrong-sm` refusal naming the sms the manifest has) and one layout: the one
    `layouts[module]` names, else the only one, else the one whose sealed tensor table matches
    the live module's tensors (none: `layout-mismatch`; several: `layout-ambiguous`, each naming
    the layouts: name one in `layouts`). Keys are resolved through `store` (without one, a key
    is read as an artifact path). Modules the manifest names but the caller does not pass are
    skipped; each returned `Adopted` routes a call to the class whose contract fits, else eager.
    Raises `BadManifest` (a ValueError) for a malformed manifest, ValueError for a layout named
    for a module or a layout the manifest does not have.
    """
    entries = read_manifest(manifest)
    layouts = dict(layouts or {})
    if unknown := sorted(set(layouts) - set(entries)):
        raise ValueError(f"layouts names {unknown[0]!r}, a module the manifest does not have")
    served: dict[str, Adopted] = {}
    for name, rows in entries.items():
        if name in modules:
            arts = _manifest_artifacts(name, rows, modules[name], store, memory_bytes, layouts.get(name))
            served[name] = Adopted(modules[name], arts)
    return served


def _manifest_artifacts(
    name: str,
    rows: list[ManifestEntry],
    module: nn.Module,
    store: Store | SharedStore | None,
    memory_bytes: int | None,
    layout: str | None,
) -> list[Artifact]:
    """The artifacts one module serves from its manifest entries: its sm, one layout."""
    here = device_sm(module_device(module))
    sms = sorted({r.sm for r in rows if r.sm})
    rows = [r for r in rows if r.sm in (None, here)]
    if not rows:
        detail = f"the manifest serves {name} on {', '.join(sms) or 'nothing'}, the module is on {here}"
        return [_refused(name, Code.WRONG_SM, detail)]
    by_layout: dict[str | None, list[ManifestEntry]] = {}
    for r in rows:
        by_layout.setdefault(r.layout, []).append(r)
    if layout is not None:
        if layout not in by_layout:
            have = ", ".join(sorted(str(k) for k in by_layout))
            raise ValueError(f"{name}: the manifest has no layout {layout!r} on {here} (it has {have})")
        by_layout = {layout: by_layout[layout]}
    loaded = {lay: _load_entries(group, module, store, memory_bytes) for lay, group in by_layout.items()}
    if len(loaded) == 1:
        return next(iter(loaded.values()))
    misfit = {
        lay: _layout_misfit(arts, module) for lay, arts in sorted(loaded.items(), key=lambda kv: str(kv[0]))
    }
    fits = [lay for lay, why in misfit.items() if why is None]
    if len(fits) == 1:
        return loaded[fits[0]]
    hint = f"name one with layouts={{{name!r}: ...}}"
    if fits:
        return [
            _refused(
                name,
                Code.LAYOUT_AMBIGUOUS,
                f"layouts {', '.join(map(str, fits))} all match the module's tensors: {hint}",
            )
        ]
    tried = "; ".join(f"{lay}: {why}" for lay, why in misfit.items())
    return [
        _refused(
            name, Code.LAYOUT_MISMATCH, f"no layout of the manifest matches the module ({tried}); {hint}"
        )
    ]


def _load_entries(
    rows: list[ManifestEntry], module: nn.Module, store: Store | SharedStore | None, memory_bytes: int | None
) -> list[Artifact]:
    """One artifact per key (graph classes sharing a key share it, labelled by all of them)."""
    classes: dict[str, list[str]] = {}
    for r in sorted(rows, key=lambda r: r.graph_class):
        classes.setdefault(r.key, []).append(r.graph_class)
    return [
        load_artifact(key, module, store=store, label="+".join(names), memory_bytes=memory_bytes)
        for key, names in classes.items()
    ]


def _layout_misfit(arts: list[Artifact], module: nn.Module) -> str | None:
    """Why this layout's artifacts do not match the live module's tensors (None: they do).

    Read from each artifact's sealed layout table (an artifact that could not be read matches
    nothing: its own refusal is the reason)."""
    readable = [a for a in arts if a.metadata]
    if not readable:
        why = next((a.refusal for a in arts if a.refusal), None)
        return f"{why.code}: {why.detail}" if why else "no artifact"
    for art in readable:
        if refusal := layout_refusal(art.metadata, module):
            return refusal.detail
    return None


def _refused(name: str, code: Code, detail: str) -> Artifact:
    """A stand-in for a module the manifest cannot serve here: the module serves eager, named."""
    return Artifact("", name, {}, refusal=Refusal(code, detail))
