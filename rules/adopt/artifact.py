"""One artifact read, checked against this host, loaded through the package's C++ loader and
armed (bound, its lane chosen), or refused with its reason: its first state (`state`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from cgbuild_rules import traced
from cgbuild_rules.adopt.bind import PLAIN, ConfigCheck, adapter_hint, layout_refusal
from cgbuild_rules.adopt.contract import supplied_positions, supplied_refusal
from cgbuild_rules.adopt.host import host_refusal, module_device
from cgbuild_rules.adopt.refusal import REARMABLE, Refusal, log
from cgbuild_rules.adopt.state import Armed, Artifact, Identity, Loaded, State, Unloaded, arm
from cgbuild_rules.lanes import device_memory_bytes, switch_inputs
from cgbuild_rules.loader import Package
from torch import nn

from cgbuild import lanes
from cgbuild.core.codes import Code
from cgbuild.core.fields import Malformed
from cgbuild.lanes import LaneBlock, Refit
from cgbuild.protocol.contract import CallContract
from cgbuild.store.errors import StoreError
from cgbuild.store.local import Store
from cgbuild.store.s3 import RemoteError
from cgbuild.store.seal import LITERALS, PACKAGE, SealError, read_metadata, unseal
from cgbuild.store.sealed import Sealed, parse
from cgbuild.store.shared import SharedStore


def choose_lane(
    block: LaneBlock | None,
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
    (`lane-pinned`); it must be one the artifact carries, so a pin on an artifact with no lanes is
    refused rather than ignored. Never re-benchmarks.
    """
    if block is None:
        if pin is not None:
            raise ValueError(f"lane {pin!r} is not in this artifact (it carries no lanes)")
        return None, {}, {}
    carried = block.switches.carried()
    if pin is not None:
        if pin not in carried:
            raise ValueError(f"lane {pin!r} is not in this artifact (it carries {', '.join(carried)})")
        choice = Refit(pin, Code.LANE_PINNED, f"{pin}: pinned by the caller")
    else:
        memory = memory_bytes if memory_bytes is not None else device_memory_bytes(device)
        choice = block.verdict.refit(memory)
    return (choice, *switch_inputs(block.switches, lanes.split(choice.lane, block.switches.names), device))


def _arm(
    identity: Identity,
    files: Mapping[str, Path],
    module: nn.Module,
    device: torch.device,
    memory_bytes: int | None = None,
    pin: str | None = None,
) -> Armed | Unloaded:
    """Load the package with its literals and lane, and bind it to the live module (`arm`)."""
    literals: dict[str, torch.Tensor] = {}
    if LITERALS in files:
        from safetensors.torch import load_file

        try:
            literals = {k: v.to(device) for k, v in load_file(str(files[LITERALS])).items()}
        except Exception as e:  # safetensors' own error type: the literals file is not one
            return Unloaded(Refusal(Code.BAD_LITERALS, f"{LITERALS}: {type(e).__name__}: {e}"))
    sealed = identity.sealed
    assert sealed is not None  # only a read artifact is armed
    lane, switch, inputs = choose_lane(sealed.lanes, device, memory_bytes=memory_bytes, pin=pin)
    literals.update(switch)  # bound with the rest: before the first call, kept by rebind
    if refusal := supplied_refusal(sealed.contract, inputs):
        return Unloaded(refusal)
    supplied = tuple(supplied_positions(sealed.contract, inputs))
    if lane is not None:
        log.info("%s: lane %s (%s: %s)", identity.label, lane.lane, lane.code, lane.detail)
    try:
        package = Package(files[PACKAGE], device_index=device.index if device.index is not None else -1)
    except Exception as e:
        return Unloaded(Refusal(Code.LOAD_FAILED, f"{type(e).__name__}: {e}"))
    # The package's list is the truth of what it binds; the sealed table must describe each
    # (dtype, shape, stride to check). A table naming more is an artifact sealed before the
    # table was cut to the package's list: the extra rows are never bound.
    extra = sorted(set(package.constant_fqns) - sealed.constant_fqns)
    if extra:
        return Unloaded(
            Refusal(
                Code.CONSTANT_TABLE_MISMATCH,
                f"package binds {extra[:3]} that the sealed table does not describe",
            )
        )
    return arm(identity, Loaded(package, literals, lane, supplied), module, device)


def caller_contract(sealed: Sealed) -> CallContract:
    """What a caller's call must fit: the sealed contract without the lane selector adopt passes."""
    selector = sealed.lanes.switches.selector if sealed.lanes else None
    return sealed.contract.without([selector.input] if selector else [])


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
        unread = Identity(key, label or key[:12], None, seconds=time.perf_counter() - t)
        return Artifact(unread, Unloaded(Refusal(code, detail)))
    name = label or sealed.key[:12]
    refusal: Refusal | None
    if store is not None and sealed.key != key:
        refusal = Refusal(
            Code.KEY_MISMATCH, f"store key {key[:12]} holds an artifact that says {sealed.key[:12]}"
        )
    else:
        refusal = host_refusal(sealed, device) or layout_refusal(sealed.layout, module)
        if refusal is not None and refusal.code in REARMABLE:
            refusal = Refusal(refusal.code, f"{refusal.detail}{adapter_hint(module)}")
    unverified: tuple[str, ...] = ()
    baseline = None
    if config.enabled and sealed.module is None:
        unverified = ("config", "structure")
        log.info("%s: sealed without a configuration record: its configuration is unverified", name)
    elif config.enabled and sealed.module is not None:
        baseline = traced.from_record(sealed.module)
        if baseline is None:
            unverified = ("structure",)
            log.info("%s: sealed without the traced structure: held to the module as adopted", name)
    if refusal is None and baseline is None:  # the module as first bound stands for it
        baseline = traced.snapshot(module)
    reload = functools.partial(
        load_artifact, source, store=store, label=label, memory_bytes=memory_bytes, lane=lane, config=config
    )
    identity = Identity(
        sealed.key, name, sealed, caller_contract(sealed), baseline, unverified, config, reload
    )
    state: State = (
        Unloaded(refusal)
        if refusal is not None
        else _loaded(identity, path, module, device, memory_bytes, lane)
    )
    return Artifact(dataclasses.replace(identity, seconds=time.perf_counter() - t), state)


def _loaded(
    identity: Identity,
    path: Path,
    module: nn.Module,
    device: torch.device,
    memory_bytes: int | None,
    pin: str | None,
) -> Armed | Unloaded:
    """The artifact unpacked to a scratch directory and armed from it (`_arm`), or refused."""
    scratch = Path(tempfile.mkdtemp(prefix="cgbuild-adopt-"))
    try:
        return _arm(identity, unseal(path, scratch), module, device, memory_bytes, pin)
    except SealError as e:  # a member, or an entry of the package, that must not be unpacked
        return Unloaded(Refusal(e.code, str(e)))
    except (RuntimeError, OSError) as e:  # constants the package would not take
        return Unloaded(Refusal(Code.LOAD_FAILED, f"{type(e).__name__}: {e}"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # the loader has its own copy by now
