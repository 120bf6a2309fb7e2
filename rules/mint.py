"""The mint rule: compile ONE key's AOTInductor package, prove it, and seal it.

`python -m cgbuild_rules.mint` reads one JSON request on stdin and writes one JSON result line
on stdout (torch's own prints go to stderr). The worker itself never imports torch: it runs two
stage children and seals what they produced, so a segfault, an OOM kill or a hang in torch is a
typed failure of a stage, never a lost result.

1. `compile` stage, in a scrubbed, declared environment (`cgbuild.identity.policy`) with the chosen host
   compiler as `CXX` and the temp and Inductor cache folders inside a sandbox at a FIXED path:
   (a) refuses a key whose device this machine does not have (`wrong-device`, naming the sm);
   (b) traces the job (trace rule, mode `empty`) and reports its graph facts (`trace.json`);
   (c) on the worker's go, re-derives the toolchain (`cgbuild.identity.toolchain.probe`) and
   refuses `toolchain-drift` / `graph-drift` (old → new) when it or the traced digest differs
   from the key it was asked to build, so a drifted worker image never seals under a wrong key;
   (d) compiles weightless under the one compile policy; (e) normalizes the package (below).
   A HOLD (`cgbuild.protocol.mint.MintHold`: the plan's trace of a unit `cgbuild mint` will
   mint, docs/architecture.md) starts the worker before any key exists: (b) runs first (fake
   when this machine lacks the device), the worker hands the facts to the engine (`{"traced":
   ...}` on its protocol stream) and reads the key's request as its next stdin line (`bad-request`
   unless it names the job traced and the folders the worker was started with, or is no JSON
   object); (a) and (c) follow, and the check stage starts only then. An empty line or the end
   of its input ends a hold without a result. Each stage gets the key's request with its go.
2-5 run in ONE `check` stage child, started beside the compile: it imports torch and the entry
and builds the module with its seed-0 random weights while the compile runs (about 20 s of a
klein-4B mint that no longer waits on it), then runs each part when the worker hands it its input:
2. `verify`: loads the normalized package through the real loader, binds the module's weights by
   FQN (user-managed, never calling before binding: that segfaults), runs the entry's inputs and
   compares with eager (with the compile's literals) under a per-dtype tolerance, or the quant
   rule's own. With lanes (docs/lanes.md) it runs EVERY lane combination of the one package
   against eager with the same lane (`verify-mismatch` names the lane) and checks each value
   against its axis's reference (the numerics self-check).
3. `measure`: every candidate lane in turn (`cgbuild.lanes.candidates`: buildable and numerically
   sound; none when fewer than two): per lane 3 warm-ups, reset peak, 9 timed calls, median and
   peak (`cgbuild_rules.lanes.measure`); the worker applies the fit rule (`cgbuild.lanes.decide`)
   for the request's SKU.
4. Then the worker writes the metadata (with the discrete lane verdict) and seals
   (`cgbuild.store.seal`) into its work folder.
5. `serve`: the sealed artifact is adopted as a serving process adopts it
   (`cgbuild_rules.adopt.adopt`, strict: unsealed and loaded anew) into the entry's live module,
   the entry's call must be served compiled, and it is compared with eager; a refusal fails the
   mint with adopt's own code (docs/adopt.md). Only then does the artifact move to
   `<out>/<key>.tar.gz`. The child's death in a part is that phase's typed failure.

The sealed constant table is the package loader's own constant list (docs/adopt.md: unused
tensors and BatchNorm counters are not in it; tied tensors are one row with their `aliases`).

Normalization, measured on torch 2.13 CPU with two compiles of one graph: the package's
top-level folder is its file's basename (fixed: `model`); each generated `.cpp` gets `// Compile
cmd` / `// Link cmd` comment blocks with absolute cache, temp and include paths appended, one more
block per warm-cache compile (stripped); the `// Triton kernels are embedded as comments in
<path>` line names the sandbox (replaced by `<sandbox>`); `.data/serialization_id` is derived from
the records' contents (recomputed by rewriting with torch's own archive writer, records sorted).
The `.so` and the generated file names depend on the cache path, which is why the sandbox path
is fixed. They depend on where torch is installed too (its include folder is in the compile
flags Inductor hashes, and in the `.so` line tables): the same venv reached through a symlinked
path renamed every kernel and wrapper file. Byte-identical packages across machines therefore
need torch at the same path; `mint --check` names the members that differ.

Failures are typed: `retryable` ones (`oom`, `worker-killed`, `worker-signal`, `worker-crashed`,
`timeout`: how a stage child ended, named by `cgbuild.protocol.spawn`) may succeed on another
attempt; the others (refusals, compile errors, verification mismatch) will not. Phase timings
go in the result line, never in the sealed bytes (a hold's `total` counts from its key's
request: its `export`, the trace, ran during the plan).

Request (`schema: "cgbuild.mint-request/1"`): `id`, `key`, `job` (a trace job), `sm`,
`graph_digest`, `toolchain` {`platform`, `fold`, `components`}; optional `axes` (readable blocks),
`facets`, `stamp`, `layout` {`quant`, `dtype`, `component`, `reference`, `topology`,
`quant_digest`} (re-derived here: `layout-drift` when it moved; sealed as the tensor table adopt
checks), `lanes` {`axes`: [[axis, declared values]] in declaration order, `needs`: {axis: {value:
needs}}, `sku`: {`name`, `memory_bytes`} the verdict is fitted to}, `labels`, `cxx` (compiler
override), `out` (folder for `<key>.tar.gz`),
`sandbox` (default `DEFAULT_SANDBOX`), `fresh` (empty the sandbox first, under an exclusive lock),
`compare_with` (an earlier artifact of the key: the result adds `seal.compare_artifacts`'s
`reproducible`, `differing` members, metadata `fields` and `verdict_moved`),
`timeout_s` (per stage part: the trace, the compile, each check).
Result: `{"id", "ok": true, "key", "artifact", "sha256", "size", "members": {name: sha256},
"verify": [{"output", "dtype", "rel_rms", "tolerance", "max_abs", "lane"?}] (from the serve stage),
"served": [{"lane"?, "counters", "seconds"}], "phases": {"wait"? (for the compile sandbox),
"export", "compile", "verify", "lanes"?, "seal", "serve", "total"}, "lane_evidence"?: {raw
timings, samples, peaks, device, numerics, verdict}}` (the
engine files the evidence beside the artifact, never in it) or `{"id", "ok": false, "code",
"retryable", "phase", "detail", ...}` with `old`/`new`
(drift), `changes` (toolchain components), `needed`/`found` (device) or `signal`. Codes:
`bad-request`, `wrong-device`, `wrong-host`, `toolchain-drift`, `graph-drift`, `layout-drift`,
`layout-topology-mismatch`, `layout-below-sm-floor`, `layout-toolchain-unsupported` (the rule's
floor, this torch on this sm, or the kernel's probe on the device), `entry-error`,
`trace-failed`, `literal-hidden`, `compile-failed`, `clamp-not-applied`,
`constant-table-mismatch`, `verify-mismatch`, `verify-failed`, `seal-failed`, adopt's refusal
codes from the serve stage (e.g. `weights-untied`, `literal-mismatch`), `mint-error`; retryable:
`oom`, `worker-killed`, `worker-signal`, `worker-crashed`, `timeout`. A failed mint leaves
its stage logs in `<out>/.mint-<key16>-<pid>/`.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cgbuild
from cgbuild.core import fs
from cgbuild.core.codes import Code
from cgbuild.core.platform import normalize_arch
from cgbuild.identity import compiler, policy
from cgbuild.identity.layout import QUANT_RULES
from cgbuild.identity.toolchain import TRACE_ONLY
from cgbuild.protocol import spawn
from cgbuild.protocol.mint import (
    HOLD_SCHEMA,
    BadRequest,
    Minted,
    MintFailed,
    MintHold,
    MintOutcome,
    MintRequest,
    Phase,
)
from cgbuild.protocol.trace import FACT_KEYS
from cgbuild.store.seal import LITERALS, PACKAGE, compare_artifacts, member_digests, read_metadata, seal

ARTIFACT_SCHEMA = "cgbuild.artifact/1"
ARTIFACT_KIND = "aot-inductor"
DEFAULT_SANDBOX = "/tmp/cgbuild-sandbox"
# test hook: "<stage>:<SIGNAL>" makes that stage kill itself; "<stage>:hang" makes it wait on a
# child that never ends (a compiler that hangs)
FAULT_ENV = "CGBUILD_MINT_FAULT"
POLL_S = 0.05
"""How often the check stage and the worker look for each other's files."""
# Relative RMS error allowed against eager, by output dtype (as text: identity blocks hold no
# floats). fp32 compiles measured ~1e-7; klein-4B bf16 measured 2.3% from rounding alone.
TOLERANCE = {"float32": "1e-4", "float64": "1e-9", "float16": "1e-2", "bfloat16": "5e-2"}


