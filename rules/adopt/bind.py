"""The live module's weights, literals, configuration and layout bound to an artifact by FQN
(checked against the sealed tables, never copied), and watched so a moved binding is seen on
the next call.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from cgbuild_rules import configured
from cgbuild_rules.adopt.refusal import Refusal
from cgbuild_rules.bound import (
    ADAPTER_HINT,
    adapter_wrapped,
)
from cgbuild_rules.loader import same_view, state_tensors
from torch import nn

from cgbuild.core.codes import Code
from cgbuild.identity.topology import safetensors_dtype
from cgbuild.store.sealed import Constant, Layout


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


PLAIN = ConfigCheck()
"""The configuration check of a module served as the entry built it (no adapter)."""


def weights_of(
    module: nn.Module, state: Iterable[Constant], device: torch.device, names: Collection[str]
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
    for row in state:
        fqn = row.fqn
        if fqn not in names:
            continue
        t = live.get(fqn)
        if t is None:
            return {}, Refusal(Code.WEIGHTS_MISSING, f"the module has no tensor {fqn!r}")
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype != row.dtype:
            return {}, Refusal(Code.WEIGHTS_MISMATCH, f"{fqn}: dtype {dtype}, artifact takes {row.dtype}")
        if tuple(t.shape) != row.shape:
            return {}, Refusal(
                Code.WEIGHTS_MISMATCH, f"{fqn}: shape {list(t.shape)}, artifact takes {list(row.shape)}"
            )
        if tuple(t.stride()) != row.stride:
            return {}, Refusal(
                Code.WEIGHTS_MISMATCH,
                f"{fqn}: stride {list(t.stride())}, artifact takes {list(row.stride)} "
                "(never repacked silently)",
            )
        if t.device.type != device.type:
            return {}, Refusal(
                Code.WEIGHTS_MISMATCH, f"{fqn}: on {t.device}, the artifact runs on {device.type}"
            )
        for alias in row.aliases:
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


def attribute(module: nn.Module, fqn: str) -> torch.Tensor | None:
    """The tensor the live module holds at `fqn` (a buffer or a plain attribute), if any."""
    prefix, _, name = fqn.rpartition(".")
    try:
        owner = module.get_submodule(prefix) if prefix else module
    except AttributeError:
        return None
    value = getattr(owner, name, None)
    return value if isinstance(value, torch.Tensor) else None


def literals_of(
    module: nn.Module, switches: Collection[str], sealed: Mapping[str, torch.Tensor], names: Collection[str]
) -> tuple[dict[str, torch.Tensor], Refusal | None]:
    """The trace-baked literals the package binds (non-persistent buffers, tensor attributes).

    The program was traced, digested and verified with the sealed values. A live module that
    holds the same value at that FQN has it bound in place (no copy: in-place updates reach
    both paths); one that holds another value would compute something else eager, so the
    artifact is refused (`literal-mismatch`); a literal the module does not hold (a constant
    created in `forward`) is bound from the artifact. The one-hot switches of an artifact sealed
    before the lane selector (`switches`) are the lane choice's to bind and are not compared.
    """
    out: dict[str, torch.Tensor] = {}
    for fqn, value in sealed.items():
        if fqn not in names:
            continue
        t = None if fqn in switches else attribute(module, fqn)
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


def config_refusal(
    recorded: Mapping[str, Any] | None,
    module: nn.Module,
    traced_as: str | None = None,
    substitutes: Mapping[str, str] | None = None,
) -> Refusal | None:
    """The first configuration value the live module holds otherwise than the module the
    artifact was minted from (`config-drift`; `cgbuild_rules.configured`; `traced_as` and
    `substitutes`: a call adapter's root class and stand-ins), or None; none to compare with
    when the artifact was sealed before the record (`recorded` None)."""
    if recorded is None:
        return None
    why = configured.drift(recorded, module, traced_as, substitutes)
    return Refusal(Code.CONFIG_DRIFT, why) if why else None


def layout_refusal(layout: Layout | None, module: nn.Module) -> Refusal | None:
    """The first tensor (by name) of the artifact's layout that the live module lacks or holds
    with another dtype or shape, checked before anything is loaded or bound.

    The table is the layout's topology sealed at mint (reference headers or the traced state
    dict, quantized tensors included), so a plain module offered to an int8 artifact is refused
    as `layout-mismatch` naming its first float weight, not as an opaque bind failure.
    Artifacts sealed without a layout table are checked by their constant table alone.
    """
    if layout is None:
        return None
    live = state_tensors(module)
    stamp = layout.stamp or "the artifact's layout"
    rule = layout.rule
    hint = ""
    if rule and not rule.startswith("plain."):
        hint = f" (quantize it first: cgbuild_rules.quant.convert(module, {rule!r}, dtype))"
    for name, dtype, shape in sorted(layout.tensors):
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


class CheckpointTensors(nn.Module):
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


def tie_aliases(state: Iterable[Constant], tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint saves a tied tensor once (`save_model`, `save_pretrained`): give it back its
    other names from the sealed table, so adopt finds every alias tied as at mint."""
    out = dict(tensors)
    for row in state:
        names = [row.fqn, *row.aliases]
        held = next((out[n] for n in names if n in out), None)
        if held is not None:
            for name in names:
                out.setdefault(name, held)
    return out


def adapter_hint(module: nn.Module) -> str:
    """A pointer at the fix when the refusal's cause is an unfused adapter (`x.base_layer.w`)."""
    wrapped = adapter_wrapped(state_tensors(module))
    return f" ({wrapped}: {ADAPTER_HINT})" if wrapped is not None else ""
