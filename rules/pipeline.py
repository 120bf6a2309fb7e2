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
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from cgbuild_rules.adopt.artifact import PLAIN, Artifact, ConfigCheck
from cgbuild_rules.adopt.host import module_device
from cgbuild_rules.adopt.manifest import manifest_artifacts
from cgbuild_rules.adopt.refusal import AdoptRefused, CompiledRequired
from cgbuild_rules.adopt.router import Adopted
from torch import nn

from cgbuild.core import jsonfile
from cgbuild.protocol.manifest import read_modules
from cgbuild.store.local import Store
from cgbuild.store.shared import SharedStore

LAYERWISE_CASTING = "layerwise_casting"
"""diffusers' name for the hook a model's reported dtype is read from first."""

__all__ = ["AttachError", "CompiledRequired", "ServedPipeline", "adopt_pipeline"]


class AttachError(ValueError):
    """The caller asked for what cannot be: the pipeline has no such attribute, or the manifest
    is another family's."""


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


class ServedPipeline:
    """A pipeline whose manifest modules are served compiled; `served(...)` is `pipe(...)`."""

    def __init__(self, pipe: Any, family: str, components: dict[str, Component]) -> None:
        self.pipe = pipe
        self.family = family
        self.components = components

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.pipe(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """Everything else is the pipeline's (`served.transformer`, `served.scheduler`, ...)."""
        if name in ("pipe", "family", "components"):  # not set yet: no recursion through pipe
            raise AttributeError(name)
        return getattr(self.pipe, name)

    @property
    def counters(self) -> dict[str, dict[str, int]]:
        """Per component: how its calls were served (`compiled`, `eager:<code>`, `refused:<code>`)."""
        return {name: dict(c.adopted.counters) for name, c in self.components.items()}

    def rebind(self) -> None:
        """After a weight or LoRA swap: re-arm what the module now matches (`Adopted.rebind`)."""
        for c in self.components.values():
            c.adopted.rebind()

    def release(self) -> None:
        """Detach every component: the pipeline calls its own modules again, as before."""
        for c in self.components.values():
            if c.attr is None:
                c.adopted.release()
            else:
                c.owner.__dict__.pop(c.attr, None)
            if c.undo is not None:
                c.undo()
        self.components = {}

    def warmup(self) -> dict[str, Any]:
        """Run every armed graph class once on its declared shapes (zeros, on the module's device),
        so no request pays a first call: `{"seconds": {label: s}, "not_compiled": {label: why}}`."""
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
    try:
        for name, module_doc in modules.items():
            owner, attr, target = _attachment(pipe, module_doc.serves, family)
            live = target if attr is None else owner
            call = module_doc.call
            config = ConfigCheck(traced_as=call.traced_class, substitutes=call.substitutes) if call else PLAIN
            load = functools.partial(
                manifest_artifacts, name, module_doc.entries, live, store, memory_bytes, layouts.get(name)
            )
            arts, chosen = load(config)
            undo = report_compute_dtype(live, arts) if attr is None else None
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
            eager = None if attr is None else target
            adopted = Adopted(
                live, arts, eager=eager, compiled_only=label if compiled_only else None, call=module_doc.call
            )
            if attr is None:
                adopted.install()
            else:
                owner.__dict__[attr] = adopted
            components[name] = Component(name, module_doc.serves, adopted, owner, attr, undo)
    except BaseException:
        ServedPipeline(pipe, family, components).release()
        raise
    return ServedPipeline(pipe, family, components)


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

    class ComputesIn(ModelHook):  # type: ignore[misc]
        cgbuild_inert = True  # cgbuild_rules.traced.INERT: wraps the forward, changes no call

        def __init__(self, dtype: torch.dtype) -> None:
            super().__init__()
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
        for spec in art.contract.get("inputs") or []:
            for leaf in spec.get("leaves") or []:
                if isinstance(leaf, Mapping) and isinstance(leaf.get("dtype"), str):
                    dtype = getattr(torch, leaf["dtype"], None)
                    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
                        return dtype
    return None


def _manifest(manifest: str | os.PathLike[str] | Mapping[str, Any]) -> Any:
    """The manifest, read from its file through the engine's bounded JSON reader when it is one;
    `read_modules` then refuses what is not a manifest, by field."""
    return (
        manifest if isinstance(manifest, Mapping) else jsonfile.load(os.fspath(manifest), "serving manifest")
    )


def _attachment(pipe: Any, path: str, family: str) -> tuple[Any, str | None, Any]:
    """(owner, method name or None, the callable) the manifest's `serves` path names on `pipe`."""
    obj = pipe
    parts = path.split(".")
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
    if isinstance(obj, nn.Module):
        return obj, None, obj
    if isinstance(owner, nn.Module) and callable(obj) and getattr(obj, "__self__", None) is owner:
        return owner, parts[-1], obj
    raise AttachError(f"pipe.{path} is a {type(obj).__name__}: a module or a module's method is served")


def warm_inputs(contract: Mapping[str, Any], device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A call the contract takes: each tensor leaf zeros of its dtype, traced shape and strides
    (a symbolic size at its range's low end, at least 2), each constant as baked."""
    sizes = {s["name"]: max(2, int(s.get("min") or 2)) for s in contract.get("symbols") or []}
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for spec in contract.get("inputs") or []:
        leaves = [_leaf(w, sizes, device) for w in spec.get("leaves") or []]
        value = leaves[0] if len(leaves) == 1 else tuple(leaves)
        if spec.get("keyword"):
            kwargs[spec["name"]] = value
        else:
            args.append(value)
    return tuple(args), kwargs


def _leaf(want: Any, sizes: Mapping[str, int], device: torch.device) -> Any:
    if not isinstance(want, Mapping):
        return want  # a constant the program baked: passed as baked
    shape = [d if isinstance(d, int) else sizes.get(str(d), 2) for d in want["shape"]]
    dtype = getattr(torch, want["dtype"])
    stride = want.get("stride")
    if stride and all(isinstance(s, int) for s in stride):
        return torch.empty_strided(shape, stride, dtype=dtype, device=device).zero_()
    return torch.zeros(shape, dtype=dtype, device=device)