class MintFailure(Exception):
    """A typed mint failure raised where it is found; `extra` carries the facts its code names
    (`old`/`new` of a drift, a `signal`)."""

    def __init__(self, code: Code, detail: str, **extra: Any) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = Code(code)  # a stage's code read back: an unregistered one is `mint-error`
        self.detail = detail
        self.extra = extra

    def result(self, job_id: str | None, phase: Phase) -> MintFailed:
        return MintFailed(self.code, phase, self.detail, self.extra, job_id)


# ---- the worker (no torch) ---------------------------------------------------------------------
def _check_request(req: Any) -> MintRequest | MintHold:
    """The request validated: a key's, or a hold's (the worker then waits for its key's request)."""
    try:
        if isinstance(req, dict) and req.get("schema") == HOLD_SCHEMA:
            return MintHold.from_json(req)
        return MintRequest.from_json(req)
    except BadRequest as e:
        raise MintFailure(Code.BAD_REQUEST, str(e)) from None


def _admitted(hold: MintHold, raw: Any) -> MintRequest:
    """The key's request a held worker was handed, if it may mint it (else `bad-request`)."""
    try:
        request = MintRequest.from_json(raw)
    except BadRequest as e:
        raise MintFailure(Code.BAD_REQUEST, str(e)) from None
    if (why := hold.admits(request)) is not None:
        raise MintFailure(Code.BAD_REQUEST, why)
    return request


class _NotNeeded(Exception):
    """The plan needs no mint from this held worker (its key is fresh, or another's)."""


@contextlib.contextmanager
def _sandbox(
    path: Path, fresh: bool, progress: Callable[[str], None] | None = None
) -> Iterator[Callable[[], float]]:
    """Hold the sandbox: shared by warm mints; exclusive (and emptied) for a fresh one. The
    sandbox is shared by every workspace of this machine, so a wait is announced, never silent,
    and timed: the context gives the seconds it waited (the mint's `wait` phase)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    mode = fcntl.LOCK_EX if fresh else fcntl.LOCK_SH
    waited = 0.0
    try:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                holder = "mints using it" if fresh else "a `mint --check` emptying it"
                progress(f"waiting for the compile sandbox {path} ({holder})")
            t = time.perf_counter()
            fcntl.flock(fd, mode)
            waited = time.perf_counter() - t
        if fresh:
            shutil.rmtree(path, ignore_errors=True)
        for sub in ("tmp", "inductor", "triton"):
            (path / sub).mkdir(parents=True, exist_ok=True)
        yield lambda: waited
    finally:
        os.close(fd)


def _echo(log: Path, stage: str) -> None:
    """Copy a stage's output to this worker's stderr, which the engine keeps as the key's log:
    the work folder holding the stage logs is removed when the mint succeeds."""
    text = log.read_text(errors="replace") if log.exists() else ""
    sys.stderr.write(f"== {stage} stage ({len(text.splitlines())} lines) ==\n{text}")
    sys.stderr.flush()


def _stage_result(path: Path) -> dict[str, Any]:
    """A stage's result file: the result, or the failure it reports raised as a MintFailure."""
    result = json.loads(path.read_text())
    if not result.get("ok"):
        extra = {k: v for k, v in result.items() if k not in ("ok", "code", "detail")}
        raise MintFailure(result["code"], result["detail"], **extra)
    return dict(result)


