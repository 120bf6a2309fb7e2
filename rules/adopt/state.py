"""The adopted artifact's life: what it is (`Identity`, frozen) and the one state it is in
(frozen too), swapped only by the transitions below, each returning the state it leaves.

- `Unloaded`: no package. Unread, refused before or while loading (this host, its layout, a
  bind refused at adopt), a compiled call that raised (`fail_call`), or handed over to a
  replacing module (`hand_over`). `rebound` loads it anew, as a new artifact, when it was
  refused for what the module held (`REARMABLE`); any other refusal is for good.
- `Armed`: the package loaded and bound to the live module, which its watch proves unmoved
  before every call.
- `Held`: the package loaded, refused for what the module holds now, and watched as refused:
  `rearm` returns it to `Armed` once something in it moved and it matches again.
- `Replaced`: a pipeline holds a module of another class where the adopted one was
  (`module-replaced`); `restore` gives back the state it had once one of that class is back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch
from cgbuild_rules import traced
from cgbuild_rules.adopt.bind import (
    PLAIN,
    ConfigCheck,
    adapter_hint,
    config_refusal,
    layout_refusal,
    literals_of,
    weights_of,
)
from cgbuild_rules.adopt.host import module_device
from cgbuild_rules.adopt.refusal import REARMABLE, Refusal
from cgbuild_rules.bound import Moved, Watch
from cgbuild_rules.loader import Package
from torch import nn

from cgbuild.core.codes import Code
from cgbuild.lanes import Refit
from cgbuild.protocol.contract import CallContract
from cgbuild.store.sealed import Sealed


class IllegalTransition(RuntimeError):
    """A transition asked of a state it does not leave (a call on a package never loaded)."""


@dataclass(frozen=True)
class Identity:
    """What an adopted artifact is, whatever state it is in."""

    key: str
    label: str
    sealed: Sealed | None
    """What the artifact says of itself; None when it could not be read."""
    contract: CallContract = dataclasses.field(default_factory=CallContract)
    """What a caller's call must fit: the sealed contract without the lane selector adopt passes."""
    baseline: traced.Traced | None = None
    """The module as traced (`cgbuild_rules.traced`): adopt and every re-arm hold the live
    module to it. For an artifact sealed before the record carried it: the module as first bound."""
    unverified: tuple[str, ...] = ()
    """Checks this artifact cannot support (`config`: sealed before the configuration record;
    `structure`: sealed before the record carried the traced structure)."""
    config: ConfigCheck = PLAIN
    reload: Callable[[nn.Module], Artifact] | None = None
    """Load it again, for a module (how an `Unloaded` artifact is re-armed)."""
    seconds: float = 0.0


@dataclass(frozen=True)
class Loaded:
    """A package loaded for the live module and what binding and calling it take."""

    package: Package
    literals: Mapping[str, torch.Tensor]
    """Trace-baked literals and one-hot lane switches, bound beside the module's tensors."""
    lane: Refit | None
    """The kernel lane bound before the first call and why (None: the artifact has no lanes)."""
    supplied: tuple[tuple[int, torch.Tensor], ...]
    """(leaf index, tensor) of the inputs adopt passes with every call: the lane selector."""


@dataclass(frozen=True)
class Unloaded:
    """No package: why (`rebound` loads it anew only for what the module held)."""

    refusal: Refusal


@dataclass(frozen=True)
class Armed:
    """Loaded and bound: a call that fits may run it once its watch proves nothing moved."""

    loaded: Loaded
    watch: Watch
    """What the package is bound to."""


@dataclass(frozen=True)
class Held:
    """Loaded, refused for what the module holds now: re-armed when it moves and matches again."""

    loaded: Loaded
    refusal: Refusal
    watch: Watch
    """The module as refused: nothing is retried until something in it moves."""


@dataclass(frozen=True)
class Replaced:
    """A module of another class holds its place: refused until the adopted class is back."""

    refusal: Refusal
    prior: Unloaded | Armed | Held
    """The state it had before the first replacement: what `restore` gives back."""


State = Unloaded | Armed | Held | Replaced
_S = TypeVar("_S", bound=State)


