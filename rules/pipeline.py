"""Serve a diffusers pipeline: the modules a serving manifest names, routed through their sealed
artifacts where the pipeline calls them, under the serving policy; one call arms them all.

    pipe = Flux2KleinPipeline.from_pretrained(...)
    served = adopt_pipeline(pipe, "manifest.json", store=Store(".cgbuild/store"))
    served.warmup()
    image = served(prompt_embeds=embeds, height=1024, width=1024, num_inference_steps=4)

Each manifest module attaches where its Cgfile declaration says (`serves`: `transformer`, a
module the pipeline calls; `vae.decode`, a method of one). The pipeline keeps its own objects:
a module's calls go through an `Adopted` installed as its `forward`, a method's through one set
on its owner, so every attribute the pipeline reads (`config`, `dtype`, `device`,
`cache_context`) is the module's own, and tensor names bind to the pipeline's modules as they
are. The original callable is the eager path.

The policy (docs/adopt.md): a module whose layout quantizes activations is compiled-only, and a
call no armed artifact serves raises `CompiledRequired` before any of its kernels run; any other
module falls back eager, named and counted. `adopt_pipeline` itself raises only for a caller's
mistake (`AttachError`: an attribute the pipeline lacks, a manifest of another family).
"""

from __future__ import annotations

import functools
import os
import sys
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn, SupportsIndex

import torch
from cgbuild_rules.adopt.bind import PLAIN, ConfigCheck
from cgbuild_rules.adopt.copies import Unserved
from cgbuild_rules.adopt.host import module_device
from cgbuild_rules.adopt.manifest import manifest_artifacts
from cgbuild_rules.adopt.refusal import AdoptRefused, CompiledRequired, log
from cgbuild_rules.adopt.router import Adopted
from cgbuild_rules.adopt.state import Artifact, Replaced, annotate, hand_over, replace, restore
from torch import nn

from cgbuild.config.calls import CallAdapter
from cgbuild.core import jsonfile
from cgbuild.protocol.contract import Baked, CallContract, Leaf
from cgbuild.protocol.manifest import read_modules
from cgbuild.store.local import Store
from cgbuild.store.shared import SharedStore

LAYERWISE_CASTING = "layerwise_casting"
"""diffusers' name for the hook a model's reported dtype is read from first."""

__all__ = ["AttachError", "CompiledRequired", "ServedPipeline", "adopt_pipeline"]


class AttachError(ValueError):
    """The caller asked for what cannot be: the pipeline has no such attribute, the manifest is
    another family's, or the module is already served by another adoption."""


class CopyRefused(TypeError):
    """A `ServedPipeline` is not copied: its state is packages bound to this pipeline's tensors."""


@dataclass(frozen=True)
class Attachment:
    """Where a manifest module's calls are served on a pipeline, resolved before anything loads."""

    owner: Any
    """the object the attribute is on (the module itself for a module attach)"""
    attr: str | None
    """the method's name for a method attach (`decode`), None for a module's own calls"""
    target: Any
    """the module, or the owner's method (the eager path)"""
    unwraps: tuple[tuple[Any, str, nn.Module], ...] = ()
    """(holder, attribute, `torch.compile` wrapper) along the path: set to the wrapped module"""

    @property
    def live(self) -> nn.Module:
        """The module the artifacts bind to."""
        return self.target if self.attr is None else self.owner  # type: ignore[no-any-return]

    def unwrap(self) -> None:
        for holder, name, wrapper in self.unwraps:
            setattr(holder, name, wrapper._orig_mod)


@dataclass
class Component:
    """One manifest module attached to the pipeline."""

    name: str
    serves: str
    adopted: Adopted
    owner: Any
    """the object the attribute is on (the module itself for a module attach)"""
    attr: str | None
    """the method's name for a method attach (`decode`), None for a module's own calls"""
    undo: Callable[[], None] | None = None
    """takes back the compute dtype the module was made to report (`report_compute_dtype`)"""
    label: str = ""
    """`family/module@layout`, as a compiled-only refusal names it"""
    unwrapped: list[tuple[Any, str, nn.Module]] = field(default_factory=list)
    """the `torch.compile` wrappers taken off the path, put back on release"""
    adopted_as: type | None = None
    """the class of the module first adopted: a replacement of that class is re-armed"""

    @property
    def live(self) -> nn.Module:
        return self.adopted.module

    def detach(self) -> None:
        """Take this component's router off its module (only if it is still the one there) and
        the compute dtype it was made to report."""
        holder = self.live.__dict__
        key = "forward" if self.attr is None else self.attr
        if holder.get(key) is self.adopted:
            del holder[key]
        if self.undo is not None:
            self.undo()
            self.undo = None