def _ended_failure(ended: spawn.Ended, what: str, timeout_s: float) -> MintFailure:
    """How a stage child that left no result ended, as the typed failure of `what`."""
    failure = ended.failure(what, timeout_s)
    extra = {"signal": failure["signal"]} if "signal" in failure else {}
    return MintFailure(failure["code"], failure["detail"], **extra)


class _Stage:
    """One stage child, started before its input exists so that its imports overlap what comes
    first (the compile stage's trace, the check stage's module build beside the compile). Each
    `part` hands the child its input (`go-<part>.json`) and waits for `<part>.json`; the child's
    death, a failure it reports (`<stage>.json`) or `timeout_s` without a result is the part's
    typed failure. A stage starts programs of its own (the compiler), so it dies by SIGTERM and
    passes it on to its group (`spawn.die_with_group`)."""

    def __init__(self, name: str, work: Path, env: Mapping[str, str], timeout_s: float) -> None:
        self.name, self.work, self.timeout_s = name, work, timeout_s
        (work / f"{name}.json").unlink(missing_ok=True)
        self.pid: int | None = None
        self.ended: spawn.Ended | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(dict(env),), daemon=True)
        self.thread.start()

    def _run(self, env: dict[str, str]) -> None:
        try:
            self.ended = spawn.spawn(
                "cgbuild_rules.mint",
                ["--stage", self.name, str(self.work)],
                log=self.work / f"{self.name}.log",
                env=env,
                death_signal=signal.SIGTERM,
                started=self._started,
            )
        except BaseException as e:  # spawn refused to start (cgbuild is stopping): the part says so
            self.error = e

    def _started(self, pid: int) -> None:
        self.pid = pid

    def part(self, name: str, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
        fs.write_atomic(self.work / f"go-{name}.json", json.dumps(dict(given or {})))
        result_path = self.work / f"{name}.json"
        deadline = time.monotonic() + self.timeout_s
        while not result_path.exists():
            if not self.thread.is_alive() and not result_path.exists():
                self._died(name)
            if time.monotonic() > deadline:
                self.stop()
                raise MintFailure(Code.TIMEOUT, f"{name} stage: no result within {self.timeout_s:.0f} s")
            time.sleep(POLL_S)
        return _stage_result(result_path)

    def _died(self, name: str) -> None:
        self.thread.join()
        _echo(self.work / f"{self.name}.log", self.name)
        if self.error is not None:
            raise MintFailure(Code.WORKER_KILLED, f"{name} stage did not start: {self.error}")
        if (self.work / f"{self.name}.json").exists():
            _stage_result(self.work / f"{self.name}.json")  # raises the failure the stage reported
        assert self.ended is not None
        raise _ended_failure(self.ended, f"{name} stage", self.timeout_s)

    def finish(self) -> None:
        self.thread.join(self.timeout_s)
        if self.thread.is_alive():
            self.stop()
        _echo(self.work / f"{self.name}.log", self.name)

    def stop(self) -> None:
        """End the child and its group now (the mint failed, or a part outlived its time); one
        still starting is waited for, so the kill cannot miss it."""
        deadline = time.monotonic() + 30
        while self.pid is None and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        if self.pid is not None and self.thread.is_alive():
            spawn.kill_group(self.pid)
        self.thread.join(30)


def _metadata(
    req: MintRequest, built: Mapping[str, Any], lanes_block: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The sealed metadata: discrete facts only (no clocks, no paths, no measured errors)."""
    components = built["toolchain"]["components"]
    extra = {} if lanes_block is None else {"lanes": lanes_block}
    return {
        **extra,
        "schema": ARTIFACT_SCHEMA,
        "kind": ARTIFACT_KIND,
        "key": req.key,
        "axes": req.axes or {},
        "graph": {"digest": built["graph_digest"], "contract": built["contract"], "nodes": built["nodes"]},
        "facets": req.facets or [],
        "stamp": req.stamp,
        "sm": req.sm,
        "device": req.job.spec["device"],
        "toolchain": built["toolchain"],
        "policy": built["policy"],
        "host": {
            "isa": components["isa"],
            "aoti_cpu_isa": built["aoti"].get("AOTI_CPU_ISA", ""),
            "runtime": built["aoti"]["runtime"],
            "cxx": {k: components["cxx"][k] for k in ("family", "version", "banner")},
        },
        "torch": built["torch"],
        "cgbuild": cgbuild.__version__,
        "constants": built["constants"],
        "layout": built.get("layout"),
        "module": built.get("module"),
        "verify": {"metric": "rel-rms", "tolerance": TOLERANCE, **_rule_tolerance(req.job.quant)},
        "forensics": built["forensics"],
    }


def mint(
    raw: dict[str, Any],
    progress: Callable[[str], None] | None = None,
    next_request: Callable[[dict[str, Any]], Any] | None = None,
) -> MintOutcome | None:
    """Run one mint request to its outcome (never raises for the key's own failure).

    `progress` hears each phase as it starts, so the engine can show it. A hold (`MintHold`)
    hands `next_request` its trace (the facts, or the trace's failure) and mints the key's
    request it returns; None from it, or a failed trace, ends the hold without a result.
    """
    job_id = raw.get("id") if isinstance(raw, dict) else None
    clock = _Clock(Phase.REQUEST, progress)
    work: Path | None = None
    try:
        asked = _check_request(raw)
        out = Path(asked.out)
        out.mkdir(parents=True, exist_ok=True)
        work = out / f".mint-{(asked.key if isinstance(asked, MintRequest) else asked.id)[:16]}-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        minted = _minted(asked, work, clock, next_request)
        shutil.rmtree(work, ignore_errors=True)  # a failed mint keeps its stage logs there
        return minted
    except _NotNeeded:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
        return None
    except MintFailure as e:
        return e.result(job_id, clock.phase)
    except compiler.CompilerError as e:
        return MintFailure(Code.WRONG_HOST, str(e)).result(job_id, clock.phase)
    except Exception as e:  # the worker must answer, whatever broke
        return MintFailure(Code.MINT_ERROR, f"{type(e).__name__}: {e}").result(job_id, clock.phase)


class _Clock:
    """The worker's phase: announced as it starts, timed until the next (the result's `phases`;
    the compile stage times its own `export` and `compile`), and named in a failure."""

    TIMED = (Phase.VERIFY, Phase.LANES, Phase.SEAL, Phase.SERVE)

    def __init__(self, phase: Phase, progress: Callable[[str], None] | None) -> None:
        self.phase, self.progress = phase, progress
        self.seconds: dict[str, float] = {}
        self.start = self._since = time.perf_counter()

    def enter(self, phase: Phase, *, announce: bool = True) -> None:
        self._close()
        self.phase, self._since = phase, time.perf_counter()
        if announce and self.progress:
            self.progress(phase)

    def restart(self) -> None:
        """A hold's clock counts from its key's request: its trace was the plan's."""
        self.start = self._since = time.perf_counter()

    def _close(self) -> None:
        if self.phase in self.TIMED:
            self.seconds[self.phase] = round(time.perf_counter() - self._since, 3)

    def total(self) -> float:
        self._close()
        return round(time.perf_counter() - self.start, 3)


def _minted(
    asked: MintRequest | MintHold,
    work: Path,
    clock: _Clock,
    next_request: Callable[[dict[str, Any]], Any] | None,
) -> Minted:
    """The mint itself: trace and compile under the sandbox, then verify, lanes, seal, serve."""
    hold = asked if isinstance(asked, MintHold) else None
    sandbox = Path(asked.sandbox or DEFAULT_SANDBOX)
    cxx = compiler.choose_cxx(asked.cxx)
    env = policy.mint_environment(
        os.environ,
        {
            "TMPDIR": str(sandbox / "tmp"),
            "TORCHINDUCTOR_CACHE_DIR": str(sandbox / "inductor"),
            "TRITON_CACHE_DIR": str(sandbox / "triton"),
        },
    )
    env["CXX"] = cxx

    def staged(r: MintRequest | MintHold) -> dict[str, Any]:
        """The request as the stages read it (`request.json`, and the go of each part)."""
        return {**r.to_json(), "cxx_path": cxx, "sandbox": str(sandbox)}

    (work / "request.json").write_text(json.dumps(staged(asked)))
    timeout = float(asked.timeout_s or 3600)
    (work / "tmp").mkdir()
    check_env = {**env, "TMPDIR": str(work / "tmp")}
    # beside the compile; a hold's only once a key needs it (its module costs memory and time)
    check = None if hold else _Stage("check", work, check_env, timeout)
    try:
        fresh = isinstance(asked, MintRequest) and bool(asked.fresh)
        with _sandbox(sandbox, fresh, clock.progress) as waited:
            compiling = _Stage("compile", work, env, timeout)
            try:
                if hold:
                    clock.enter(Phase.TRACE, announce=False)
                    assert next_request is not None
                    req = _held_request(hold, compiling, next_request)
                    clock.restart()
                    check = _Stage("check", work, check_env, timeout)
                    clock.enter(Phase.COMPILE)
                else:
                    assert isinstance(asked, MintRequest)
                    req = asked
                    clock.enter(Phase.COMPILE)  # the sandbox is held: the compile stage starts now
                    compiling.part("trace")  # the stage checks the digest against the key's
                built = compiling.part("compile", {"request": staged(req)})
                compiling.finish()
            except BaseException:
                compiling.stop()
                raise
        assert check is not None  # a hold starts its check stage with its key
        clock.enter(Phase.VERIFY)  # from the package's end: load, eager, compare
        checked = check.part("verify", {"request": staged(req)})
        clock.enter(Phase.LANES, announce=False)
        lanes_block, evidence = _lane_verdict(req, built, checked, check, clock.progress)
        clock.enter(Phase.SEAL)
        members = {PACKAGE: work / PACKAGE}
        if (work / LITERALS).exists():
            members[LITERALS] = work / LITERALS
        packed = work / f"{req.key}.tar.gz"
        sha = seal(packed, _metadata(req, built, lanes_block), members)
        if read_metadata(packed)["key"] != req.key:
            raise MintFailure(Code.SEAL_FAILED, "sealed metadata does not read back with its key")
        clock.enter(Phase.SERVE)
        served = check.part("serve", {"artifact": str(packed)})
        total = clock.total()
        check.finish()
    except BaseException:
        if check is not None:
            check.stop()
        raise
    artifact = work.parent / f"{req.key}.tar.gz"
    os.replace(packed, artifact)  # only an artifact a serving process adopted leaves the mint
    seconds = {k: v for k, v in clock.seconds.items() if k != Phase.LANES or lanes_block}
    return Minted(
        id=req.id,
        key=req.key,
        artifact=str(artifact),
        sha256=sha,
        size=artifact.stat().st_size,
        members=member_digests(artifact),
        verify=served["errors"],
        served=served["served"],
        phases={
            **({"wait": round(waited(), 3)} if waited() else {}),
            **built["seconds"],
            **seconds,
            "total": total,
        },
        lane_evidence=evidence,
        compared=compare_artifacts(req.compare_with, artifact) if req.compare_with else None,
    )


def _held_request(
    hold: MintHold, compiling: _Stage, next_request: Callable[[dict[str, Any]], Any]
) -> MintRequest:
    """A hold's trace, handed to the engine; then the key's request it answers with (the
    stages get it with their go). A failed trace is the engine's to report, as the trace rule's."""
    try:
        traced = compiling.part("trace")
    except MintFailure as e:
        next_request(e.result(hold.id, Phase.TRACE).to_json())
        raise _NotNeeded() from None
    raw = next_request(traced)
    if raw is None:
        raise _NotNeeded()
    return _admitted(hold, raw)


# ---- stages (torch) ----------------------------------------------------------------------------
def _fault(stage: str) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if spec.partition(":")[0] == stage:
        if spec.partition(":")[2] == "hang":
            subprocess.run(["sleep", "3600"], check=False)
        os.kill(os.getpid(), getattr(signal, spec.partition(":")[2] or "SIGKILL"))


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
    """Refuse a key whose sm is not this machine's (`here`: `_sm_here(device)`)."""
    if device == "cpu":
        return
    if here is None:
        raise MintFailure(
            Code.WRONG_DEVICE,
            f"key needs {sm} (cuda); this machine has no CUDA device",
            needed=sm,
            found="cpu",
        )
    if here != sm:
        raise MintFailure(
            Code.WRONG_DEVICE, f"key needs {sm}; this machine's device is {here}", needed=sm, found=here
        )


def _toolchain(req: Mapping[str, Any]) -> dict[str, Any]:
    from cgbuild.identity import toolchain

    expected = req["toolchain"]
    plat = expected["platform"]
    block = toolchain.probe(req.get("cxx"))[plat]
    here = {"platform": plat, "fold": toolchain.fold(block["components"]), "components": block["components"]}
    if here["fold"] != expected["fold"]:
        changes = toolchain.component_changes(expected.get("components") or {}, here["components"])
        lines = [toolchain.format_change(c) for c in changes] or ["components unknown to the request"]
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


def _check_clamp(text: str, march: str | None) -> None:
    """Every compile command Inductor recorded must carry the policy's -march (never native)."""
    flags = {tok for tok in text.split() if tok.startswith("-march=")}
    if march is not None and flags and flags != {f"-march={march}"}:
        raise MintFailure(Code.CLAMP_NOT_APPLIED, f"compile used {sorted(flags)}, policy says -march={march}")


def _strip_cpp(text: str, sandbox: str) -> str:
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line == "// Compile cmd" and all(not rest.strip() or rest.startswith("//") for rest in lines[i:]):
            lines = lines[:i]
            break
    return ("\n".join(lines).rstrip("\n") + "\n").replace(sandbox, "<sandbox>")


def normalize_package(src: Path, dest: Path, sandbox: str, march: str | None) -> dict[str, Any]:
    """Rewrite an AOTI package so it reproduces byte for byte (see the module docstring).

    Returns the package's AOTI metadata (device key, CPU ISA) read from its records, and under
    `runtime` the highest GLIBC/GLIBCXX/CXXABI versions its `.so` files require.
    """
    import zipfile

    import torch
    from cgbuild_rules.loader import required_runtime

    writer_owned = {".data/version", ".data/serialization_id", "byteorder"}
    with zipfile.ZipFile(src) as z:
        records = {info.filename.split("/", 1)[1]: z.read(info) for info in z.infolist()}
    if dest.name != PACKAGE:
        raise ValueError(f"the package must be written as {PACKAGE} (its top-level folder is its name)")
    aoti: dict[str, Any] = {}
    for name, data in records.items():
        if name.endswith(".wrapper_metadata.json"):
            aoti.update(json.loads(data))
    aoti["runtime"] = required_runtime(b"".join(d for n, d in sorted(records.items()) if n.endswith(".so")))
    writer = torch._C.PyTorchFileWriter(str(dest))
    writer.set_min_version(6)
    for name in sorted(records):
        if name in writer_owned:
            continue
        data = records[name]
        if name.endswith(".cpp"):
            text = data.decode()
            _check_clamp(text, march)
            data = _strip_cpp(text, sandbox).encode()
        writer.write_record(name, data, len(data))
    writer.write_end_of_file()
    return aoti


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

    from cgbuild.identity import layout

    rule = layout.QUANT_RULES.get(quant)
    if rule is None:
        raise MintFailure(Code.LAYOUT_DRIFT, f"this worker has no quant rule {quant!r}")
    floor = layout.floor_refusal(rule, sm, torch.__version__)
    if floor is not None:
        raise MintFailure(floor[0], floor[1])
    if device == "cuda":
        ok, why = quant_rules.probe(quant, torch.device("cuda"))
        if not ok:
            raise MintFailure(Code.LAYOUT_TOOLCHAIN_UNSUPPORTED, why)


def _layout(req: Mapping[str, Any], traced: list[list[Any]]) -> dict[str, Any] | None:
    """Re-derive the layout axis here and return the sealed `layout` block (its tensor table is
    what adopt checks a live module against); refuse `layout-drift` when it differs from the key.

    The topology is derived from the state this worker traced: a plan only keys a reference
    whose headers equal the traced tensors (else `layout-topology-mismatch`), so both give one
    digest and a mint needs no access to the reference. When they differ here and the reference
    is readable, the refusal names the first tensor. Requests without a `layout` block
    (hand-made ones) seal none; adopt then checks weights only.
    """
    want = req.get("layout")
    if not want:
        return None
    from cgbuild.core.errors import UserError
    from cgbuild.identity import layout

    rule = layout.QUANT_RULES.get(want["quant"])
    if rule is None:
        raise MintFailure(Code.LAYOUT_DRIFT, f"this worker has no quant rule {want['quant']!r}")
    rows = layout.from_trace(traced)
    here = layout.layout_identity(layout.topology_digest(rows), rule)
    asked = {"topology": want.get("topology"), "quant": want.get("quant_digest")}
    if here != asked:
        if want.get("reference") and here["topology"] != asked["topology"]:
            try:
                reading = layout.Reading.from_json(want.get("reading"))
                ref_rows = layout.topology_from_reference(Path(want["reference"]), want["component"], reading)
                mismatch = layout.topology_mismatch(ref_rows, rows)
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
        "stamp": req.get("stamp"),
        "rule": {"name": rule.name, "version": rule.version, "facts": rule.facts},
        "dtype": want.get("dtype"),
        "tensors": sorted(rows),
    }


def stage_compile(req: Mapping[str, Any], work: Path) -> dict[str, Any]:
    """Trace (`trace.json`: the graph facts and this machine's sm), then, on the worker's go,
    refuse drift and compile. A held stage (started by a `MintHold`) traces before any key
    exists, on the device when this machine has it (else fake, for the plan alone), and reads
    the key's request at the go; an ordinary one refuses a wrong device before tracing."""
    import importlib.metadata as md

    import torch
    from cgbuild_rules import trace
    from cgbuild_rules.loader import Package

    job = trace.parse_job(req["job"])
    held = req.get("schema") == HOLD_SCHEMA
    here = _sm_here(job.device)
    if not held:
        _device_refusal(job.device, req["sm"], here)
        _quant_floor(job.quant, job.device, req["sm"])
    _fault("trace")
    t = time.perf_counter()
    ep, facts = trace.export_job(job, "fake" if here is None else "empty")
    export_s = time.perf_counter() - t
    fs.write_atomic(
        work / "trace.json", json.dumps({"ok": True, **{k: facts[k] for k in FACT_KEYS}, "sm": here})
    )
    req = _await(work, "compile")["request"]  # a hold's key request is known only now
    _fault("compile")
    if held:
        _device_refusal(job.device, req["sm"], here)
        _quant_floor(job.quant, job.device, req["sm"])
    tc = _toolchain(req)
    if facts["graph_digest"] != req["graph_digest"]:
        raise MintFailure(
            Code.GRAPH_DRIFT,
            f"graph digest {req['graph_digest'][:12]} → {facts['graph_digest'][:12]}: "
            "this machine traces a different program than the key was built for",
            old=req["graph_digest"],
            new=facts["graph_digest"],
        )
    layout_block = _layout(req, facts["topology"])
    arch = normalize_arch(platform.machine())
    # A torch without `cpp.march` builds -march=native; the toolchain then keys this host's level.
    clamps = tc["components"]["isa"].get("keyed") != "host"
    configs: dict[str, Any] = policy.inductor_configs(arch, clamps=clamps)
    applied = dict(configs)
    configs["cpp.cxx"] = (None, req["cxx_path"])
    t = time.perf_counter()
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
    aoti = normalize_package(raw, work / PACKAGE, req["sandbox"], march)
    compile_s = time.perf_counter() - t
    # Loading never calls the package (calling it unbound would segfault); it names what it binds.
    table = _constants_table(ep, Package(work / PACKAGE).constant_fqns)
    if table["literal"]:
        from safetensors.torch import save_file

        values = {r["fqn"]: ep.constants[r["fqn"]].detach().contiguous().cpu() for r in table["literal"]}
        save_file(values, str(work / LITERALS))
    forensics: dict[str, str] = {"python": ".".join(platform.python_version_tuple()[:2])}
    for dist in TRACE_ONLY:
        with contextlib.suppress(md.PackageNotFoundError):
            forensics[dist] = md.version(dist)
    return {
        "ok": True,
        "graph_digest": facts["graph_digest"],
        "contract": facts["contract"],
        "nodes": facts["nodes"],
        "module": facts["module"],
        "toolchain": tc,
        "policy": applied,
        "constants": table,
        "layout": layout_block,
        "aoti": aoti,
        "torch": torch.__version__,
        "forensics": forensics,
        "seconds": {"export": round(export_s, 3), "compile": round(compile_s, 3)},
    }


def _rel_rms(got: Any, want: Any) -> float:

    diff = (got.double() - want.double()).pow(2).mean().sqrt()
    return float(diff / want.double().pow(2).mean().sqrt().clamp_min(1e-30))


def _rule_tolerance(quant: str) -> dict[str, str]:
    """{"rule": tolerance} when the layout's quant rule states its own (fp8-rowwise), else {}."""
    stated = _tol(quant)
    return {"rule": stated} if stated else {}


def compare_outputs(got: Any, want: Any, tolerance: str | None = None) -> list[dict[str, Any]]:
    """Compiled vs eager, leaf by leaf: same structure, dtype, shape and non-finite pattern, and a
    relative RMS error within the output dtype's tolerance, or within `tolerance` where the
    layout's quant rule states one (W8A8 is not bf16); raises `verify-mismatch` otherwise."""
    import torch
    from torch.utils import _pytree as pytree

    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(want)
    if got_spec != want_spec:
        raise MintFailure(Code.VERIFY_MISMATCH, f"output structure {got_spec} differs from eager {want_spec}")
    errors = []
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves, strict=True)):
        if not isinstance(w, torch.Tensor):
            continue
        if g.shape != w.shape or g.dtype != w.dtype:
            raise MintFailure(
                Code.VERIFY_MISMATCH,
                f"output {i}: {g.dtype}{list(g.shape)} vs eager {w.dtype}{list(w.shape)}",
            )
        tol = float(tolerance or TOLERANCE.get(str(w.dtype).removeprefix("torch."), "1e-2"))
        finite = torch.isfinite(w)
        if not torch.equal(torch.isfinite(g), finite):
            raise MintFailure(Code.VERIFY_MISMATCH, f"output {i}: non-finite values differ from eager")
        err = _rel_rms(g[finite], w[finite]) if finite.any() else 0.0
        if err > tol:
            raise MintFailure(
                Code.VERIFY_MISMATCH, f"output {i}: relative RMS error {err:.3g} > {tol:g} ({w.dtype})"
            )
        errors.append(
            {
                "output": i,
                "dtype": str(w.dtype).removeprefix("torch."),
                "rel_rms": err,
                "tolerance": tol,
                "max_abs": float((g - w).abs().max()) if g.numel() else 0.0,
            }
        )
    return errors


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
    bound: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    """The sealed switch table, as verify found it on the module."""


