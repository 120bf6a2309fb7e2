"""Tiny diffusers pipelines on the CPU (FLUX.2 [klein], SDXL), random seeded weights, nothing
downloaded, and recorders of what one run of a pipeline asks of its components: the calls it makes
(what a module put in a component's place must accept and return) and the attributes it reads
(what that module must also carry)."""

from __future__ import annotations

import sys
import tomllib
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# From their modules, not the package: under a type checker `diffusers.X` names a dummy class.
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from diffusers.models.autoencoders.autoencoder_kl_flux2 import AutoencoderKLFlux2
from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModel
from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl import StableDiffusionXLPipeline
from diffusers.schedulers.scheduling_euler_discrete import EulerDiscreteScheduler
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

ZOO_CGFILE = Path(__file__).resolve().parents[1] / "zoo" / "Cgfile"

SDXL_TEXT_DIM = 64
"""Width of SDXL's per-token text embedding (both CLIP encoders' hidden states, concatenated)."""
SDXL_POOLED_DIM = 32
"""Width of SDXL's pooled text embedding (the second encoder's projection)."""
SDXL_TIME_EMBED_DIM = 8
"""Per-number width of SDXL's six size conditioning numbers (original size, crop, target size)."""


def zoo_pipe_config() -> dict[str, Any]:
    """The `zoo-pipe` family's `transformer` and `vae` kwargs, read from the zoo's Cgfile so the
    pipeline's components are the ones that family compiles."""
    cgfile = tomllib.loads(ZOO_CGFILE.read_text())
    return dict(cgfile["family"]["zoo-pipe"]["config"])


def flux2_klein_pipeline(seed: int = 0, *, is_distilled: bool = True) -> Flux2KleinPipeline:
    """A FLUX.2 [klein] pipeline of the tiny family's transformer, a 4-level (8x) VAE and the
    default flow-matching scheduler, without text encoder or tokenizer: called with
    `prompt_embeds` (batch, text, joint_attention_dim). 64x64 pixels are 16 image tokens, as
    flux2_entry.py counts them (VAE /8, then 2x2 patches).

    `is_distilled` (the step-distilled klein) skips classifier-free guidance, which would otherwise
    encode the empty negative prompt unless `negative_prompt_embeds` is passed; undistilled, CFG is
    two transformer calls a step (cond, then uncond), each of batch 1.
    """
    with torch.random.fork_rng(devices=[]):  # seeded without moving the caller's generator
        torch.manual_seed(seed)
        config = zoo_pipe_config()
        transformer = Flux2Transformer2DModel(**config["transformer"]).eval()
        # the pipeline packs 2x2 latent pixels per token
        if config["transformer"]["in_channels"] != 4 * config["vae"]["latent_channels"]:
            raise ValueError("the transformer's in_channels must be 4x the VAE's latent channels")
        vae = AutoencoderKLFlux2(**config["vae"]).eval()
        # Not the identity a fresh BatchNorm holds: the pipeline de-normalizes the latents with these
        # running stats before decoding, and with the identity a path that skipped that would match.
        generator = torch.Generator().manual_seed(seed)
        channels = vae.bn.num_features
        assert vae.bn.running_mean is not None and vae.bn.running_var is not None
        vae.bn.running_mean.copy_(0.1 * torch.randn(channels, generator=generator))
        vae.bn.running_var.copy_(0.5 + torch.rand(channels, generator=generator))
    pipe = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=None,  # type: ignore[arg-type]  # annotated as required, None accepted
        tokenizer=None,
        transformer=transformer,
        is_distilled=is_distilled,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def flux2_klein_inputs(
    pipe: Flux2KleinPipeline, seed: int = 0, *, text_len: int = 8, batch: int = 1
) -> dict[str, torch.Tensor]:
    """`prompt_embeds` and `negative_prompt_embeds` for `pipe` (the width its transformer takes)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, text_len, pipe.transformer.config.joint_attention_dim)
    return {
        "prompt_embeds": torch.randn(shape, generator=generator),
        "negative_prompt_embeds": torch.randn(shape, generator=generator),
    }


def sdxl_pipeline(seed: int = 0) -> StableDiffusionXLPipeline:
    """An SDXL pipeline of a 2-level UNet (text-time added conditioning, as SDXL's), a 2-level (2x)
    VAE with SDXL's scaling factor and SDXL's Euler scheduler, without text encoders, tokenizers
    or watermarker: called with the four prompt embeddings (`sdxl_inputs`). Its default size is
    64x64 pixels (32x32 latents)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        config = tomllib.loads(ZOO_CGFILE.read_text())["family"]["zoo-sdxl"]["config"]
        unet = UNet2DConditionModel(**config["unet"]).eval()
        vae = AutoencoderKL(**config["vae"]).eval()
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        steps_offset=1,
        timestep_spacing="leading",
    )
    pipe = StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=None,  # type: ignore[arg-type]  # annotated as required, None accepted
        text_encoder_2=None,  # type: ignore[arg-type]
        tokenizer=None,  # type: ignore[arg-type]
        tokenizer_2=None,  # type: ignore[arg-type]
        unet=unet,
        scheduler=scheduler,
        add_watermarker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def sdxl_inputs(seed: int = 0, *, text_len: int = 8, batch: int = 1) -> dict[str, torch.Tensor]:
    """The embeddings SDXL's two text encoders would give: without encoders the pipeline takes
    all four (the negative ones only under guidance; absent, it zero-fills them)."""
    generator = torch.Generator().manual_seed(seed)
    text, pooled = (batch, text_len, SDXL_TEXT_DIM), (batch, SDXL_POOLED_DIM)
    return {
        "prompt_embeds": torch.randn(text, generator=generator),
        "negative_prompt_embeds": torch.randn(text, generator=generator),
        "pooled_prompt_embeds": torch.randn(pooled, generator=generator),
        "negative_pooled_prompt_embeds": torch.randn(pooled, generator=generator),
    }


