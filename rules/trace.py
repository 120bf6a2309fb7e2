"""The trace rule: entry protocol, export of one job, and the `python -m cgbuild_rules.trace` worker.

An entry is `"module:function"`, imported with the job's `root` (the Cgfile's folder) first on
`sys.path`. cgbuild calls `function(spec)` and gets `(module, args, kwargs)` or
`(module, args, kwargs, dynamic_shapes)`. cgbuild, not the entry, owns every context: the entry
runs under FakeTensorMode (or the meta device), `torch.device(device)`, the spec's default dtype
(constructing under `set_default_dtype` works where `.to(dtype)` fails on fake parameters) and
`torch.no_grad()`; the module is put in eval mode. So one entry serves digests, mints and CPU
and CUDA targets without ever moving a tensor. `spec["lanes"]` names, per lane axis, the values
to compile into the program (`{}` without lanes): the entry builds one
`cgbuild_rules.lanes.LaneSwitch` per axis carrying all of them, and the export adds the lane
selector as one keyword input, made beside the entry's inputs (`cgbuild_rules.lanes.export`;
docs/lanes.md).

Build modes of `export_job`:
- `fake`: FakeTensorMode; no weight memory at all (a 4B transformer traces in < 0.5 GB). Digests.
- `empty`: build on the meta device, then `module.to_empty(device)` and real (zero) inputs on the
  device: what AOTInductor can compile (it refuses fake tensors). Same digest as `fake`.
- `real`: real random weights (seed 0) on the device: the reference both are checked against.

Trace-baked literals (non-persistent buffers and plain tensor attributes: constants that are not
state-dict weights) enter the digest by VALUE. Fake and meta builds hide those values, so when a
module holds any, the entry is built once more on CPU with parameters and persistent buffers sent
to the meta device (cheap even for billions of parameters) and only the literals computed for
real (seed 0); their values are read by FQN. In `empty` mode they are also installed into the
module, so the compiled artifact bakes the same values the digest names. A literal that cannot be
reached by FQN (e.g. a tensor kept in a Python list) is refused as `literal-hidden` rather than
hashed by shape alone; `real` mode sees it.

CUDA targets trace on a CPU-only box when torch is a CUDA build (fake CUDA tensors are supported
by FakeTensorMode); with a CPU-only torch the job is refused as `no-cuda-torch` without trying:
the CPU wheel aborts on fake CUDA parameters.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import torch
from cgbuild_rules import configured
from cgbuild_rules import dims as declared_dims
from cgbuild_rules import lanes as lane_rt
from cgbuild_rules import quant as quant_rules
from cgbuild_rules.digest import TraceError, graph_facts, is_hidden
from cgbuild_rules.loader import state_tensors
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import ExportedProgram
from torch.utils._pytree import MappingKey, keystr, tree_flatten_with_path, tree_map

from cgbuild.core.codes import Code
from cgbuild.identity.quantrule import QUANT_RULES
from cgbuild.protocol.trace import FACT_KEYS, REQUEST_SCHEMA, SPEC_KEYS, BadJob, TraceJob

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
Mode = Literal["fake", "empty", "real"]
MODES: tuple[str, ...] = ("fake", "empty", "real")


class EntryError(TraceError):
    """The entry could not be imported, raised inside build(), or returned the wrong shape."""

    code = Code.ENTRY_ERROR


class NoCudaTorch(TraceError):
    """A CUDA target asked of a CPU-only torch build: refused before any attempt."""

    code = Code.NO_CUDA_TORCH


# -- quant layouts ---------------------------------------------------------------------------------
def apply_quant(
    module: nn.Module, quant: str, dtype: str | None = None, lanes: Mapping[str, Sequence[str]] | None = None
) -> nn.Module:
    """Apply the layout's quant rule to a freshly built module; the single place rules plug in.

    `dtype` is the layout's compute dtype (the spec's; a plain rule's own when omitted). The
    module must have been built in it: a parameter of another floating dtype means the spec and
    the layout disagree. Quantized rules then replace their eligible modules
    (`cgbuild_rules.quant.convert`) BEFORE export, so the digest is the quantized program's;
    `lanes` (the spec's) carries the values of the rule's own lane axes, when it has any.
    Unknown rules are refused: silently tracing an unquantized graph under a quant layout would
    key an artifact for tensors it cannot bind.
    """
    record = QUANT_RULES.get(quant)
    if record is None:
        known = ", ".join(sorted(QUANT_RULES))
        raise TraceError(f"unknown quant rule {quant!r} (known: {known})")
    name = dtype or record.dtype
    allowed = " or ".join(record.compute)
    if name is None:
        raise TraceError(f"quant rule {quant!r} needs a compute dtype ({allowed})")
    if name not in record.compute or name not in DTYPES:
        raise TraceError(f"quant rule {quant!r} computes in {allowed}, not {name}")
    want = DTYPES[name]
    for fqn, p in module.named_parameters():
        if p.is_floating_point() and p.dtype != want:
            raise TraceError(
                f"quant rule {quant!r} expects {want} parameters but {fqn} is {p.dtype} "
                "(the spec dtype and the layout disagree)"
            )
    try:
        module, _ = quant_rules.convert(module, quant, want, lanes)
    except quant_rules.QuantError as e:
        raise TraceError(str(e)) from None
    return module


# -- jobs ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    """One validated trace job."""

    id: str
    entry: str
    root: str
    spec: dict[str, Any]
    """The spec build() receives, with `config` folded in."""
    quant: str

    @property
    def device(self) -> str:
        return str(self.spec["device"])

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.spec["dtype"]]


def parse_job(raw: Mapping[str, Any]) -> Job:
    """Validate one job of a trace request; malformed jobs are `trace-failed` with a 'bad job' detail."""
    try:
        job = TraceJob.from_json(raw)
    except BadJob as e:
        raise TraceError(str(e)) from None
    if job.spec["dtype"] not in DTYPES:
        raise TraceError(f"bad job: dtype {job.spec['dtype']!r} not in {sorted(DTYPES)}")
    # `lanes`: the values of each declared axis compiled into this program (docs/lanes.md);
    # always present for the entry, {} when the family declares none.
    spec = {k: job.spec[k] for k in SPEC_KEYS} | {
        "frames": job.spec.get("frames"),  # None for an image module
        "ranges": dict(job.spec.get("ranges") or {}),  # {} for a module without a declared range
        "config": dict(job.config),
        "lanes": dict(job.spec.get("lanes") or {}),
    }
    return Job(id=str(job.id), entry=job.entry, root=job.root, spec=spec, quant=job.quant)


def check_device(device: str) -> None:
    if device == "cuda" and torch.version.cuda is None:
        raise NoCudaTorch(f"CUDA target but torch {torch.__version__} is a CPU-only build")


# -- entries ---------------------------------------------------------------------------------------
def _defined_under(module: Any, root: Path) -> bool:
    f = getattr(module, "__file__", None)
    return f is not None and Path(f).resolve().is_relative_to(root)


def load_entry(entry: str, root: str) -> Callable[[dict[str, Any]], Any]:
    """Import `module:function` with `root` first on sys.path.

    Jobs from several Cgfile folders share one worker: a module name already imported from
    another root is dropped and re-imported from this one when this root provides it.
    """
    modname, sep, fname = entry.partition(":")
    if not sep or not modname or not fname:
        raise EntryError(f"entry {entry!r} is not 'module:function'")
    base = Path(root).resolve()
    if str(base) in sys.path:
        sys.path.remove(str(base))
    sys.path.insert(0, str(base))
    top = modname.split(".")[0]
    loaded = sys.modules.get(top)
    provides = (base / f"{top}.py").exists() or (base / top).is_dir()
    if loaded is not None and provides and not _defined_under(loaded, base):
        for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
            del sys.modules[name]
    try:
        obj: Any = importlib.import_module(modname)
        for part in fname.split("."):
            obj = getattr(obj, part)
    except Exception as e:
        raise EntryError(f"cannot load entry {entry!r}: {type(e).__name__}: {e}") from None
    if not callable(obj):
        raise EntryError(f"entry {entry!r} is not callable")
    return cast(Callable[[dict[str, Any]], Any], obj)


@dataclass
class Built:
    """What an entry returned, validated."""

    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    dynamic_shapes: Any = None
    selector: torch.Tensor | None = None
    """The lane selector the export adds to the call (`cgbuild_rules.lanes.export`), made beside
    the inputs (fake, meta or real); None when no switch has two values."""


def _unpack(out: Any) -> Built:
    if not isinstance(out, tuple) or len(out) not in (3, 4):
        raise EntryError(
            "build() must return (module, args, kwargs) or (module, args, kwargs, dynamic_shapes)"
        )
    module, args, kwargs = out[0], out[1], out[2]
    if not isinstance(module, nn.Module):
        raise EntryError(f"build() returned a {type(module).__name__}, not an nn.Module")
    if not isinstance(args, tuple) or not isinstance(kwargs, dict):
        raise EntryError("build() must return args as a tuple and kwargs as a dict")
    return Built(module, args, kwargs, out[3] if len(out) == 4 else None)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@contextlib.contextmanager
def weights_on_meta() -> Iterator[None]:
    """Send parameters and persistent buffers to meta as they are registered.

    Leaves non-persistent buffers and plain tensor attributes real, so literals are computed
    without paying for (or initialising) the weights.
    """
    reg_param = nn.Module.register_parameter
    reg_buffer = nn.Module.register_buffer

    def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        reg_param(self, name, param)

    def register_buffer(
        self: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True
    ) -> None:
        if persistent and tensor is not None:
            tensor = tensor.to("meta")
        reg_buffer(self, name, tensor, persistent)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    nn.Module.register_buffer = register_buffer  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = reg_param  # type: ignore[method-assign]
        nn.Module.register_buffer = reg_buffer  # type: ignore[method-assign]


def literal_attributes(module: nn.Module) -> dict[str, torch.Tensor]:
    """FQN → tensor of the module's trace-baked literals: non-persistent buffers and plain tensor
    attributes (what torch.export lifts into constants rather than the state dict)."""
    out: dict[str, torch.Tensor] = {}
    for prefix, mod in module.named_modules():
        dot = f"{prefix}." if prefix else ""
        for name, buf in mod._buffers.items():
            if buf is not None and name in mod._non_persistent_buffers_set:
                out[dot + name] = buf
        for name, value in vars(mod).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                out[dot + name] = value
    return out


def _set_attribute(module: nn.Module, fqn: str, value: torch.Tensor) -> None:
    prefix, _, name = fqn.rpartition(".")
    owner = module.get_submodule(prefix) if prefix else module
    if name in owner._buffers:
        owner._buffers[name] = value
    else:
        setattr(owner, name, value)


def _ties(module: nn.Module) -> list[list[str]]:
    """Names under which one parameter or buffer object is registered (tied weights), per object."""
    names: dict[int, list[str]] = {}
    for fqn, t in state_tensors(module).items():
        names.setdefault(id(t), []).append(fqn)
    return [group for group in names.values() if len(group) > 1]


def _retie(module: nn.Module, ties: list[list[str]]) -> None:
    """Tie again what `to_empty` untied: it gives every registration its own new tensor, so a
    tied embedding and LM head would export as two weights (another program: `graph-drift`)."""
    tensors = state_tensors(module)
    for first, *rest in ties:
        for fqn in rest:
            prefix, _, name = fqn.rpartition(".")
            other = module.get_submodule(prefix) if prefix else module
            table: dict[str, Any] = other._parameters if name in other._parameters else other._buffers
            table[name] = tensors[first]


def check_not_broadcast(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """Refuse an input with a stride-0 (expanded) dimension longer than one.

    Its trace would compile a program that reads one element along that dimension, and a
    caller's values are constant there only when the caller passes the same broadcast: the
    router could serve nothing else (a copy cannot be written into a stride-0 layout). Traced
    contiguous, the program serves every caller, an expanded one on a copy (`restrided`)."""
    for path, leaf in tree_flatten_with_path((args, kwargs))[0]:
        if not isinstance(leaf, torch.Tensor):
            continue
        for dim, (size, stride) in enumerate(zip(leaf.shape, leaf.stride(), strict=True)):
            if stride == 0 and size > 1:
                head = path[1]
                name = head.key if isinstance(head, MappingKey) else f"args{keystr(path[1:2])}"
                raise EntryError(
                    f"entry input {name}{keystr(path[2:])} {list(leaf.shape)} has stride 0 on "
                    f"dimension {dim} (an expanded, broadcast view): trace it contiguous "
                    "(`.contiguous()` or `.clone()`); a caller that passes the expanded view is "
                    "served on a copy"
                )


def call_entry(fn: Callable[[dict[str, Any]], Any], spec: dict[str, Any], quant: str) -> Built:
    reads = declared_dims.SpecReads(spec)
    try:
        built = _unpack(fn(reads))
        built.module.eval()
    except TraceError:
        raise
    except Exception as e:
        raise EntryError(f"build() raised {type(e).__name__}: {e}") from None
    declared_dims.check_read(spec, reads)
    check_not_broadcast(built.args, built.kwargs)
    built.module = apply_quant(built.module, quant, spec.get("dtype"), spec.get("lanes"))
    return built


def build(job: Job, mode: Mode, fn: Callable[[dict[str, Any]], Any] | None = None) -> Built:
    """Run the entry under cgbuild's contexts for `mode` (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    check_device(job.device)
    fn = fn or load_entry(job.entry, job.root)
    device = torch.device(job.device)
    with contextlib.ExitStack() as stack:
        stack.enter_context(default_dtype(job.dtype))
        stack.enter_context(torch.no_grad())
        if mode == "fake":
            stack.enter_context(FakeTensorMode())
            stack.enter_context(device)
        elif mode == "empty":
            stack.enter_context(torch.device("meta"))
        else:
            torch.manual_seed(0)
            stack.enter_context(device)
        built = call_entry(fn, job.spec, job.quant)
        built.selector = lane_rt.selector_of(built.module)
    if mode == "empty":
        ties = _ties(built.module)
        with torch.no_grad():
            built.module.to_empty(device=device)
        _retie(built.module, ties)

        def real(x: Any) -> Any:
            """Zeros laid out as the entry laid its input out: a program traced on other strides
            than its callers pass reads their memory as if laid out otherwise (wrong answers)."""
            if isinstance(x, torch.Tensor) and x.is_meta:
                return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device).zero_()
            return x

        built.args = tree_map(real, built.args)
        built.kwargs = tree_map(real, built.kwargs)
        built.selector = real(built.selector)
    return built