def _verify(req: Mapping[str, Any], work: Path, c: _Checked) -> dict[str, Any]:
    """The compiled package through the real loader against the module's eager output (with the
    literals the compile wrote), and every lane of it when the request has lanes."""
    _fault("verify")
    import torch
    from cgbuild_rules import trace
    from cgbuild_rules.adopt import _attribute
    from cgbuild_rules.loader import Package, state_tensors

    job, built = c.job, c.built
    if (work / LITERALS).exists():
        from safetensors.torch import load_file

        c.literals = {k: v.to(job.device) for k, v in load_file(str(work / LITERALS)).items()}
        for fqn, value in c.literals.items():
            c.own[fqn] = _attribute(built.module, fqn)
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
    c.bound = {fqn: live[fqn] for fqn in c.package.constant_fqns}
    c.package.bind(c.bound)
    with torch.no_grad():
        got = c.package(*built.args, **built.kwargs)
    result: dict[str, Any] = {"ok": True, "errors": compare_outputs(got, want, _tol(job.quant))}
    if req.get("lanes"):
        result["lanes"] = _verify_lanes(req, job, built, c.package, c.bound)
        c.rows = result["lanes"]["rows"]
    return result


def _await(work: Path, part: str) -> dict[str, Any]:
    """Wait for the worker to hand this stage `part`'s input (`go-<part>.json`, written atomically)."""
    go = work / f"go-{part}.json"
    while not go.exists():
        time.sleep(POLL_S)
    return dict(json.loads(go.read_text()))


