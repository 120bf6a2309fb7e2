"""The check stage (verify, measure, serve in one process started beside the compile) and the
lane verdict the worker fits from its measurements.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cgbuild_rules.mint.compare import compare_outputs, tolerance_of
from cgbuild_rules.mint.failure import MintFailure
from cgbuild_rules.mint.stages import Conversation, Stage, fault

from cgbuild.core.codes import Code
from cgbuild.lanes import LaneAxis, Switches
from cgbuild.protocol.mint import MintRequest
from cgbuild.protocol.stage import Compiled, Go, Measured, Served, Verified, VerifiedLanes
from cgbuild.store.seal import LITERALS, PACKAGE, read_metadata
from cgbuild.store.sealed import parse


@dataclass
class _Checked:
    """What the `check` stage keeps between its parts: the entry's module (built once, seed-0
    weights), its literals, and the package bound for verification."""

    job: Any
    built: Any
    base_bytes: int
    literals: dict[str, Any] = field(default_factory=dict)
    own: dict[str, Any] = field(default_factory=dict)
    """The module's own values of those literals (what it was built with), put back before the
    serve part: a serving process's module holds its own, not the compile's."""
    package: Any = None
    table: Switches = field(default_factory=lambda: Switches(()))
    """The switch table as verify found it on the module, with its selector (what is sealed)."""


def _verify(req: MintRequest, work: Path, c: _Checked) -> Verified:
    """The compiled package through the real loader against the module's eager output (with the
    literals the compile wrote), and every lane of it when the request has lanes."""
    import torch
    from cgbuild_rules import lanes as lane_rt
    from cgbuild_rules import trace
    from cgbuild_rules.adopt.bind import attribute
    from cgbuild_rules.loader import Package, state_tensors

    job, built = c.job, c.built
    if (work / LITERALS).exists():
        from safetensors.torch import load_file

        c.literals = {k: v.to(job.device) for k, v in load_file(str(work / LITERALS)).items()}
        for fqn, value in c.literals.items():
            c.own[fqn] = attribute(built.module, fqn)
            trace._set_attribute(built.module, fqn, value)
    with torch.no_grad():
        want = built.module(*built.args, **built.kwargs)
    c.package = Package(work / PACKAGE)
    live = {**state_tensors(built.module), **c.literals}
    missing = sorted(set(c.package.constant_fqns) - set(live))
    if missing:
        raise MintFailure(
            Code.CONSTANT_TABLE_MISMATCH, f"the package needs constants the module lacks: {missing[:5]}"
        )
    c.package.bind({fqn: live[fqn] for fqn in c.package.constant_fqns})
    sel = lane_rt.selector_of(built.module, job.device)  # the lanes eager `want` ran
    lane_inputs = {} if sel is None else {lane_rt.SELECTOR: sel}
    with torch.no_grad():
        got = c.package(*built.args, **built.kwargs, **lane_inputs)
    errors = compare_outputs(got, want, tolerance_of(job.quant))
    if not req.lanes:
        return Verified(errors, _verified_on(job.device))
    c.table = lane_rt.switch_table(_lane_rows(req, job, built.module))
    checks = _verify_lanes(job, built, c.package, c.table)
    return Verified(
        errors, _verified_on(job.device), VerifiedLanes(c.table, checks["checked"], checks["numerics"])
    )


def _verified_on(device: str) -> dict[str, Any]:
    """The device this stage verifies on, as the mint's record names it (never sealed): its
    type, the `CUDA_VISIBLE_DEVICES` the mint was started under (a fleet node pins it to the GPU
    Ray assigned the key) and, on a GPU, torch's index of it, its name and its UUID."""
    import torch

    seen: dict[str, Any] = {"type": device, "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}
    if device == "cuda":
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        uuid = getattr(props, "uuid", None)
        seen.update(index=index, name=props.name, uuid=f"GPU-{uuid}" if uuid is not None else None)
    return seen


def stage_check(talk: Conversation) -> None:
    """verify, measure and serve in ONE process, started beside the compile.

    Importing torch and the entry and building the module with its seed-0 weights (about 20 s
    for klein-4B) happen while the compile runs; each part then waits for its go from the
    worker (`verify` with the key's request, `measure` with the candidates, `serve` with the
    sealed artifact) and answers it. A part that fails ends the stage with its failure.
    """
    import torch
    from cgbuild_rules import lanes as lane_rt
    from cgbuild_rules import trace

    fault("check")
    job = trace.parse_job(talk.start.job.to_json())
    base = lane_rt.process_bytes()  # the bare process, before the module or package exist
    c = _Checked(job, trace.build(job, "real"), base)
    req = talk.go("verify").request  # a hold's key request is known only now
    assert req is not None
    talk.answer(_verify(req, talk.work, c))
    candidates = talk.go("measure").candidates or ()
    if candidates:
        threads = torch.get_num_threads()
        try:
            talk.answer(_measure(c, candidates))
        finally:
            torch.set_num_threads(threads)
    else:
        talk.answer(Measured())
    artifact = talk.go("serve").artifact
    assert artifact is not None
    for fqn, value in c.own.items():
        if value is not None:
            trace._set_attribute(c.built.module, fqn, value)
    talk.answer(_serve(c.job, c.built, artifact))


def stage_serve(talk: Conversation) -> None:
    """The sealed artifact as a serving process meets it (`cgbuild verify --run`'s own process;
    a mint's check stage runs the same `_serve` on the module it built): the live module
    from the entry (seed-0 weights, its own literals), `adopt` (strict: a refusal fails the mint
    with adopt's own code), the entry's call served through it, which must run compiled (no
    eager fallback, by the router's counters), compared against eager; so is the call at each
    end of every declared range and one size inside (`cgbuild_rules.trace.range_calls`), which
    proves the one program right over the range its label names. An artifact with lanes is
    adopted once per lane it can serve, each pinned, against eager with the same lane.
    """
    from cgbuild_rules import trace

    job = trace.parse_job(talk.start.job.to_json())
    built = trace.build(job, "real")
    artifact = talk.go("serve").artifact
    assert artifact is not None
    talk.answer(_serve(job, built, artifact))


def _serve(job: Any, built: Any, artifact: str) -> Served:
    import torch
    from cgbuild_rules import lanes as lane_rt
    from cgbuild_rules import trace
    from cgbuild_rules.adopt import AdoptRefused, adopt

    from cgbuild import lanes

    block = parse(read_metadata(artifact)).lanes
    axes = block.switches.names if block else []
    excluded = set(block.excluded) if block else set()
    choices: list[str | None] = [
        lane
        for lane in (block.switches.carried() if block else [])
        if not {f"{a}.{v}" for a, v in lanes.split(lane, axes).items()} & excluded
    ] or [None]
    errors: list[dict[str, Any]] = []
    served: list[dict[str, Any]] = []
    traced = {name: job.spec[name] for name in job.spec["ranges"]}  # the entry's own call's sizes
    calls = [(traced, built.args, built.kwargs), *trace.range_calls(job)]
    for lane in choices:
        if lane is not None:
            lane_rt.set_lanes(built.module, lanes.split(lane, axes))
        with torch.no_grad():
            wants = [built.module(*args, **kwargs) for _, args, kwargs in calls]
        try:
            adopted = adopt(artifact, built.module, strict=True, lane=lane)
        except AdoptRefused as e:
            detail = f"adopt refuses the sealed artifact: {e.refusal.detail}"
            raise MintFailure(e.refusal.code, detail) from None
        tag = {} if lane is None else {"lane": lane}
        for (at, args, kwargs), want in zip(calls, wants, strict=True):
            errors += [{**e, **tag, **at} for e in _served_at(adopted, at, args, kwargs, want, job.quant)]
        counters = dict(adopted.counters)
        served.append({**tag, "counters": counters, "seconds": round(adopted.armed[0].seconds, 3)})
    return Served(errors, served)


def _served_at(
    adopted: Any, at: Mapping[str, int], args: Any, kwargs: Any, want: Any, quant: str
) -> list[dict[str, Any]]:
    """One call through the adopted artifact, which must serve it compiled and within tolerance
    of eager; `at` names the declared ranges' sizes it is made at ({}: a module without one)."""
    import torch
    from cgbuild_rules.adopt import AdoptRefused

    what = "the entry's own call" if not at else "the call at " + ", ".join(f"{k}={v}" for k, v in at.items())
    expected = {"compiled": adopted.counters["compiled"] + 1}
    try:
        with torch.no_grad():
            got = adopted(*args, **kwargs)
    except AdoptRefused as e:
        raise MintFailure(e.refusal.code, f"adopted, but {what} was refused: {e.refusal.detail}") from None
    if (counters := dict(adopted.counters)) != expected:
        why = adopted.last_reason
        code, detail = (why.code, why.detail) if why else (Code.VERIFY_FAILED, f"counters {counters}")
        raise MintFailure(code, f"adopted, but {what} was served eager: {detail}")
    try:
        return compare_outputs(got, want, tolerance_of(quant))
    except MintFailure as e:
        if not at:
            raise
        raise MintFailure(e.code, f"{what}: {e.detail}") from None


def _lane_rows(req: MintRequest, job: Any, module: Any) -> list[LaneAxis]:
    from cgbuild_rules import lanes as lane_rt

    assert req.lanes is not None
    declared = [axis for axis, _ in req.lanes["axes"]]
    try:
        return lane_rt.lane_rows(module, declared, job.spec.get("lanes") or {})
    except ValueError as e:
        raise MintFailure(Code.ENTRY_ERROR, str(e)) from None


def _verify_lanes(job: Any, built: Any, package: Any, table: Switches) -> dict[str, Any]:
    """Every lane of the ONE compiled artifact against eager with the same lane, and each value
    against its axis's reference (the numerics self-check that makes it a candidate)."""
    import torch
    from cgbuild_rules import lanes as lane_rt

    def eager(choice: Mapping[str, str]) -> Any:
        lane_rt.set_lanes(built.module, choice)
        with torch.no_grad():
            return built.module(*built.args, **built.kwargs)

    def compiled(choice: Mapping[str, str]) -> Any:
        _, inputs = lane_rt.switch_inputs(table, choice, job.device)
        with torch.no_grad():
            return package(*built.args, **built.kwargs, **inputs)

    compare = functools.partial(compare_outputs, tolerance=tolerance_of(job.quant))
    return lane_rt.verify_lanes(table.axes, eager, compiled, compare)


def _measure(c: _Checked, candidates: Sequence[str]) -> Measured:
    """Every candidate lane's benchmark, in turn, on the module and package this stage already
    holds (cgbuild_rules.lanes.measure): each lane's selector is passed to its own warm-ups, peak
    reset and timed calls. A lane measured later does not inherit an earlier one's peak: the
    GPU's counter and the CPU's resident high-water mark are reset per lane, after freed memory
    was returned."""
    import gc

    import torch
    from cgbuild_rules import lanes as lane_rt

    from cgbuild import lanes

    job, built = c.job, c.built
    if job.device == "cpu":
        # One intra-op thread: on a shared host a parallel region waits for every thread it
        # started, and another process on a core stalls each call by a scheduler slice (24 ms
        # per call measured here at 2 threads, against 0.1 ms alone), which would rank lanes by
        # the neighbours' load. The thread count is in the evidence.
        torch.set_num_threads(1)
    axes = c.table.names
    device = torch.device(job.device)
    runs: dict[str, Any] = {}
    for lane in candidates:
        print(f"lanes: measuring {lane}", file=sys.stderr, flush=True)
        _, inputs = lane_rt.switch_inputs(c.table, lanes.split(lane, axes), job.device)
        call = functools.partial(c.package, *built.args, **built.kwargs, **inputs)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        runs[lane] = lane_rt.measure(call, device, c.base_bytes if device.type == "cpu" else 0)
    return Measured(runs, lane_rt.device_facts(device))


def lane_verdict(
    req: MintRequest,
    built: Compiled,
    checked: Verified,
    check: Stage,
    progress: Callable[[str], None] | None,
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """Candidates from capability, measured in the check stage, the rule's verdict.

    Returns (the sealed `lanes` block: discrete facts only; the evidence: raw timings, samples,
    the device, never sealed), or (None, None) when the request declares no lanes.
    """
    from cgbuild import lanes

    want = req.lanes
    if not want:
        check.part(Measured, Go("measure", candidates=()))
        return None, None
    assert checked.lanes is not None  # verify found the rows of a request with lanes
    table = checked.lanes.table
    rows = table.axes
    used = set(table.names)
    declared = [(axis, values) for axis, values in want["axes"] if axis in used]
    needs = {a: {v: lanes.Needs.from_json(n) for v, n in want["needs"][a].items()} for a, _ in want["axes"]}
    triton = lanes.has_triton(built.toolchain["components"])
    numerics = checked.lanes.passed()
    excluded = lanes.exclusions(want["axes"], needs, req.sm, triton)
    excluded.update(
        {f"{a}.{v}": "numerics" for a, vals in numerics.items() for v, ok in vals.items() if not ok}
    )
    candidates = lanes.candidates(declared, needs, req.sm, triton, numerics)
    runs: dict[str, Any] = {}
    if candidates and progress:
        progress(f"lanes: measuring {', '.join(candidates)}")
    stage = check.part(Measured, Go("measure", candidates=tuple(candidates)))
    if candidates:
        runs = {lane: {"lane": lane, **stage.runs[lane], "device": stage.device} for lane in candidates}
        sku = want["sku"]
        measured = [
            lanes.Measured(lane, runs[lane]["median_ns"], runs[lane]["peak_bytes"]) for lane in candidates
        ]
        verdict = lanes.decide(measured, sku["name"], sku["memory_bytes"])
    elif rows:  # one combination survives capability: nothing to choose, nothing measured
        surviving = [(r.axis, [v for v in r.values if numerics[r.axis][v]]) for r in rows]
        verdict = lanes.unmeasured(lanes.combinations(surviving)[0], Code.ONE_CANDIDATE)
    else:  # this module uses none of the declared axes
        verdict = None
    block = {
        "schema": lanes.LANES_SCHEMA,
        **table.to_json(),
        "excluded": excluded,
        "verdict": verdict,
    }
    evidence = {
        "schema": "cgbuild.lane-evidence-run/1",
        "sm": req.sm,
        "sku": want["sku"],
        "candidates": candidates,
        "measured": runs,
        "numerics": checked.lanes.numerics,
        "excluded": excluded,
        "verdict": verdict,
    }
    return block, evidence