# What a call passes and returns, described.

_SMALL = 16
"""Tensors of at most this many elements are described with their values (timesteps, time ids)."""


@dataclass(frozen=True)
class TensorInfo:
    """A tensor as a compiled callee sees it: geometry and placement; values only when small."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...]
    contiguous: bool
    device: str
    requires_grad: bool
    values: tuple[float | int | bool, ...] | None = None

    def __str__(self) -> str:
        text = f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)} stride={self.stride}"
        if not self.contiguous:
            text += " NON-CONTIGUOUS"
        if self.device != "cpu":
            text += f" on {self.device}"
        if self.values is not None:
            text += f" = {list(self.values)}"
        return text


@dataclass(frozen=True)
class ValueInfo:
    """Anything else passed: its type and repr (None, bools, ints, strings, dicts of options)."""

    type: str
    value: str

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class SeqInfo:
    """A tuple or list, each item described."""

    type: str
    items: tuple[Described, ...]

    def __str__(self) -> str:
        return f"{self.type}({', '.join(map(str, self.items))})"


@dataclass(frozen=True)
class MapInfo:
    """A dict (SDXL's `added_cond_kwargs`), each value described."""

    type: str
    items: tuple[tuple[str, Described], ...]

    def __str__(self) -> str:
        return "{" + ", ".join(f"{k}: {v}" for k, v in self.items) + "}"


Described = TensorInfo | ValueInfo | SeqInfo | MapInfo


def describe(value: Any) -> Described:
    if isinstance(value, torch.Tensor):
        small = value.numel() <= _SMALL and value.device.type != "meta"
        return TensorInfo(
            shape=tuple(value.shape),
            dtype=value.dtype,
            stride=tuple(value.stride()),
            contiguous=value.is_contiguous(),
            device=str(value.device),
            requires_grad=value.requires_grad,
            values=tuple(value.detach().flatten().tolist()) if small else None,
        )
    if isinstance(value, tuple | list):
        return SeqInfo(type(value).__name__, tuple(describe(v) for v in value))
    if isinstance(value, Mapping):
        return MapInfo(type(value).__name__, tuple((str(k), describe(v)) for k, v in value.items()))
    text = repr(value)
    return ValueInfo(type(value).__name__, text if len(text) <= 80 else text[:77] + "...")


@dataclass
class CallRecord:
    """One call of a component: positional and keyword arguments, grad mode and the module's
    train flag at the call, what it returned and which parts of that the caller read."""

    args: tuple[Described, ...]
    kwargs: dict[str, Described]
    grad_enabled: bool
    training: bool
    result: Described | None = None
    reads: list[str] = field(default_factory=list)

    def slots(self) -> dict[str, Described]:
        """Arguments by slot: `args[i]` for positional ones, the name for keywords."""
        return {**{f"args[{i}]": a for i, a in enumerate(self.args)}, **self.kwargs}


class _ReadTuple(tuple[Any, ...]):
    """A returned tuple that notes which items the caller takes (`[0]`)."""

    _record: CallRecord

    def __getitem__(self, index: Any) -> Any:
        self._record.reads.append(f"[{index!r}]")
        return super().__getitem__(index)


def _watch_result(result: Any, record: CallRecord) -> Any:
    record.result = describe(result)
    if type(result) is tuple:
        watched = _ReadTuple(result)
        watched._record = record
        return watched
    return result


DENOISERS = ("transformer", "unet")


def record_calls(pipe: DiffusionPipeline, run: Callable[[], object]) -> dict[str, list[CallRecord]]:
    """Every call `run` makes of the pipeline's denoiser (`transformer` or `unet`, by `__call__`,
    seen by forward hooks) and of `vae.decode` (a method, so wrapped for the run), in order."""
    calls: dict[str, list[CallRecord]] = {}
    with ExitStack() as stack:
        for name in DENOISERS:
            module = getattr(pipe, name, None)
            if isinstance(module, torch.nn.Module):
                calls[name] = []
                stack.enter_context(_hooked(module, calls[name]))
        vae = getattr(pipe, "vae", None)
        if isinstance(vae, torch.nn.Module):
            calls["vae.decode"] = []
            stack.enter_context(_wrapped_decode(vae, calls["vae.decode"]))
        run()
    return calls


@contextmanager
def _hooked(module: torch.nn.Module, records: list[CallRecord]) -> Iterator[None]:
    def before(mod: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        records.append(
            CallRecord(
                args=tuple(describe(a) for a in args),
                kwargs={k: describe(v) for k, v in kwargs.items()},
                grad_enabled=torch.is_grad_enabled(),
                training=mod.training,
            )
        )

    def after(mod: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
        return _watch_result(out, records[-1])

    pre = module.register_forward_pre_hook(before, with_kwargs=True)
    post = module.register_forward_hook(after, with_kwargs=True)
    try:
        yield
    finally:
        pre.remove()
        post.remove()


@contextmanager
def _wrapped_decode(vae: torch.nn.Module, records: list[CallRecord]) -> Iterator[None]:
    original: Callable[..., Any] = vae.decode  # type: ignore[assignment]

    def decode(*args: Any, **kwargs: Any) -> Any:
        record = CallRecord(
            args=tuple(describe(a) for a in args),
            kwargs={k: describe(v) for k, v in kwargs.items()},
            grad_enabled=torch.is_grad_enabled(),
            training=vae.training,
        )
        records.append(record)
        return _watch_result(original(*args, **kwargs), record)

    vae.decode = decode  # type: ignore[assignment]  # an instance attribute shadowing the method
    try:
        yield
    finally:
        del vae.decode


def changing(records: list[CallRecord]) -> dict[str, list[Described | None]]:
    """The argument slots whose description differs between the calls (a timestep's value, a
    shape that changes per step, a keyword passed only sometimes), each call's description."""
    slots = [r.slots() for r in records]
    names = sorted({name for s in slots for name in s})
    out: dict[str, list[Described | None]] = {}
    for name in names:
        seen = [s.get(name) for s in slots]
        if any(d != seen[0] for d in seen[1:]):
            out[name] = seen
    return out


def format_calls(calls: dict[str, list[CallRecord]]) -> str:
    """A plain-text table of `record_calls`' result: each distinct call once, with its count."""
    lines: list[str] = []
    for target, records in calls.items():
        lines.append(f"{target}: {len(records)} call(s)")
        for i, record in enumerate(records):
            if i and _same_call(record, records[i - 1]):
                lines.append(f"  call {i}: as call {i - 1}")
                continue
            lines.append(
                f"  call {i}: {len(record.args)} positional, grad={record.grad_enabled},"
                f" training={record.training}"
            )
            lines += [f"    {slot} = {value}" for slot, value in record.slots().items()]
            lines.append(
                f"    -> {record.result}; caller read {', '.join(record.reads) or 'nothing indexed'}"
            )
        for slot, seen in changing(records).items():
            lines.append(f"  changes between calls: {slot}: " + " | ".join(map(str, seen)))
    return "\n".join(lines)


def _same_call(a: CallRecord, b: CallRecord) -> bool:
    return (a.args, a.kwargs, a.result, a.reads) == (b.args, b.kwargs, b.result, b.reads)


# What a run reads off the components besides calling them.

_OWN_CODE = ("/diffusers/models/", "/diffusers/configuration_utils.py", "/torch/")


def _caller_side(filename: str) -> str | None:
    """Where in diffusers a read comes from (`pipelines/...`, `utils/...`, `hooks/...`), or None
    for the component's own code, torch's and anything outside diffusers."""
    if "/diffusers/" not in filename or any(part in filename for part in _OWN_CODE):
        return None
    return filename.rsplit("/diffusers/", 1)[1]


@dataclass
class _Reads:
    """Attribute paths read (`config.in_channels`, `bn.running_mean`) and where from."""

    where: dict[str, set[str]] = field(default_factory=dict)

    def note(self, path: str, depth: int) -> str | None:
        frame = sys._getframe(depth + 1)
        side = _caller_side(frame.f_code.co_filename)
        if side is not None:
            self.where.setdefault(path, set()).add(f"{side}:{frame.f_lineno}")
        return side


class _ReadProxy:
    """A component's config or submodule as handed to pipeline code: reads through it are noted
    with their path (`vae.config.scaling_factor`, `vae.bn.running_var`)."""

    __slots__ = ("_path", "_reads", "_target")

    def __init__(self, target: Any, path: str, reads: _Reads) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_reads", reads)

    def __getattr__(self, name: str) -> Any:
        path = f"{self._path}.{name}"
        try:
            value = getattr(self._target, name)
        except AttributeError:
            self._reads.note(f"{path} (absent)", 1)
            raise
        side = self._reads.note(path, 1)
        return _proxied(value, path, self._reads) if side and side.startswith("pipelines/") else value

    def __getitem__(self, key: Any) -> Any:
        self._reads.note(f"{self._path}[{key!r}]", 1)
        return self._target[key]

    def __contains__(self, key: Any) -> bool:
        return key in self._target

    def __iter__(self) -> Iterator[Any]:
        return iter(self._target)

    def __len__(self) -> int:
        return len(self._target)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._target(*args, **kwargs)


def _proxied(value: Any, path: str, reads: _Reads) -> Any:
    if isinstance(value, torch.nn.Module) or path.endswith(".config"):
        return _ReadProxy(value, path, reads)
    return value


@contextmanager
def _watched_reads(component: torch.nn.Module, name: str, reads: _Reads) -> Iterator[None]:
    """Swap the component's class for a subclass whose attribute lookup notes reads from diffusers
    code outside the models (the pipeline, its base class, the device helpers)."""
    cls = type(component)

    def __getattribute__(self: Any, attr: str) -> Any:
        try:
            value = cls.__getattribute__(self, attr)
        except AttributeError:
            value = cls.__getattr__(self, attr)  # nn.Module's: parameters, buffers, submodules
        side = reads.note(f"{name}.{attr}", 1)
        if side is not None and side.startswith("pipelines/"):
            return _proxied(value, f"{name}.{attr}", reads)
        return value

    watched = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__module__": cls.__module__})
    object.__setattr__(component, "__class__", watched)
    try:
        yield
    finally:
        object.__setattr__(component, "__class__", cls)


def record_attribute_reads(
    pipe: DiffusionPipeline,
    run: Callable[[], object],
    names: tuple[str, ...] = ("transformer", "unet", "vae"),
) -> dict[str, list[str]]:
    """What `run` reads off the named components besides calling them (`transformer.config.
    in_channels`, `vae.bn.running_mean`, `unet.dtype`, `transformer.cache_context`), each path
    with the diffusers locations reading it: all a module put in a component's place must carry.
    Reads the models make of themselves (inside their own forward) are not the pipeline's and are
    left out."""
    reads = _Reads()
    with ExitStack() as stack:
        for name in names:
            component = getattr(pipe, name, None)
            if isinstance(component, torch.nn.Module):
                stack.enter_context(_watched_reads(component, name, reads))
        run()
    return {path: sorted(where) for path, where in sorted(reads.where.items())}