def stage_check(req: Mapping[str, Any], work: Path) -> dict[str, Any]:
    """verify, measure and serve in ONE process, started beside the compile.

    Importing torch and the entry and building the module with its seed-0 weights (about 20 s
    for klein-4B) happen while the compile runs; each part then waits for its input from the
    worker (`go-verify`, `go-measure` with the candidates, `go-serve` with the sealed artifact)
    and writes `<part>.json`. A part that fails ends the stage with its failure (`check.json`).
    """
    import torch
    from cgbuild_rules import lanes as lane_rt
    from cgbuild_rules import trace

    job = trace.parse_job(req["job"])
    base = lane_rt.process_bytes()  # the bare process, before the module or package exist
    c = _Checked(job, trace.build(job, "real"), base)
    req = _await(work, "verify")["request"]  # a hold's key request is known only now
    fs.write_atomic(work / "verify.json", json.dumps(_verify(req, work, c)))
    candidates = _await(work, "measure")["candidates"]
    if candidates:
        threads = torch.get_num_threads()
        try:
            fs.write_atomic(work / "measure.json", json.dumps(_measure(req, c, candidates)))
        finally:
            torch.set_num_threads(threads)
    else:
        fs.write_atomic(work / "measure.json", json.dumps({"ok": True, "runs": {}}))
    artifact = _await(work, "serve")["artifact"]
    for fqn, value in c.own.items():
        if value is not None:
            trace._set_attribute(c.built.module, fqn, value)
    fs.write_atomic(work / "serve.json", json.dumps(_serve(req, c.job, c.built, artifact)))
    return {"ok": True}


