"""The compile stage: refuse a key this machine cannot build, trace, re-derive the toolchain and
the layout (refusing drift), compile weightless under the one compile policy, normalize.

The sealed constant table is the package loader's own constant list (docs/adopt.md: unused
tensors and BatchNorm counters are not in it; tied tensors are one row with their `aliases`).
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cgbuild_rules.mint.failure import MintFailure
from cgbuild_rules.mint.package import normalize_package
from cgbuild_rules.mint.stages import Conversation, fault

from cgbuild.core.codes import Code
from cgbuild.core.platform import normalize_arch
from cgbuild.identity import compiler, policy
from cgbuild.identity.toolchain import TRACE_ONLY
from cgbuild.protocol.contract import CallContract
from cgbuild.protocol.mint import MintRequest
from cgbuild.protocol.stage import AotiFacts, Compiled, StageEnv, Traced
from cgbuild.protocol.trace import FACT_KEYS
from cgbuild.store.seal import LITERALS, PACKAGE


def _sm_here(device: str) -> str | None:
    """This machine's sm for a job's device (None: it has none)."""
    import torch

    if device == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def _device_refusal(device: str, sm: str, here: str | None) -> None:
    """Refuse a key whose sm is not this machine's (`here`: `_sm_here(device)`), naming the
    `CUDA_VISIBLE_DEVICES` it ran under (`visible`: a fleet node pins it to Ray's GPU)."""
    if device == "cpu":
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    under = "" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible!r})"
    if here is None:
        raise MintFailure(
            Code.WRONG_DEVICE,
            f"key needs {sm} (cuda); this machine has no CUDA device{under}",
            needed=sm,
            found="cpu",
            visible=visible,
        )
    if here != sm:
        raise MintFailure(
            Code.WRONG_DEVICE,
            f"key needs {sm}; this machine's device is {here}{under}",
            needed=sm,
            found=here,
            visible=visible,
        )


def _toolchain(req: MintRequest) -> dict[str, Any]:
    from cgbuild.identity import toolchain, toolchain_changes

    expected = req.toolchain
    plat = expected["platform"]
    block = toolchain.probe(req.cxx)[plat]
    here = {"platform": plat, "fold": toolchain.fold(block["components"]), "components": block["components"]}
    if here["fold"] != expected["fold"]:
        changes = toolchain_changes.component_changes(expected.get("components") or {}, here["components"])
        lines = [toolchain_changes.format_change(c) for c in changes] or ["components unknown to the request"]
        raise MintFailure(
            Code.TOOLCHAIN_DRIFT,
            f"toolchain {plat} moved: {'; '.join(lines)}",
            old=expected["fold"],
            new=here["fold"],
            changes=lines,
        )
    refusal = compiler.isa_refusal(here["components"]["isa"])
    if refusal:
        raise MintFailure(Code.WRONG_HOST, refusal)
    return here