class Artifact:
    """One sealed artifact as adopted for a module: its identity and its current state."""

    __slots__ = ("_identity", "_state")

    def __init__(self, identity: Identity, state: State) -> None:
        self._identity = identity
        self._state: State = state

    @property
    def identity(self) -> Identity:
        return self._identity

    @property
    def state(self) -> State:
        return self._state

    @property
    def key(self) -> str:
        return self.identity.key

    @property
    def label(self) -> str:
        return self.identity.label

    @property
    def sealed(self) -> Sealed | None:
        return self.identity.sealed

    @property
    def seconds(self) -> float:
        return self.identity.seconds

    @property
    def unverified(self) -> tuple[str, ...]:
        return self.identity.unverified

    @property
    def contract(self) -> CallContract:
        return self.identity.contract

    @property
    def dynamic(self) -> bool:
        return bool(self.contract.symbols)

    @property
    def armed(self) -> bool:
        return isinstance(self._state, Armed)

    @property
    def refusal(self) -> Refusal | None:
        return None if isinstance(self._state, Armed) else self._state.refusal

    @property
    def loaded(self) -> Loaded | None:
        return self._state.loaded if isinstance(self._state, Armed | Held) else None

    @property
    def watch(self) -> Watch | None:
        return self._state.watch if isinstance(self._state, Armed | Held) else None

    @property
    def lane(self) -> Refit | None:
        return self.loaded.lane if self.loaded is not None else None

    @property
    def supplied(self) -> tuple[tuple[int, torch.Tensor], ...]:
        return self.loaded.supplied if self.loaded is not None else ()


def _swap(art: Artifact, state: _S) -> _S:
    art._state = state
    return state


def arm(identity: Identity, loaded: Loaded, module: nn.Module, device: torch.device) -> Armed | Unloaded:
    """The first state of a package just loaded: bound to the live module (`Armed`), or, refused
    for what the module holds, `Unloaded` (the package is dropped; `rebound` loads it anew)."""
    bound = bind_live(identity, loaded, module, device)
    return Armed(loaded, bound) if isinstance(bound, Watch) else Unloaded(bound)


def rearm(art: Artifact, module: nn.Module, moved: Moved | None = None) -> Armed | Held:
    """Armed or Held → `Armed`, bound anew, when the module matches the artifact (its structure
    as traced, its layout, configuration and every tensor the package binds); else `Held` for
    the first reason it does not, or with `moved` (what moved since the last bind)
    `module-changed` naming both, watching the module as refused."""
    state = art.state
    if not isinstance(state, Armed | Held):
        raise IllegalTransition(f"rearm: {art.label} is {type(state).__name__}: no package is loaded")
    refusal = structure_refusal(art.identity, module)
    if refusal is None and (refusal := layout_refusal(art.sealed.layout if art.sealed else None, module)):
        refusal = Refusal(refusal.code, f"{refusal.detail}{adapter_hint(module)}")
    if refusal is None:
        bound = bind_live(art.identity, state.loaded, module, module_device(module))
        if isinstance(bound, Watch):
            return _swap(art, Armed(state.loaded, bound))
        refusal = bound
    said = refusal.code == Code.MODULE_CHANGED  # the structure check named what moved, and the fix
    detail = (
        f"{moved}; not re-bound: {refusal.code}: {refusal.detail}" if moved and not said else refusal.detail
    )
    held = Refusal(Code.MODULE_CHANGED, detail) if moved else refusal
    return _swap(art, Held(state.loaded, held, Watch(module, state.watch.names)))


def fail_call(art: Artifact, error: Exception) -> Unloaded:
    """Armed → `Unloaded` (`compiled-error`): a compiled call raised, so the package is dropped
    for good (no change to the module makes it run: `rebound` never loads it again)."""
    if not isinstance(art.state, Armed):
        raise IllegalTransition(f"fail_call: {art.label} is {type(art.state).__name__}: it ran no call")
    return _swap(art, Unloaded(Refusal(Code.COMPILED_ERROR, f"{type(error).__name__}: {error}")))