def literal_values(job: Job, fn: Callable[[dict[str, Any]], Any] | None = None) -> dict[str, torch.Tensor]:
    """Real CPU values of the entry's literals, by FQN, with the weights kept on meta (seed 0)."""
    fn = fn or load_entry(job.entry, job.root)
    torch.manual_seed(0)
    with default_dtype(job.dtype), torch.no_grad(), weights_on_meta(), torch.device("cpu"):
        built = call_entry(fn, job.spec, job.quant)
    return {
        fqn: t.detach().clone() for fqn, t in literal_attributes(built.module).items() if not is_hidden(t)
    }


def range_calls(
    job: Job, fn: Callable[[dict[str, Any]], Any] | None = None
) -> list[tuple[dict[str, int], tuple[Any, ...], dict[str, Any]]]:
    """The entry's call at every point a mint checks a declared range at (its ends and inside)
    but the traced size, each range in turn with the others at their traced sizes: (the size,
    args, kwargs). Real inputs on the job's device (seed 0); the weights go to meta, as only the
    inputs are kept: the caller holds the module they are run through."""
    calls: list[tuple[dict[str, int], tuple[Any, ...], dict[str, Any]]] = []
    ranges = declared_dims.declared_ranges(job.spec)
    if not ranges:
        return calls
    fn = fn or load_entry(job.entry, job.root)
    for name, declared in ranges.items():
        for size in declared.points:
            if size == job.spec[name]:
                continue
            torch.manual_seed(0)
            with default_dtype(job.dtype), torch.no_grad(), weights_on_meta(), torch.device(job.device):
                built = call_entry(fn, {**job.spec, name: size}, job.quant)
            calls.append(({name: size}, built.args, built.kwargs))
    return calls