def _constants_table(ep: Any, bound: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    """The constants the compiled package binds (`bound`, its loader's FQNs), with their layout:
    state constants (bound from the live module at adopt) and literals (sealed).

    Exactly what the package names, never what the export lifted: Inductor drops tensors the
    program never reads (a BatchNorm's `num_batches_tracked`, an unused encoder) and binds a
    tied tensor under ONE of its names. Each state row lists under `aliases` the other
    state-dict names that were that same tensor at trace (a tied embedding and LM head): the
    program reads them through the bound name, so adopt requires the live module to keep them
    tied. A package constant the export does not know raises `constant-table-mismatch`.
    """
    from cgbuild_rules.digest import dtype_name
    from cgbuild_rules.loader import same_view

    names = set(bound)
    wanted = set(names)
    table: dict[str, list[dict[str, Any]]] = {"state": [], "literal": []}
    for s in ep.graph_signature.input_specs:
        kind = s.kind.name
        if s.target not in wanted:
            continue
        if kind == "PARAMETER" or (kind == "BUFFER" and s.persistent is not False):
            group, t = "state", ep.state_dict[s.target]
        elif kind in ("BUFFER", "CONSTANT_TENSOR"):
            group, t = "literal", ep.constants[s.target]
        else:
            continue
        wanted.discard(s.target)
        row: dict[str, Any] = {
            "fqn": str(s.target),
            "dtype": dtype_name(t.dtype),
            "shape": [int(d) for d in t.shape],
            "stride": [int(d) for d in t.stride()],
        }
        if group == "state":
            row["aliases"] = sorted(
                name
                for name, other in ep.state_dict.items()
                if name != s.target and name not in names and same_view(t, other)
            )
        table[group].append(row)
    if wanted:
        raise MintFailure(
            Code.CONSTANT_TABLE_MISMATCH,
            f"the package binds constants the exported program does not lift: {sorted(wanted)[:5]}",
        )
    return {g: sorted(rows, key=lambda r: r["fqn"]) for g, rows in table.items()}


def _quant_floor(quant: str, device: str, sm: str) -> None:
    """Refuse a key whose quant rule cannot run here: the rule's floor and the capability of THIS
    torch on this sm (the same pure function the plan used), then, on a GPU, the kernel itself."""
    import torch
    from cgbuild_rules import quant as quant_rules

    from cgbuild.identity import quantrule

    rule = quantrule.QUANT_RULES.get(quant)
    if rule is None:
        raise MintFailure(Code.LAYOUT_DRIFT, f"this worker has no quant rule {quant!r}")
    floor = quantrule.floor_refusal(rule, sm, torch.__version__)
    if floor is not None:
        raise MintFailure(floor[0], floor[1])
    if device == "cuda":
        ok, why = quant_rules.probe(quant, torch.device("cuda"))
        if not ok:
            raise MintFailure(Code.LAYOUT_TOOLCHAIN_UNSUPPORTED, why)


def _layout(req: MintRequest, traced: list[list[Any]]) -> dict[str, Any] | None:
    """Re-derive the layout axis here and return the sealed `layout` block (its tensor table is
    what adopt checks a live module against); refuse `layout-drift` when it differs from the key.

    The topology is derived from the state this worker traced: a plan only keys a reference
    whose headers equal the traced tensors (else `layout-topology-mismatch`), so both give one
    digest and a mint needs no access to the reference. When they differ here and the reference
    is readable, the refusal names the first tensor. Requests without a `layout` block
    (hand-made ones) seal none; adopt then checks weights only.
    """
    want = req.layout
    if not want:
        return None
    from cgbuild.core.errors import UserError
    from cgbuild.identity import layout, quantrule, topology

    rule = quantrule.QUANT_RULES.get(want["quant"])
    if rule is None:
        raise MintFailure(Code.LAYOUT_DRIFT, f"this worker has no quant rule {want['quant']!r}")
    rows = topology.from_trace(traced)
    here = layout.layout_identity(topology.topology_digest(rows), rule)
    asked = {"topology": want.get("topology"), "quant": want.get("quant_digest")}
    if here != asked:
        if want.get("reference") and here["topology"] != asked["topology"]:
            try:
                reading = topology.Reading.from_json(want.get("reading"))
                reference = Path(want["reference"])
                ref_rows = topology.topology_from_reference(reference, want["component"], reading)
                mismatch = topology.topology_mismatch(ref_rows, rows)
            except UserError:
                mismatch = None
            if mismatch:
                raise MintFailure(Code.LAYOUT_TOPOLOGY_MISMATCH, mismatch)
        moved = [k for k in ("topology", "quant") if here[k] != asked[k]]
        raise MintFailure(
            Code.LAYOUT_DRIFT,
            f"layout {', '.join(moved)} moved: {str(asked[moved[0]])[:12]} → {here[moved[0]][:12]}",
            old=asked,
            new=here,
        )
    return {
        **here,
        "stamp": req.stamp,
        "rule": {"name": rule.name, "version": rule.version, "facts": rule.facts},
        "dtype": want.get("dtype"),
        "tensors": sorted(rows),
    }


def stage_compile(talk: Conversation) -> Compiled:
    """Trace (answered as `Traced`: the graph facts and this machine's sm), then, on the worker's
    go, refuse drift and compile. A held stage (started by a `MintHold`) traces before any key
    exists, on the device when this machine has it (else fake, for the plan alone), and reads
    the key's request at the go; an ordinary one refuses a wrong device before tracing."""
    import importlib.metadata as md

    import torch
    from cgbuild_rules import trace

    start = talk.start
    job = trace.parse_job(start.job.to_json())
    here = _sm_here(job.device)
    if start.request is not None:
        _device_refusal(job.device, start.request.sm, here)
        _quant_floor(job.quant, job.device, start.request.sm)
    fault("trace")
    t = time.perf_counter()
    ep, facts = trace.export_job(job, "fake" if here is None else "empty")
    export_s = time.perf_counter() - t
    contract = CallContract.from_json(facts["contract"], "graph.contract")
    talk.answer(Traced(**{k: facts[k] for k in FACT_KEYS if k != "contract"}, contract=contract, sm=here))
    req = talk.go("compile").request  # a hold's key request is known only now
    assert req is not None
    if start.held:
        _device_refusal(job.device, req.sm, here)
        _quant_floor(job.quant, job.device, req.sm)
    tc = _toolchain(req)
    if facts["graph_digest"] != req.graph_digest:
        raise MintFailure(
            Code.GRAPH_DRIFT,
            f"graph digest {req.graph_digest[:12]} → {facts['graph_digest'][:12]}: "
            "this machine traces a different program than the key was built for",
            old=req.graph_digest,
            new=facts["graph_digest"],
        )
    layout_block = _layout(req, facts["topology"])
    t = time.perf_counter()
    applied, aoti = _compile(ep, start.env, tc, talk.work)
    compile_s = time.perf_counter() - t
    return Compiled(
        graph_digest=facts["graph_digest"],
        contract=contract,
        nodes=facts["nodes"],
        module=facts["module"],
        toolchain=tc,
        policy=applied,
        constants=_sealed_constants(ep, talk.work),
        layout=layout_block,
        aoti=AotiFacts(str(aoti.get("AOTI_CPU_ISA", "")), aoti["runtime"]),
        torch=torch.__version__,
        forensics=_forensics(md),
        seconds={"export": round(export_s, 3), "compile": round(compile_s, 3)},
    )


def _sealed_constants(ep: Any, work: Path) -> dict[str, list[dict[str, Any]]]:
    """The package's constant table; its literals written beside it for the seal."""
    from cgbuild_rules.loader import Package

    # Loading never calls the package (calling it unbound would segfault); it names what it binds.
    table = _constants_table(ep, Package(work / PACKAGE).constant_fqns)
    if table["literal"]:
        from safetensors.torch import save_file

        values = {r["fqn"]: ep.constants[r["fqn"]].detach().contiguous().cpu() for r in table["literal"]}
        save_file(values, str(work / LITERALS))
    return table


def _forensics(md: Any) -> dict[str, str]:
    """Python's and the trace-only distributions' versions (sealed for forensics, never keyed)."""
    forensics: dict[str, str] = {"python": ".".join(platform.python_version_tuple()[:2])}
    for dist in TRACE_ONLY:
        with contextlib.suppress(md.PackageNotFoundError):
            forensics[dist] = md.version(dist)
    return forensics


def _compile(
    ep: Any, env: StageEnv, tc: Mapping[str, Any], work: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """AOTI-compile `ep` weightless under the one compile policy and normalize the package into
    `work`: (the policy's inductor configs as applied, the package's AOTI facts)."""
    import torch
    from cgbuild_rules import trace

    arch = normalize_arch(platform.machine())
    # A torch without `cpp.march` builds -march=native; the toolchain then keys this host's level.
    clamps = tc["components"]["isa"].get("keyed") != "host"
    configs: dict[str, Any] = policy.inductor_configs(arch, clamps=clamps)
    applied = dict(configs)
    configs["cpp.cxx"] = (None, env.cxx)
    raw = work / "raw" / PACKAGE
    raw.parent.mkdir(exist_ok=True)
    try:
        torch._inductor.aoti_compile_and_package(ep, package_path=str(raw), inductor_configs=configs)
    except MemoryError as e:
        raise MintFailure(Code.OOM, f"compile ran out of memory: {e}") from None
    except Exception as e:
        raise MintFailure(Code.COMPILE_FAILED, f"{type(e).__name__}: {trace._one_line(str(e))}") from None
    clamp = policy.isa_clamp(arch)
    march = str(clamp["march"]) if clamp and clamps else None
    assert env.sandbox is not None
    return applied, normalize_package(raw, work / PACKAGE, env.sandbox, march)