def rebound(art: Artifact, module: nn.Module) -> Artifact:
    """`art` bound to the module again where it can be: Armed or Held → `rearm`; Unloaded for
    what the module held (`REARMABLE`) → loaded anew, as a new artifact; any other state as is."""
    state = art.state
    if isinstance(state, Armed | Held):
        rearm(art, module)
    elif isinstance(state, Unloaded) and state.refusal.code in REARMABLE and art.identity.reload is not None:
        return art.identity.reload(module)
    return art


def hand_over(art: Artifact, why: str) -> Artifact:
    """Any state → a new artifact in that state, for the module that replaced `art`'s own in a
    pipeline (its package is bound to that module from now on); `art` keeps no package
    (`Unloaded`, `module-replaced` for `why`): the replaced module's router never computes with it."""
    moved = Artifact(art.identity, art.state)
    _swap(art, Unloaded(Refusal(Code.MODULE_REPLACED, why)))
    return moved


def replace(art: Artifact, why: str) -> Replaced:
    """Any state → `Replaced` (`module-replaced` for `why`), keeping the state it had before the
    first replacement."""
    state = art.state
    prior = state.prior if isinstance(state, Replaced) else state
    return _swap(art, Replaced(Refusal(Code.MODULE_REPLACED, why), prior))


def restore(art: Artifact) -> Unloaded | Armed | Held:
    """Replaced → the state it had before: a module of the adopted class is back (bind it again)."""
    state = art.state
    if not isinstance(state, Replaced):
        raise IllegalTransition(f"restore: {art.label} is {type(state).__name__}, not replaced")
    return _swap(art, state.prior)


def annotate(art: Artifact, prefix: str) -> Unloaded | Held | Replaced:
    """A refused state, its refusal's detail led by `prefix` (what it happened after)."""
    state = art.state
    if isinstance(state, Armed):
        raise IllegalTransition(f"annotate: {art.label} is armed: no refusal to explain")
    refusal = Refusal(state.refusal.code, f"{prefix}{state.refusal.detail}")
    return _swap(art, dataclasses.replace(state, refusal=refusal))


def structure_refusal(identity: Identity, module: nn.Module) -> Refusal | None:
    """`module-changed` naming the first way the live module differs from the module as traced
    (a hook, an override, a shadowing attribute, a patched class, train mode, a submodule added
    or gone), with its fix; None when it is structured as traced."""
    if identity.baseline is None:
        return None
    config = identity.config
    moved = traced.changed(identity.baseline, module, config.traced_as, config.substitutes)
    return None if moved is None else Refusal(Code.MODULE_CHANGED, f"{moved}{adapter_hint(module)}")


def bind_live(identity: Identity, loaded: Loaded, module: nn.Module, device: torch.device) -> Watch | Refusal:
    """Bind the package to the live module's tensors and watch them, when they, the module's
    configuration and its structure match the artifact; else the first reason they do not (an
    unfused adapter named)."""
    bound, refusal = _bindings(identity.sealed, loaded, module, device)
    config = identity.config
    if refusal is None and config.enabled and identity.sealed is not None:
        refusal = config_refusal(identity.sealed.module, module, config.traced_as, config.substitutes)
    if refusal is None and (refusal := structure_refusal(identity, module)):
        return refusal  # names its own fix
    if refusal is not None:
        return Refusal(refusal.code, f"{refusal.detail}{adapter_hint(module)}")
    loaded.package.bind(bound)
    return _watch(identity.sealed, module, bound)


def _bindings(
    sealed: Sealed | None, loaded: Loaded, module: nn.Module, device: torch.device
) -> tuple[dict[str, torch.Tensor], Refusal | None]:
    """Everything the package binds, by FQN: live weights and literals, checked; no copies."""
    assert sealed is not None  # only a read artifact is loaded
    names = set(loaded.package.constant_fqns)
    weights, refusal = weights_of(module, sealed.state, device, names)
    if refusal:
        return {}, refusal
    literals, refusal = literals_of(module, sealed.lane_switches, loaded.literals, names)
    return ({}, refusal) if refusal else ({**weights, **literals}, None)


def _watch(sealed: Sealed | None, module: nn.Module, bound: Collection[str]) -> Watch:
    """A watch over the bound names and every alias the table records for them."""
    names = set(bound)
    for row in sealed.state if sealed is not None else ():
        if row.fqn in names:
            names.update(row.aliases)
    return Watch(module, names)
