"""One artifact read, checked against this host, loaded through the package's C++ loader and
armed (bound, its lane chosen), or refused with its reason.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from cgbuild_rules import traced
from cgbuild_rules.adopt.bind import adapter_hint, config_refusal, layout_refusal, literals_of, weights_of
from cgbuild_rules.adopt.contract import supplied_positions, supplied_refusal
from cgbuild_rules.adopt.host import host_refusal, module_device
from cgbuild_rules.adopt.refusal import REARMABLE, Refusal, log
from cgbuild_rules.bound import Watch
from cgbuild_rules.lanes import device_memory_bytes, switch_inputs
from cgbuild_rules.loader import Package
from torch import nn

from cgbuild import lanes
from cgbuild.core.codes import Code
from cgbuild.lanes import Refit
from cgbuild.store.errors import StoreError
from cgbuild.store.local import Store
from cgbuild.store.metadata import Malformed
from cgbuild.store.s3 import RemoteError
from cgbuild.store.seal import LITERALS, PACKAGE, SealError, read_metadata, unseal
from cgbuild.store.sealed import Sealed, parse
from cgbuild.store.shared import SharedStore


# ---- artifacts ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConfigCheck:
    """How the live module's configuration is held against the artifact's record."""

    enabled: bool = True
    """False for a checkpoint's tensors: no model code, so no configuration beside the program's."""
    traced_as: str | None = None
    """The root class a call adapter says the program was traced as (`cgbuild.config.calls`): not
    held against the live module's own class."""
    substitutes: Mapping[str, str] = field(default_factory=dict)
    """Entry class → the stock class it stands for (a call adapter's `substitutes`): the stock
    class is accepted where the record names the entry's."""


@dataclass
class Artifact:
    """One sealed artifact as adopted for a module: armed (`package` set) or refused."""

    key: str
    label: str
    sealed: Sealed | None
    """What the artifact says of itself; None when it could not be read."""
    package: Package | None = None
    refusal: Refusal | None = None
    literals: dict[str, torch.Tensor] = field(default_factory=dict)
    seconds: float = 0.0
    lane: Refit | None = None
    """The kernel lane bound before the first call and why (None: the artifact has no lanes)."""
    supplied: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    """(leaf index, tensor) of the inputs adopt passes with every call: the lane selector."""
    call_contract: dict[str, Any] | None = None
    watch: Watch | None = None
    """What the package is bound to; while refused for a binding reason, the module as refused
    (nothing is retried until something in it moves)."""
    baseline: traced.Traced | None = None
    """The module as traced (`cgbuild_rules.traced`): adopt and every re-arm hold the live
    module to it. For an artifact sealed before the record carried it: the module as first bound."""
    unverified: tuple[str, ...] = ()
    """Checks this artifact cannot support (`config`: sealed before the configuration record;
    `structure`: sealed before the record carried the traced structure)."""
    config: ConfigCheck = field(default_factory=ConfigCheck)
    reload: Callable[[nn.Module], Artifact] | None = None
    """Load it again (an artifact refused before its package was loaded is re-armed so)."""

    @property
    def sealed_contract(self) -> Mapping[str, Any]:
        """The program's call contract as sealed, the lane selector included."""
        return self.sealed.contract if self.sealed is not None else {}

    @property
    def contract(self) -> Mapping[str, Any]:
        """What a caller's call must fit: once armed, the sealed contract without the lane selector."""
        return self.call_contract if self.call_contract is not None else self.sealed_contract

    @property
    def dynamic(self) -> bool:
        return bool(self.contract.get("symbols"))


PLAIN = ConfigCheck()
"""The configuration check of a module served as the entry built it (no adapter)."""


