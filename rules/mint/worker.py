"""The mint worker: one request in, one outcome out, no torch.

It validates the request (keeping the `MintRequest`), holds the compile sandbox, runs the
stages through their parts, announces and times each phase, writes the sealed metadata and
seals; only an artifact the serve check adopted leaves its work folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cgbuild_rules.mint.check import lane_verdict, stage_check, stage_serve
from cgbuild_rules.mint.compare import TOLERANCE, rule_tolerance
from cgbuild_rules.mint.compile import stage_compile
from cgbuild_rules.mint.failure import MintFailure
from cgbuild_rules.mint.stages import Conversation, Stage

import cgbuild
from cgbuild.core.codes import Code
from cgbuild.identity import compiler, policy
from cgbuild.protocol import spawn
from cgbuild.protocol.mint import (
    HOLD_SCHEMA,
    BadRequest,
    Minted,
    MintHold,
    MintOutcome,
    MintRequest,
    Phase,
)
from cgbuild.protocol.stage import Compiled, Go, Served, StageEnv, StageStart, Traced, Verified
from cgbuild.store.seal import LITERALS, PACKAGE, compare_artifacts, member_digests, read_metadata, seal

ARTIFACT_SCHEMA = "cgbuild.artifact/1"
ARTIFACT_KIND = "aot-inductor"
DEFAULT_SANDBOX = "/tmp/cgbuild-sandbox"


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
    path: Path, empty: bool, progress: Callable[[str], None] | None = None
) -> Iterator[Callable[[], float]]:
    """Hold the sandbox: shared by warm mints; exclusive (and emptied) for one that empties it. The
    sandbox is shared by every workspace of this machine, so a wait is announced, never silent,
    and timed: the context gives the seconds it waited (the mint's `wait` phase)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    mode = fcntl.LOCK_EX if empty else fcntl.LOCK_SH
    waited = 0.0
    try:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                holder = "mints using it" if empty else "a `mint --check` emptying it"
                progress(f"waiting for the compile sandbox {path} ({holder})")
            t = time.perf_counter()
            fcntl.flock(fd, mode)
            waited = time.perf_counter() - t
        if empty:
            shutil.rmtree(path, ignore_errors=True)
        for sub in ("tmp", "inductor", "triton"):
            (path / sub).mkdir(parents=True, exist_ok=True)
        yield lambda: waited
    finally:
        os.close(fd)


def _metadata(req: MintRequest, built: Compiled, lanes_block: dict[str, Any] | None = None) -> dict[str, Any]:
    """The sealed metadata: discrete facts only (no clocks, no paths, no measured errors). The
    contract is sealed as the engine's type writes it, so what adopt parses is what was sealed
    (the compile stage parsed it from the trace, and its answer was parsed again at this end)."""
    contract = built.contract.to_json()
    components = built.toolchain["components"]
    extra = {} if lanes_block is None else {"lanes": lanes_block}
    return {
        **extra,
        "schema": ARTIFACT_SCHEMA,
        "kind": ARTIFACT_KIND,
        "key": req.key,
        "axes": req.axes or {},
        "graph": {"digest": built.graph_digest, "contract": contract, "nodes": built.nodes},
        "facets": req.facets or [],
        "stamp": req.stamp,
        "sm": req.sm,
        "device": req.job.spec["device"],
        "toolchain": built.toolchain,
        "policy": built.policy,
        "host": {
            "isa": components["isa"],
            "aoti_cpu_isa": built.aoti.cpu_isa,
            "runtime": built.aoti.runtime,
            "cxx": {k: components["cxx"][k] for k in ("family", "version", "banner")},
        },
        "torch": built.torch,
        "cgbuild": cgbuild.__version__,
        "constants": built.constants,
        "layout": built.layout,
        "module": built.module,
        "verify": {"metric": "rel-rms", "tolerance": TOLERANCE, **rule_tolerance(req.job.quant)},
        "forensics": built.forensics,
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


@dataclass
class _Run:
    """One mint's surroundings: the stages' environment (its work folder, the compiler, the
    sandbox), the stages' process environment, its clock, and its check stage once started."""

    stage_env: StageEnv
    env: dict[str, str]
    timeout: float
    clock: _Clock
    check: Stage | None = None

    @classmethod
    def prepare(cls, asked: MintRequest | MintHold, work: Path, clock: _Clock) -> _Run:
        sandbox = Path(asked.sandbox or DEFAULT_SANDBOX)
        cxx = compiler.choose_cxx(asked.cxx)
        folders = {"TMPDIR": "tmp", "TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}
        env = policy.mint_environment(os.environ, {k: str(sandbox / v) for k, v in folders.items()})
        (work / "tmp").mkdir()
        stage_env = StageEnv(str(work), cxx, str(sandbox))
        return cls(stage_env, {**env, "CXX": cxx}, float(asked.timeout_s or 3600), clock)

    @property
    def work(self) -> Path:
        return Path(self.stage_env.work)

    @property
    def sandbox(self) -> Path:
        return Path(self.stage_env.sandbox or DEFAULT_SANDBOX)

    def stage(self, name: str, asked: MintRequest | MintHold) -> Stage:
        """A stage child, started with the key's request (a hold's comes with its go); the check
        stage's temp folder is the mint's own, outside the sandbox."""
        env = {**self.env, "TMPDIR": str(self.work / "tmp")} if name == "check" else self.env
        request = asked if isinstance(asked, MintRequest) else None
        start = StageStart(asked.job, self.stage_env, request)
        return Stage(name, start, env, self.timeout, self.work / f"{name}.log")


def _minted(
    asked: MintRequest | MintHold,
    work: Path,
    clock: _Clock,
    next_request: Callable[[dict[str, Any]], Any] | None,
) -> Minted:
    """The mint itself: trace and compile under the sandbox, then verify, lanes, seal, serve."""
    run = _Run.prepare(asked, work, clock)
    try:
        req, built, waited = _compiled(run, asked, next_request)
        assert run.check is not None  # a hold starts its check stage with its key
        clock.enter(Phase.VERIFY)  # from the package's end: load, eager, compare
        checked = run.check.part(Verified, Go("verify", request=req))
        clock.enter(Phase.LANES, announce=False)
        lanes_block, evidence = lane_verdict(req, built, checked, run.check, clock.progress)
        clock.enter(Phase.SEAL)
        packed, sha = _sealed(work, req, built, lanes_block)
        clock.enter(Phase.SERVE)
        served = run.check.part(Served, Go("serve", artifact=str(packed)))
        total = clock.total()
        run.check.finish()
    except BaseException:
        if run.check is not None:
            run.check.stop()
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
        verify=list(served.errors),
        served=list(served.served),
        phases={**({"wait": waited} if waited else {}), **built.seconds, **seconds, "total": total},
        lane_evidence=evidence,
        device=checked.device,
        compared=compare_artifacts(req.compare_with, artifact) if req.compare_with else None,
    )


def _compiled(
    run: _Run, asked: MintRequest | MintHold, next_request: Callable[[dict[str, Any]], Any] | None
) -> tuple[MintRequest, Compiled, float]:
    """(the key's request, the compile stage's result, seconds waited for the sandbox): the
    trace and the compile, under the sandbox's lock. The check stage starts beside the compile;
    a hold's only once a key needs it (its module costs memory and time)."""
    clock = run.clock
    if isinstance(asked, MintRequest):
        run.check = run.stage("check", asked)
    empty = isinstance(asked, MintRequest) and bool(asked.empty_sandbox)
    with _sandbox(run.sandbox, empty, clock.progress) as waited:
        compiling = run.stage("compile", asked)
        try:
            if isinstance(asked, MintHold):
                clock.enter(Phase.TRACE, announce=False)
                assert next_request is not None
                req = _held_request(asked, compiling, next_request)
                clock.restart()
                run.check = run.stage("check", req)
                clock.enter(Phase.COMPILE)
            else:
                req = asked
                clock.enter(Phase.COMPILE)  # the sandbox is held: the compile stage starts now
                compiling.part(Traced)  # the stage checks the digest against the key's
            built = compiling.part(Compiled, Go("compile", request=req))
            compiling.finish()
        except BaseException:
            compiling.stop()
            raise
    return req, built, round(waited(), 3)


def _sealed(
    work: Path, req: MintRequest, built: Compiled, lanes_block: dict[str, Any] | None
) -> tuple[Path, str]:
    """The package (and literals) sealed with its metadata in the work folder: (path, sha256)."""
    members = {PACKAGE: work / PACKAGE}
    if (work / LITERALS).exists():
        members[LITERALS] = work / LITERALS
    packed = work / f"{req.key}.tar.gz"
    sha = seal(packed, _metadata(req, built, lanes_block), members)
    if read_metadata(packed)["key"] != req.key:
        raise MintFailure(Code.SEAL_FAILED, "sealed metadata does not read back with its key")
    return packed, sha


def _held_request(
    hold: MintHold, compiling: Stage, next_request: Callable[[dict[str, Any]], Any]
) -> MintRequest:
    """A hold's trace, handed to the engine; then the key's request it answers with (the
    stages get it with their go). A failed trace is the engine's to report, as the trace rule's."""
    try:
        traced = compiling.part(Traced)
    except MintFailure as e:
        next_request(e.result(hold.id, Phase.TRACE).to_json())
        raise _NotNeeded() from None
    raw = next_request(traced.to_json())
    if raw is None:
        raise _NotNeeded()
    return _admitted(hold, raw)


def stage_main(stage: str) -> int:
    """A stage child's life: its start line, its parts, and its failure as its last line."""
    proto = os.fdopen(os.dup(1), "w", encoding="ascii")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        talk = Conversation(stage, sys.stdin, proto)
    except ValueError as e:  # not JSON, or not a start (BadMessage): said on the stream, typed
        refused = MintFailure(Code.MINT_ERROR, f"the {stage} stage's start is none: {e}")
        proto.write(json.dumps(refused.result(None, Phase.REQUEST).to_json()) + "\n")
        return 0
    stages: dict[str, Callable[[Conversation], Any]] = {
        "compile": lambda t: t.answer(stage_compile(t)),
        "check": stage_check,
        "serve": stage_serve,
    }
    try:
        stages[stage](talk)
    except MintFailure as e:
        talk.fail(e)
    except MemoryError as e:
        talk.fail(MintFailure(Code.OOM, f"{stage}: {e}"))
    except Exception as e:
        from cgbuild_rules.digest import TraceError

        failed = {"compile": Code.COMPILE_FAILED, "check": Code.CHECK_FAILED, "serve": Code.SERVE_FAILED}[
            stage
        ]
        code = getattr(e, "code", Code.TRACE_FAILED) if isinstance(e, TraceError) else failed
        talk.fail(MintFailure(code, f"{type(e).__name__}: {' '.join(str(e).split())[:600]}"))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Worker: one request on stdin, one result line on stdout. `--stage NAME DIR` runs a stage."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--stage"]:
        spawn.die_with_group()
        return stage_main(args[1])
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