_SERVED: weakref.WeakKeyDictionary[Adopted, str] = weakref.WeakKeyDictionary()
"""The label of every router `adopt_pipeline` attached: a second adoption names the first."""


class ServedPipeline:
    """A pipeline whose manifest modules are served compiled; `served(...)` is `pipe(...)`.

    Each call first checks (by identity, a few attribute reads) that the pipeline still holds
    the modules it served: one replaced since (`pipe.transformer = other`) is re-armed when it
    is of the adopted class and matches the artifacts, else served eager as `module-replaced`
    (compiled-only: `CompiledRequired`), named either way."""

    def __init__(self, pipe: Any, family: str, components: dict[str, Component]) -> None:
        self.pipe = pipe
        self.family = family
        self.components = components
        self._unattached: set[str] = set()  # paths warned of: replaced by what cannot be attached

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.follow()
        return self.pipe(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """Everything else is the pipeline's (`served.transformer`, `served.scheduler`, ...)."""
        if name in ("pipe", "family", "components", "_unattached"):  # not set yet: no recursion through pipe
            raise AttributeError(name)
        return getattr(self.pipe, name)

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        raise CopyRefused(
            "a ServedPipeline is not copied (its packages are bound to this pipeline's tensors): "
            "copy served.pipe instead (the copy runs eager, docs/adopt.md#copies) and adopt_pipeline the copy"
        )

    @property
    def counters(self) -> dict[str, dict[str, int]]:
        """Per component: how its calls were served (`compiled`, `eager:<code>`, `refused:<code>`)."""
        return {name: dict(c.adopted.counters) for name, c in self.components.items()}

    def rebind(self) -> None:
        """After a weight or LoRA swap: re-arm what the module now matches (`Adopted.rebind`)."""
        self.follow()
        for c in self.components.values():
            c.adopted.rebind()

    def release(self) -> None:
        """Detach every component: the pipeline calls its own modules again, as before (a
        `torch.compile` wrapper taken off at adopt is put back where its module still is)."""
        for c in self.components.values():
            c.detach()
            for holder, name, wrapper in c.unwrapped:
                if getattr(holder, name, None) is wrapper._orig_mod:
                    setattr(holder, name, wrapper)
        self.components = {}

    def follow(self) -> None:
        """Serve what the pipeline holds now: a component whose module (or method's owner) the
        pipeline no longer holds is moved to the one it holds instead (`_replaced`)."""
        for name, c in self.components.items():
            if _held(self.pipe, c.serves, c.attr) is not c.live:
                self.components[name] = self._replaced(c)

    def _replaced(self, c: Component) -> Component:
        """`c` moved to the module the pipeline now holds at its path: re-armed there when it is
        of the adopted class and matches the artifacts (counted `replaced`), else every call is
        `module-replaced`. The module replaced is detached: it runs as a plain module again."""
        try:
            at = _attachment(self.pipe, c.serves, self.family, mine=c.adopted)
        except AttachError as e:  # no module there now, or one another adoption serves
            if c.serves not in self._unattached:
                self._unattached.add(c.serves)
                log.warning("pipe.%s was replaced and is not served by this adoption: %s", c.serves, e)
            return c
        at.unwrap()
        c.unwrapped.extend(at.unwraps)
        if at.live is c.live:  # the same module, re-wrapped by torch.compile: unwrapped again
            log.warning("pipe.%s: the torch.compile wrapper set after adopt is taken off", c.serves)
            return c
        old = c.adopted
        # the packages move to the new module; the replaced module's router keeps none
        arts = [hand_over(a, f"pipe.{c.serves} was replaced") for a in old.artifacts]
        c.detach()
        adopted_cls = c.adopted_as or type(old.module)
        new = at.live
        if type(new) is adopted_cls:
            for a in arts:
                if isinstance(a.state, Replaced):
                    restore(a)  # held back only because another class was there
            undo = report_compute_dtype(new, arts) if at.attr is None else None
        else:
            why = f"pipe.{c.serves} is now a {type(new).__name__}, adopted as a {adopted_cls.__name__}"
            for a in arts:
                replace(a, why)
            undo = None
        adopted = _serve(at, arts, c.label, old.compiled_only is not None, old.call)
        adopted.counters.update(old.counters)
        adopted.counters["replaced"] += 1
        if type(new) is adopted_cls:
            adopted.rebind()
            for a in adopted.artifacts:
                if a.refusal is not None:
                    annotate(a, f"pipe.{c.serves} was replaced after adopt_pipeline: ")
        if adopted.armed:
            log.info("pipe.%s was replaced after adopt_pipeline: re-armed on the new module", c.serves)
        else:
            reason = next(iter(adopted.refusals.values()), None)
            log.warning(
                "pipe.%s was replaced after adopt_pipeline and is not served compiled: %s",
                c.serves,
                f"{reason.code}: {reason.detail}" if reason else "no artifact",
            )
        return Component(
            c.name, c.serves, adopted, at.owner, at.attr, undo, c.label, c.unwrapped, adopted_cls
        )

    def warmup(self) -> dict[str, Any]:
        """Run every armed graph class once on its declared shapes (zeros, on the module's device),
        so no request pays a first call: `{"seconds": {label: s}, "not_compiled": {label: why}}`."""
        self.follow()
        seconds: dict[str, float] = {}
        failed: dict[str, str] = {}
        for c in self.components.values():
            device = module_device(c.adopted.module)
            for art in c.adopted.armed:
                args, kwargs = warm_inputs(art.contract, device)
                before = c.adopted.counters["compiled"]
                t = time.perf_counter()
                try:
                    with torch.inference_mode():
                        c.adopted(*args, **kwargs)
                except AdoptRefused as e:
                    failed[art.label] = f"{e.refusal.code}: {e.refusal.detail}"
                    continue
                seconds[art.label] = round(time.perf_counter() - t, 4)
                if c.adopted.counters["compiled"] == before:
                    why = c.adopted.last_reason
                    failed[art.label] = f"{why.code}: {why.detail}" if why else "served eager"
        return {"seconds": seconds, "not_compiled": failed}


def adopt_pipeline(
    pipe: Any,
    manifest: str | os.PathLike[str] | Mapping[str, Any],
    *,
    store: Store | SharedStore | None = None,
    layouts: Mapping[str, str] | None = None,
    memory_bytes: int | None = None,
) -> ServedPipeline:
    """Arm every module a serving manifest names where the pipeline calls it.

    `layouts` names a module's layout where its weights match several; `store` resolves keys
    (without one a key is read as an artifact path); `memory_bytes` is the card's, for the lane
    re-fit. Raises `BadManifest` for a malformed manifest, `AttachError` for an attribute the
    pipeline lacks or a manifest whose modules none of the pipeline's attributes serve.
    """
    doc = _manifest(manifest)
    modules = read_modules(doc)
    family = str(doc.get("family") or "")
    layouts = dict(layouts or {})
    if unknown := sorted(set(layouts) - set(modules)):
        raise AttachError(f"layouts names {unknown[0]!r}, a module the manifest does not have")
    components: dict[str, Component] = {}
    # Every path resolved first: a caller's mistake (a missing attribute, a module another
    # adoption serves) is refused before anything loads or attaches.
    attachments = {name: _attachment(pipe, m.serves, family) for name, m in modules.items()}
    try:
        for name, module_doc in modules.items():
            at = attachments[name]
            live = at.live
            call = module_doc.call
            config = ConfigCheck(traced_as=call.traced_class, substitutes=call.substitutes) if call else PLAIN
            load = functools.partial(
                manifest_artifacts, name, module_doc.entries, live, store, memory_bytes, layouts.get(name)
            )
            arts, chosen = load(config)
            undo = report_compute_dtype(live, arts) if at.attr is None else None
            if undo is not None:  # the hook is part of the module the artifacts bind to and watch
                try:
                    arts, chosen = load(config)
                except BaseException:
                    undo()
                    raise
            declared = {e.layout for e in module_doc.entries}
            layout = chosen or layouts.get(name) or (next(iter(declared)) if len(declared) == 1 else None)
            rows = [e for e in module_doc.entries if layout is None or e.layout == layout]
            compiled_only = bool(rows) and all(e.compiled_only for e in rows)
            label = f"{family}/{name}@{layout or '?'}"
            adopted = _serve(at, arts, label, compiled_only, module_doc.call)
            components[name] = Component(
                name, module_doc.serves, adopted, at.owner, at.attr, undo, label, list(at.unwraps), type(live)
            )
    except BaseException:
        ServedPipeline(pipe, family, components).release()
        raise
    for at in attachments.values():  # the pipeline calls the module itself, not its compiled wrapper
        at.unwrap()
    return ServedPipeline(pipe, family, components)


def _serve(
    at: Attachment, arts: list[Artifact], label: str, compiled_only: bool, call: CallAdapter | None
) -> Adopted:
    """Route the calls `at` names through `arts`, attached where the pipeline calls them."""
    eager = None if at.attr is None else at.target
    adopted = Adopted(at.live, arts, eager=eager, compiled_only=label if compiled_only else None, call=call)
    if at.attr is None:
        adopted.install()
    else:
        at.owner.__dict__[at.attr] = adopted
    _SERVED[adopted] = label
    return adopted


def report_compute_dtype(module: nn.Module, arts: list[Artifact]) -> Callable[[], None] | None:
    """Make a diffusers model report the dtype its program computes in, where its stored weights
    say otherwise (fp8 weights of a layout that computes in bf16), and return how to undo it.

    A pipeline casts a denoiser's input to `transformer.dtype`, which diffusers reads from the
    first floating-point parameter: float8 for an fp8 layout, so every call would reach the
    program in fp8 and be refused. diffusers asks a model's hooks first (a `layerwise_casting`
    hook's `compute_dtype`: its own name for weights stored in one dtype and computed in another),
    so one such hook carrying the contract's dtype goes on the submodule holding that parameter.
    The hook changes nothing in any call; it wraps that submodule's forward, which the artifacts'
    per-call watch would see, so the caller binds them after it is in place.
    """
    compute = _contract_dtype(arts)
    reported = _reported_dtype(module)
    if compute is None or not isinstance(reported, torch.dtype) or reported == compute:
        return None
    if any(_casting_hook(m) is not None for m in module.modules()):
        return None  # the model's own layerwise casting decides what it reports
    first = next((name for name, p in module.named_parameters() if p.is_floating_point()), None)
    if first is None:
        return None
    holder = module.get_submodule(first.rpartition(".")[0])
    from diffusers.hooks.hooks import HookRegistry, ModelHook  # a diffusers model: diffusers is here

    class ComputesIn(ModelHook):
        cgbuild_inert = True  # cgbuild_rules.traced.INERT: wraps the forward, changes no call

        def __init__(self, dtype: torch.dtype) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self.compute_dtype = dtype

    registry = HookRegistry.check_if_exists_or_initialize(holder)
    registry.register_hook(ComputesIn(compute), LAYERWISE_CASTING)

    def undo() -> None:
        registry.remove_hook(LAYERWISE_CASTING, recurse=False)
        if not registry.hooks:
            holder.__dict__.pop("_diffusers_hook", None)

    return undo


def _casting_hook(module: nn.Module) -> Any:
    registry = module.__dict__.get("_diffusers_hook")
    return registry.get_hook(LAYERWISE_CASTING) if registry is not None else None


def _reported_dtype(module: nn.Module) -> Any:
    """What the model says its dtype is (a diffusers model: its first floating parameter's)."""
    return getattr(module, "dtype", None)


def _contract_dtype(arts: list[Artifact]) -> torch.dtype | None:
    """The dtype of the first floating-point tensor input any artifact's contract takes."""
    for art in arts:
        for spec in art.contract.inputs:
            for leaf in spec.leaves:
                if isinstance(leaf, Leaf):
                    dtype = getattr(torch, leaf.dtype, None)
                    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
                        return dtype
    return None


def _manifest(manifest: str | os.PathLike[str] | Mapping[str, Any]) -> Any:
    """The manifest, read from its file through the engine's bounded JSON reader when it is one;
    `read_modules` then refuses what is not a manifest, by field."""
    return (
        manifest if isinstance(manifest, Mapping) else jsonfile.load(os.fspath(manifest), "serving manifest")
    )


def _attachment(pipe: Any, path: str, family: str, *, mine: Adopted | None = None) -> Attachment:
    """Where the manifest's `serves` path attaches on `pipe`: a module, or a module's method.

    A `torch.compile` wrapper on the path is seen through (its module is served, and the
    pipeline's attribute is set back to it once every module is attached); a module another
    adoption serves (than `mine`) is refused, naming it, and a copy's stand-in (`Unserved`) is a
    plain module's.
    """
    obj = pipe
    parts = path.split(".")
    unwraps: list[tuple[Any, str, nn.Module]] = []
    for i, part in enumerate(parts):
        owner = obj
        try:
            obj = getattr(obj, part)
        except AttributeError:
            have = type(owner).__name__
            raise AttachError(
                f"the manifest of {family or 'its family'} serves {path!r}, and the pipeline's "
                f"{'.'.join(['pipe', *parts[:i]])} (a {have}) has no {part!r}: is it another family's?"
            ) from None
        if (inner := _compiled(obj)) is not None:
            unwraps.append((owner, part, obj))
            obj = inner
    if isinstance(obj, nn.Module):
        _refuse_served(path, obj.__dict__.get("forward"), mine)
        return Attachment(obj, None, obj, tuple(unwraps))
    _refuse_served(path, obj, mine)
    if mine is not None and obj is mine and isinstance(owner, nn.Module):
        return Attachment(owner, parts[-1], obj, tuple(unwraps))  # this adoption's own router
    if isinstance(obj, Unserved) and obj.module is owner:
        obj = obj.eager
    if isinstance(owner, nn.Module) and callable(obj) and getattr(obj, "__self__", None) is owner:
        return Attachment(owner, parts[-1], obj, tuple(unwraps))
    raise AttachError(f"pipe.{path} is a {type(obj).__name__}: a module or a module's method is served")


def _refuse_served(path: str, router: Any, mine: Adopted | None) -> None:
    if isinstance(router, Adopted) and router is not mine:
        by = _SERVED.get(router)
        first = f"by {by}, an earlier adopt_pipeline" if by else "by an Adopted installed on it"
        raise AttachError(
            f"pipe.{path} is already served ({first}): release() that adoption first, "
            "or keep serving through it"
        )


def _compiled(obj: Any) -> nn.Module | None:
    """The module a `torch.compile` wrapper (`OptimizedModule`) holds, else None. Only a process
    that imported dynamo can hold one, so this never imports it."""
    frame = sys.modules.get("torch._dynamo.eval_frame")
    wrapper = getattr(frame, "OptimizedModule", None)
    if wrapper is not None and isinstance(obj, wrapper) and isinstance(obj._orig_mod, nn.Module):
        return obj._orig_mod
    return None


def _held(pipe: Any, path: str, attr: str | None) -> Any:
    """What the pipeline holds at `path` now: the module, or the owner of the method `attr`."""
    obj = pipe
    for part in path.split(".")[: -1 if attr is not None else None]:
        obj = getattr(obj, part, None)
    return obj


def warm_inputs(contract: CallContract, device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A call the contract takes: each tensor leaf zeros of its dtype, traced shape and strides
    (a symbolic size at its range's low end, at least 2), each constant as baked."""
    sizes = {s.name: max(2, s.min or 2) for s in contract.symbols}
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for spec in contract.inputs:
        leaves = [_leaf(w, sizes, device) for w in spec.leaves]
        value = leaves[0] if len(leaves) == 1 else tuple(leaves)
        if spec.keyword:
            kwargs[spec.name] = value
        else:
            args.append(value)
    return tuple(args), kwargs


def _leaf(want: Leaf | Baked, sizes: Mapping[str, int], device: torch.device) -> Any:
    if not isinstance(want, Leaf):
        return want  # a constant the program baked: passed as baked
    shape = [d if isinstance(d, int) else sizes.get(d, 2) for d in want.shape]
    dtype = getattr(torch, want.dtype)
    stride = [s for s in want.stride or () if isinstance(s, int)]
    if stride and len(stride) == len(shape):  # traced strides that are all integers
        return torch.empty_strided(shape, stride, dtype=dtype, device=device).zero_()
    return torch.zeros(shape, dtype=dtype, device=device)