def stage_serve(req: Mapping[str, Any], work: Path, artifact: str) -> dict[str, Any]:
    """The sealed artifact as a serving process meets it (`cgbuild verify --run`'s own process;
    a mint's check stage runs the same `_serve` on the module it built): the live module
    from the entry (seed-0 weights, its own literals), `adopt` (strict: a refusal fails the mint
    with adopt's own code), the entry's call served through it, which must run compiled (no
    eager fallback, by the router's counters), compared against eager. An artifact with lanes
    is adopted once per lane it can serve, each pinned, against eager with the same lane.
    """
    from cgbuild_rules import trace

    job = trace.parse_job(req["job"])
    return _serve(req, job, trace.build(job, "real"), artifact)


def _serve(req: Mapping[str, Any], job: Any, built: Any, artifact: str) -> dict[str, Any]:
    _fault("serve")
    import torch
    from cgbuild_rules import lanes as lane_rt
    from cgbuild_rules.adopt import AdoptRefused, adopt

    from cgbuild import lanes

    block = read_metadata(artifact).get("lanes") or {}
    rows = block.get("axes") or []
    axes = [r["axis"] for r in rows]
    excluded = set(block.get("excluded") or {})
    choices: list[str | None] = [
        lane
        for lane in lanes.combinations([(r["axis"], r["values"]) for r in rows])
        if not {f"{a}.{v}" for a, v in lanes.split(lane, axes).items()} & excluded
    ] or [None]
    errors: list[dict[str, Any]] = []
    served: list[dict[str, Any]] = []
    for lane in choices:
        if lane is not None:
            lane_rt.set_lanes(built.module, lanes.split(lane, axes))
        with torch.no_grad():
            want = built.module(*built.args, **built.kwargs)
        try:
            adopted = adopt(artifact, built.module, strict=True, lane=lane)
        except AdoptRefused as e:
            detail = f"adopt refuses the sealed artifact: {e.refusal.detail}"
            raise MintFailure(e.refusal.code, detail) from None
        with torch.no_grad():
            got = adopted(*built.args, **built.kwargs)
        counters = dict(adopted.counters)
        if counters != {"compiled": 1}:
            why = adopted.last_reason
            code, detail = (why.code, why.detail) if why else (Code.VERIFY_FAILED, f"counters {counters}")
            raise MintFailure(code, f"adopted, but the entry's own call was served eager: {detail}")
        tag = {} if lane is None else {"lane": lane}
        errors += [{**e, **tag} for e in compare_outputs(got, want, _tol(job.quant))]
        served.append({**tag, "counters": counters, "seconds": round(adopted.armed[0].seconds, 3)})
    return {"ok": True, "errors": errors, "served": served}