def export_job(job: Job | Mapping[str, Any], mode: Mode = "fake") -> tuple[ExportedProgram, dict[str, Any]]:
    """Export one job (default, pre-decomposition export) and compute its graph facts.

    Returns the ExportedProgram and {graph_digest, contract, topology, nodes, torch, mode, identity,
    module} (`identity`: the digested object, to show what moved when two digests differ;
    `module`: the module's configuration as built, `cgbuild_rules.configured.record`).
    `fake`, `empty` and `real` give the same digest; only `empty`/`real` programs can be compiled.
    Raises TraceError subclasses carrying the result code.
    """
    if not isinstance(job, Job):
        job = parse_job(job)
    check_device(job.device)
    fn = load_entry(job.entry, job.root)
    built = build(job, mode, fn)
    values: dict[str, torch.Tensor] = {}
    if mode != "real" and literal_attributes(built.module):
        values = literal_values(job, fn)
        if mode == "empty":
            for fqn, value in values.items():
                _set_attribute(built.module, fqn, value.to(job.device))
    declared_dims.check_exported(job.spec, built.dynamic_shapes)
    configuration = configured.record(built.module)  # before export: it may set attributes
    try:
        with torch.no_grad():
            ep = lane_rt.export(built.module, built.args, built.kwargs, built.dynamic_shapes, built.selector)
    except Exception as e:
        raise TraceError(f"torch.export failed: {type(e).__name__}: {e}") from None
    try:
        facts = graph_facts(ep, values)
    except TraceError:
        raise
    except Exception as e:
        raise TraceError(f"digest failed: {type(e).__name__}: {e}") from None
    return ep, {
        "graph_digest": facts.digest,
        "contract": facts.contract,
        "topology": facts.topology,
        "nodes": facts.nodes,
        "torch": torch.__version__,
        "mode": mode,
        "identity": facts.identity,
        "module": configuration,
    }


