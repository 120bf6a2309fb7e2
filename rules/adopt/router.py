"""`Adopted`: the live module served through its armed artifacts, each call routed to the
artifact whose contract fits, re-bound when its bindings moved and still match, else served
eager with the reason named and counted.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, SupportsIndex

import torch
from cgbuild_rules.adopt.artifact import load_artifact
from cgbuild_rules.adopt.bind import CheckpointTensors, ConfigCheck, tie_aliases
from cgbuild_rules.adopt.calls import adapted, passed, wrapped
from cgbuild_rules.adopt.contract import conform, distance, fit
from cgbuild_rules.adopt.copies import Unserved, served_name
from cgbuild_rules.adopt.host import module_device
from cgbuild_rules.adopt.refusal import AdoptRefused, CompiledRequired, Refusal, log
from cgbuild_rules.adopt.state import Armed, Artifact, Held, fail_call, rearm, rebound
from cgbuild_rules.bound import Attached
from torch import nn

from cgbuild.config.calls import CallAdapter
from cgbuild.core.codes import Code
from cgbuild.lanes import Refit
from cgbuild.store.errors import StoreError
from cgbuild.store.local import Store
from cgbuild.store.s3 import RemoteError
from cgbuild.store.seal import SealError, read_metadata
from cgbuild.store.sealed import Constant, parse
from cgbuild.store.shared import SharedStore


class Adopted(Attached):
    """A module served through its artifacts: `__call__` runs compiled when a call fits one, else
    eager, naming and counting the reason. Never raises because of an artifact.

    Before each compiled call the artifact's watch (`cgbuild_rules.bound`) proves the module
    still holds what the package was bound to. When something moved, the artifact is re-bound
    on the spot if the module still matches it (counted `rebound`), else refused for this call
    and the next (`module-changed`, naming what moved and why it cannot be re-bound) until the
    module matches again. A call whose inputs are laid out otherwise than traced is served on
    copies laid out as traced (counted `restrided`).
    """

    def __init__(
        self,
        module: nn.Module,
        artifacts: Iterable[Artifact],
        *,
        strict: bool = False,
        eager: Callable[..., Any] | None = None,
        compiled_only: str | None = None,
        call: CallAdapter | None = None,
    ) -> None:
        """`eager`: the callable a call is served by when no artifact takes it (the module's own
        `forward`, or the method the artifacts serve, e.g. a VAE's `decode`); `compiled_only`: the
        label of a module that has no eager path (its layout quantizes activations): such a call
        raises `CompiledRequired` instead; `call`: the entry's adapter from the pipeline's call to
        the traced one (`cgbuild.config.calls`)."""
        self.module = module
        self.strict = strict
        # strict: raise AdoptRefused instead of serving a call eager (a caller with no eager path)
        self._eager = eager or type(module).forward.__get__(module)
        self.compiled_only = compiled_only
        self.call = call
        self._signature = _signature(self._eager)
        # Static classes before dynamic ones: an exact bucket beats a range that also covers it.
        self.artifacts = sorted(artifacts, key=lambda a: a.dynamic)
        self.counters: collections.Counter[str] = collections.Counter()
        self.last_reason: Refusal | None = None
        self._warned: set[str] = set()
        self._before: Any = None
        self.replaced: Refusal | None = None
        """Set by `install` over an instance `forward` of the caller's own: every call runs it, named."""

    @property
    def armed(self) -> list[Artifact]:
        return [a for a in self.artifacts if a.armed]

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
        if self.call is not None:
            kwargs, refused = passed(self.call, kwargs)
            if refused is not None:
                return None, [], refused
        closest: Refusal | None = None
        nearest: int | None = None  # the closest's distance from the call (contract.distance)
        for art in armed:
            copied: list[str] = []
            why, leaves = fit(art.contract, args, kwargs, copied)
            if self.call is not None and why is not None:
                conformed = adapted(self.call, art.contract, self._signature, args, kwargs)
                if conformed is not None:
                    why, leaves = fit(art.contract, *conformed, copied)
            elif why is not None and why.code == Code.CALL_STRUCTURE and self._signature is not None:
                conformed = conform(art.contract, self._signature, args, kwargs)  # by name, defaults
                if conformed is not None:
                    why, leaves = fit(art.contract, *conformed, copied)
            if why is None:
                if restrided is not None:
                    restrided.extend(copied)
                for at, value in art.supplied:  # the lane selector, where the program reads it
                    leaves.insert(at, value)
                return art, leaves, None
            far = distance(art.contract, args, kwargs)
            if closest is None or (far is not None and (nearest is None or far < nearest)):
                closest, nearest = Refusal(why.code, f"{art.label}: {why.detail}"), far
        assert closest is not None
        if closest.code in (Code.SHAPE, Code.SYMBOL_RANGE):
            return (
                None,
                [],
                Refusal(
                    Code.OUT_OF_ENVELOPE,
                    f"no declared graph class covers the call; closest {closest.detail} ({closest.code})",
                ),
            )
        return None, [], closest

    def _mode_refusal(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Refusal | None:
        """Why this call's mode is not the program's: under autocast for the module's device the
        eager module computes in another dtype; with grad enabled while an input or a bound
        tensor requires grad, eager's output carries autograd and the program's is detached."""
        kind = module_device(self.module).type
        if torch.is_autocast_enabled(kind):
            return Refusal(
                Code.AUTOCAST,
                f"torch.autocast is on for {kind}: the program computes in the dtypes it was traced with",
            )
        if torch.is_grad_enabled():
            tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            bound = (t for a in self.armed if a.watch is not None for t in a.watch.bound_tensors())
            if any(t.requires_grad for t in tensors) or any(t.requires_grad for t in bound):
                return Refusal(
                    Code.GRAD,
                    "grad is enabled and a tensor requires grad: the program's output carries no autograd; "
                    "call under torch.no_grad() or torch.inference_mode() to serve it compiled",
                )
        return None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._retry_refused()
        restrided: list[str] = []
        leaves: list[Any]
        why: Refusal | None
        if (mode := self._mode_refusal(args, kwargs)) is not None:
            art, leaves, why = None, [], mode
        elif self.replaced is not None:
            art, leaves, why = None, [], self.replaced
        else:
            art, leaves, why = self.route(args, kwargs, restrided)
        state = art.state if art is not None else None
        if art is not None and isinstance(state, Armed) and (moved := state.watch.moved()) is not None:
            state = rearm(art, self.module, moved)
            if isinstance(state, Armed):
                self.counters["rebound"] += 1
            else:
                why = state.refusal
        if art is not None and isinstance(state, Armed):
            try:
                out = state.loaded.package.run_flat([x for x in leaves if isinstance(x, torch.Tensor)])
                self.counters["compiled"] += 1
                if restrided:
                    self.counters["restrided"] += 1
                return wrapped(self.call, out)
            except Exception as e:  # a compiled failure disarms the artifact and serves eager
                why = fail_call(art, e).refusal
        assert why is not None  # no artifact, or one refused on the way: each says why
        if self.compiled_only is not None:
            self.counters[f"refused:{why.code}"] += 1
            raise CompiledRequired(self.compiled_only, why)
        if self.strict:
            raise AdoptRefused(why)
        self.counters[f"eager:{why.code}"] += 1
        self.last_reason = why
        if why.code not in self._warned:
            self._warned.add(why.code)
            log.warning("serving %s eager: %s (%s)", type(self.module).__name__, why.code, why.detail)
        return self._eager(*args, **kwargs)

    def _retry_refused(self) -> None:
        """Re-arm a held artifact once something in the module moved, if it matches it now."""
        for art in self.artifacts:
            state = art.state
            moved = state.watch.moved() if isinstance(state, Held) else None
            if moved is not None and isinstance(rearm(art, self.module, moved), Armed):
                self.counters["rebound"] += 1

    def rebind(self) -> None:
        """Bind every artifact to the module's tensors again, re-arming those refused for what the
        module held once it matches them. Calls re-bind by themselves when something moved; this
        also re-arms an artifact refused before its package was loaded (e.g. adopted with an
        unfused adapter in place), and names each refusal in `refusals`."""
        self.artifacts[:] = [rebound(art, self.module) for art in self.artifacts]

    def install(self) -> Adopted:
        """Serve `module(...)` through this object (an instance attribute; hooks stay intact).

        An instance `forward` already set (an override, a library's wrapper) is what eager runs,
        and the program does not: it stays the eager path and every call is served by it, named
        (`module-changed`) — adopt before wrapping the module's forward."""
        before = self.module.__dict__.get("forward")
        if before is not None and not isinstance(before, Attached):
            self._before, self._eager = before, before
            self._signature = _signature(before)
            self.replaced = Refusal(
                Code.MODULE_CHANGED,
                f"the module's forward is an instance attribute set before adopt ({_name(before)}), which "
                "the program never runs: adopt first, then wrap it",
            )
        self.module.forward = self
        return self

    def release(self) -> None:
        if self.module.__dict__.get("forward") is self:
            self.module.__dict__.pop("forward")
            if self._before is not None:
                self.module.__dict__["forward"] = self._before

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        """A copy of the served module (deepcopy, pickle, torch.save) holds an `Unserved` stand-in
        here: its package cannot be copied and is bound to this module's tensors
        (`cgbuild_rules.adopt.copies`). This router, and the module it serves, are left as they are."""
        return Unserved, (self.module, served_name(self.module, self._eager), self.compiled_only, self.strict)


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
    state: tuple[Constant, ...] = ()
    path = Path(artifact)
    with contextlib.suppress(StoreError, RemoteError, SealError, OSError, ValueError):  # load_artifact says
        state = parse(read_metadata(store.resolve(str(artifact), verify=True).path if store else path)).state
    holder = CheckpointTensors(tie_aliases(state, tensors))
    art = load_artifact(
        artifact, holder, store=store, memory_bytes=memory_bytes, lane=lane, config=ConfigCheck(enabled=False)
    )
    if art.refusal is not None:
        raise AdoptRefused(art.refusal)
    return Adopted(holder, [art], strict=True)


def _name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', None)}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without one: calls must match the trace as made
        return None