def _tol(quant: str) -> str | None:
    """The tolerance the layout's quant rule states, or None (the compute dtype's applies)."""
    return QUANT_RULES[quant].tolerance


def _lane_rows(req: Mapping[str, Any], job: Any, module: Any) -> list[dict[str, Any]]:
    from cgbuild_rules import lanes as lane_rt

    declared = [axis for axis, _ in req["lanes"]["axes"]]
    try:
        return lane_rt.lane_rows(module, declared, job.spec.get("lanes") or {})
    except ValueError as e:
        raise MintFailure(Code.ENTRY_ERROR, str(e)) from None


def _verify_lanes(
    req: Mapping[str, Any], job: Any, built: Any, package: Any, bound: Mapping[str, Any]
) -> dict[str, Any]:
    """Every lane of the ONE compiled artifact against eager with the same lane, and each value
    against its axis's reference (the numerics self-check that makes it a candidate)."""
    import torch
    from cgbuild_rules import lanes as lane_rt

    rows = _lane_rows(req, job, built.module)

    def eager(choice: Mapping[str, str]) -> Any:
        lane_rt.set_lanes(built.module, choice)
        with torch.no_grad():
            return built.module(*built.args, **built.kwargs)

    def compiled(choice: Mapping[str, str]) -> Any:
        package.bind({**bound, **lane_rt.bindings(rows, choice, job.device)})
        with torch.no_grad():
            return package(*built.args, **built.kwargs)

    compare = functools.partial(compare_outputs, tolerance=_tol(job.quant))
    checks = lane_rt.verify_lanes(rows, eager, compiled, compare)
    return {"rows": rows, **checks}