def _one_line(text: str, limit: int = 600) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def run_job(job: Mapping[str, Any]) -> dict[str, Any]:
    """Trace one raw job and return its result line; never raises for a job's own failure."""
    start = time.perf_counter()
    job_id = job.get("id") if isinstance(job, Mapping) else None
    try:
        parsed = parse_job(job)
        _, facts = export_job(parsed, "fake")
    except TraceError as e:
        field = {"field": e.field} if isinstance(e, declared_dims.DimensionMismatch) else {}
        return {"id": job_id, "ok": False, "code": e.code, "detail": _one_line(str(e)), **field}
    except Exception as e:  # a torch internal error must not take the other jobs down
        return {
            "id": job_id,
            "ok": False,
            "code": Code.TRACE_FAILED,
            "detail": _one_line(f"{type(e).__name__}: {e}"),
        }
    return {
        "id": parsed.id,
        "ok": True,
        **{k: facts[k] for k in FACT_KEYS},
        "seconds": round(time.perf_counter() - start, 3),
    }


# -- worker ----------------------------------------------------------------------------------------
def _result_json(line: Mapping[str, Any]) -> str:
    return json.dumps(line, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def main() -> int:
    """Read one trace request on stdin; write one result line per job on stdout, as each finishes.

    File descriptor 1 is handed to the protocol alone: prints from entries, torch or diffusers
    (Python or C++) go to stderr, so a chatty model can never corrupt a result line.
    """
    proto = os.fdopen(os.dup(1), "w", encoding="ascii")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        request = json.loads(sys.stdin.read())
        if not isinstance(request, dict) or request.get("schema") != REQUEST_SCHEMA:
            raise ValueError(f"schema must be {REQUEST_SCHEMA!r}")
        jobs = request.get("jobs")
        if not isinstance(jobs, list):
            raise ValueError("jobs must be a list")
    except ValueError as e:
        print(f"cgbuild_rules.trace: bad request: {e}", file=sys.stderr)
        return 2
    for job in jobs:
        line = (
            run_job(job)
            if isinstance(job, dict)
            else {"id": None, "ok": False, "code": Code.TRACE_FAILED, "detail": "bad job: not an object"}
        )
        proto.write(_result_json(line) + "\n")
        proto.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