def choose_lane(
    block: Mapping[str, Any] | None,
    device: torch.device,
    *,
    memory_bytes: int | None = None,
    pin: str | None = None,
) -> tuple[Refit | None, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The lane this device serves, the constants and the inputs that select it (docs/lanes.md):
    the selector input, or for an artifact sealed with one-hot switches their values by FQN.

    Re-applies the fit rule to THIS device's memory (`memory_bytes` overrides it: a smaller card,
    a share of a larger one) on the peaks the mint recorded, rounded up: `lane-adopted`,
    `lane-refit`, `lane-refit-no-fit` or `lane-unverified`. `pin` names a lane to serve instead
    (`lane-pinned`); it must be one the artifact carries. Never re-benchmarks.
    """
    if not block or not block.get("axes"):
        return None, {}, {}
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
    return (choice, *switch_inputs(block, lanes.split(choice.lane, axes), device))


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
    assert art.sealed is not None  # only a read artifact is armed
    art.lane, switch, inputs = choose_lane(art.sealed.lanes, device, memory_bytes=memory_bytes, pin=pin)
    art.literals.update(switch)  # bound with the rest below: before the first call, kept by rebind
    if refusal := supplied_refusal(art.sealed_contract, inputs):
        art.refusal = refusal
        return
    art.supplied = supplied_positions(art.sealed_contract, inputs)
    art.call_contract = lanes.caller_contract(art.sealed_contract, inputs)
    if art.lane is not None:
        log.info("%s: lane %s (%s: %s)", art.label, art.lane.lane, art.lane.code, art.lane.detail)
    try:
        package = Package(files[PACKAGE], device_index=device.index if device.index is not None else -1)
    except Exception as e:
        art.refusal = Refusal(Code.LOAD_FAILED, f"{type(e).__name__}: {e}")
        return
    table = art.sealed.constant_fqns
    # The package's list is the truth of what it binds; the sealed table must describe each
    # (dtype, shape, stride to check). A table naming more is an artifact sealed before the
    # table was cut to the package's list: the extra rows are never bound.
    extra = sorted(set(package.constant_fqns) - table)
    if extra:
        art.refusal = Refusal(
            Code.CONSTANT_TABLE_MISMATCH, f"package binds {extra[:3]} that the sealed table does not describe"
        )
        return
    if art.baseline is None:  # sealed without the traced structure: the module as first bound
        art.baseline = traced.snapshot(module)
    if refusal := bind_live(art, package, module, device):
        art.refusal = refusal
        return
    art.package = package


def structure_refusal(art: Artifact, module: nn.Module) -> Refusal | None:
    """`module-changed` naming the first way the live module differs from the module as traced
    (a hook, an override, a shadowing attribute, a patched class, train mode, a submodule added
    or gone), with its fix; None when it is structured as traced."""
    if art.baseline is None:
        return None
    moved = traced.changed(art.baseline, module, art.config.traced_as, art.config.substitutes)
    return None if moved is None else Refusal(Code.MODULE_CHANGED, f"{moved}{adapter_hint(module)}")


def load_artifact(
    source: str | os.PathLike[str],
    module: nn.Module,
    *,
    store: Store | SharedStore | None = None,
    label: str | None = None,
    memory_bytes: int | None = None,
    lane: str | None = None,
    config: ConfigCheck = PLAIN,
) -> Artifact:
    """Resolve, check and arm one artifact for `module`; a refusal is recorded, never raised.

    `config`: how the configuration record is checked (skipped for a checkpoint's tensors, which
    have none: the program is the artifact's own; a call adapter's traced root class).

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
        sealed = parse(read_metadata(path))
    except (StoreError, RemoteError, SealError, OSError, ValueError) as e:  # Malformed too
        code = Code.BAD_METADATA if isinstance(e, Malformed) else getattr(e, "code", Code.BAD_ARTIFACT)
        detail = f"{path}: {e}" if isinstance(e, Malformed) else str(e)
        return Artifact(
            key, label or key[:12], None, refusal=Refusal(code, detail), seconds=time.perf_counter() - t
        )
    art = Artifact(sealed.key, label or sealed.key[:12], sealed)
    if store is not None and art.key != key:
        art.refusal = Refusal(
            Code.KEY_MISMATCH, f"store key {key[:12]} holds an artifact that says {art.key[:12]}"
        )
    else:
        art.refusal = host_refusal(sealed, device) or layout_refusal(sealed.layout, module)
        if art.refusal is not None and art.refusal.code in REARMABLE:
            art.refusal = Refusal(art.refusal.code, f"{art.refusal.detail}{adapter_hint(module)}")
    art.config = config
    record = sealed.module
    if config.enabled and record is None:
        art.unverified = ("config", "structure")
        log.info("%s: sealed without a configuration record: its configuration is unverified", art.label)
    elif config.enabled and record is not None:
        art.baseline = traced.from_record(record)
        if art.baseline is None:
            art.unverified = ("structure",)
            log.info("%s: sealed without the traced structure: held to the module as adopted", art.label)
    art.reload = functools.partial(
        load_artifact,
        source,
        store=store,
        label=label,
        memory_bytes=memory_bytes,
        lane=lane,
        config=config,
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


def _bindings(
    art: Artifact, package: Package, module: nn.Module, device: torch.device
) -> tuple[dict[str, torch.Tensor], Refusal | None]:
    """Everything the package binds, by FQN: live weights and literals, checked; no copies."""
    assert art.sealed is not None
    names = set(package.constant_fqns)
    weights, refusal = weights_of(module, art.sealed.state, device, names)
    if refusal:
        return {}, refusal
    literals, refusal = literals_of(module, art.sealed.lane_switches, art.literals, names)
    return ({}, refusal) if refusal else ({**weights, **literals}, None)


def bind_live(art: Artifact, package: Package, module: nn.Module, device: torch.device) -> Refusal | None:
    """Bind `package` to the live module's tensors and watch them, when they, the module's
    configuration and its structure match the artifact; else the first reason they do not (an
    unfused adapter named)."""
    bound, refusal = _bindings(art, package, module, device)
    if refusal is None and art.config.enabled and art.sealed is not None:
        refusal = config_refusal(art.sealed.module, module, art.config.traced_as, art.config.substitutes)
    if refusal is None and (refusal := structure_refusal(art, module)):
        return refusal  # names its own fix
    if refusal is not None:
        return Refusal(refusal.code, f"{refusal.detail}{adapter_hint(module)}")
    package.bind(bound)
    art.watch = _watch(art, module, bound)
    return None


def _watch(art: Artifact, module: nn.Module, bound: Collection[str]) -> Watch:
    """A watch over the bound names and every alias the table records for them."""
    names = set(bound)
    for row in art.sealed.state if art.sealed is not None else ():
        if row.fqn in names:
            names.update(row.aliases)
    return Watch(module, names)