def _measure(req: Mapping[str, Any], c: _Checked, candidates: Sequence[str]) -> dict[str, Any]:
    """Every candidate lane's benchmark, in turn, on the module and package this stage already
    holds (cgbuild_rules.lanes.measure): each lane is bound in its place before its own warm-ups,
    peak reset and timed calls. A lane measured later does not inherit an earlier one's peak: the
    GPU's counter and the CPU's resident high-water mark are reset per lane, after freed memory
    was returned."""
    _fault("measure")
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
    rows, axes = c.rows, [r["axis"] for r in c.rows]
    device = torch.device(job.device)

    def call() -> Any:
        return c.package(*built.args, **built.kwargs)

    runs: dict[str, Any] = {}
    for lane in candidates:
        print(f"lanes: measuring {lane}", file=sys.stderr, flush=True)
        c.package.bind({**c.bound, **lane_rt.bindings(rows, lanes.split(lane, axes), job.device)})
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        runs[lane] = lane_rt.measure(call, device, c.base_bytes if device.type == "cpu" else 0)
    return {"ok": True, "runs": runs, "device": lane_rt.device_facts(device)}


def _lane_verdict(
    req: MintRequest,
    built: Mapping[str, Any],
    checked: Mapping[str, Any],
    check: _Stage,
    progress: Callable[[str], None] | None,
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """Candidates from capability, measured in the check stage, the rule's verdict.

    Returns (the sealed `lanes` block: discrete facts only; the evidence: raw timings, samples,
    the device, never sealed), or (None, None) when the request declares no lanes.
    """
    from cgbuild import lanes

    want = req.lanes
    if not want:
        check.part("measure", {"candidates": []})
        return None, None
    rows = checked["lanes"]["rows"]
    used = {r["axis"] for r in rows}
    declared = [(axis, values) for axis, values in want["axes"] if axis in used]
    needs = {a: {v: lanes.Needs.from_json(n) for v, n in want["needs"][a].items()} for a, _ in want["axes"]}
    triton = lanes.has_triton(built["toolchain"]["components"])
    numerics = {
        a: {v: bool(r["ok"]) for v, r in vals.items()} for a, vals in checked["lanes"]["numerics"].items()
    }
    excluded = lanes.exclusions(want["axes"], needs, req.sm, triton)
    excluded.update(
        {f"{a}.{v}": "numerics" for a, vals in numerics.items() for v, ok in vals.items() if not ok}
    )
    candidates = lanes.candidates(declared, needs, req.sm, triton, numerics)
    runs: dict[str, Any] = {}
    if candidates and progress:
        progress(f"lanes: measuring {', '.join(candidates)}")
    stage = check.part("measure", {"candidates": candidates})
    if candidates:
        runs = {lane: {"lane": lane, **stage["runs"][lane], "device": stage["device"]} for lane in candidates}
        sku = want["sku"]
        measured = [
            lanes.Measured(lane, runs[lane]["median_ns"], runs[lane]["peak_bytes"]) for lane in candidates
        ]
        verdict = lanes.decide(measured, sku["name"], sku["memory_bytes"])
    elif rows:  # one combination survives capability: nothing to choose, nothing measured
        surviving = [(r["axis"], [v for v in r["values"] if numerics[r["axis"]][v]]) for r in rows]
        verdict = lanes.unmeasured(lanes.combinations(surviving)[0], Code.ONE_CANDIDATE)
    else:  # this module uses none of the declared axes
        verdict = None
    block = {
        "schema": lanes.LANES_SCHEMA,
        "axes": [{"axis": r["axis"], "values": r["values"], "fqn": r["fqn"]} for r in rows],
        "excluded": excluded,
        "verdict": verdict,
    }
    evidence = {
        "schema": "cgbuild.lane-evidence-run/1",
        "sm": req.sm,
        "sku": want["sku"],
        "candidates": candidates,
        "measured": runs,
        "numerics": checked["lanes"]["numerics"],
        "excluded": excluded,
        "verdict": verdict,
    }
    return block, evidence


def _stage_main(stage: str, work: Path, args: Sequence[str] = ()) -> int:
    req = json.loads((work / "request.json").read_text())
    stages: dict[str, Callable[..., dict[str, Any]]] = {
        "compile": stage_compile,
        "check": stage_check,
        "serve": stage_serve,
    }
    fn = stages[stage]
    try:
        result = fn(req, work, *args)
    except MintFailure as e:
        result = {"ok": False, "code": e.code, "detail": e.detail, **e.extra}
    except MemoryError as e:
        result = {"ok": False, "code": Code.OOM, "detail": f"{stage}: {e}"}
    except Exception as e:
        from cgbuild_rules.digest import TraceError

        failed = {"compile": Code.COMPILE_FAILED, "check": Code.CHECK_FAILED, "serve": Code.SERVE_FAILED}[
            stage
        ]
        code = getattr(e, "code", Code.TRACE_FAILED) if isinstance(e, TraceError) else failed
        result = {
            "ok": False,
            "code": code,
            "detail": f"{type(e).__name__}: {' '.join(str(e).split())[:600]}",
        }
    fs.write_atomic(work / f"{stage}.json", json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Worker: one request on stdin, one result line on stdout. `--stage NAME DIR` runs a stage."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--stage"]:
        spawn.die_with_group()
        return _stage_main(args[1], Path(args[2]), args[3:])
    proto = os.fdopen(os.dup(1), "w", encoding="ascii")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    result: MintOutcome | None
    try:
        req = json.loads(sys.stdin.readline())
    except ValueError as e:
        req = None
        result = MintFailure(Code.BAD_REQUEST, f"not JSON: {e}").result(None, Phase.REQUEST)
    if req is not None:

        def say(message: Mapping[str, Any]) -> None:
            proto.write(json.dumps({"id": req.get("id"), **message}) + "\n")
            proto.flush()

        def next_request(traced: dict[str, Any]) -> Any:
            """A hold's trace out; the key's request in (None: the engine closed our input)."""
            say({"traced": traced})
            line = sys.stdin.readline()
            if not line.strip():
                return None
            try:
                raw = json.loads(line)
            except ValueError as e:
                raise MintFailure(Code.BAD_REQUEST, f"not JSON: {e}") from None
            if not isinstance(raw, dict):
                raise MintFailure(Code.BAD_REQUEST, f"the key's request is not a JSON object: {line[:80]!r}")
            return raw

        result = mint(req, lambda phase: say({"progress": phase}), next_request)
    if result is not None:
        line = json.dumps(result.to_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        proto.write(line + "\n")
        proto.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
