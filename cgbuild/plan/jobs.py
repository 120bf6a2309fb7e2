"""A target's trace job as the mint builds it: with its platform's toolchain components.

The components decide which lane values a program carries (`triton` only where the platform's
toolchain has triton), so a job built without them is another program: a module built from it
is refused by an artifact the mint compiled (`config-drift`). The plan, the mint, `verify` and
every benchmark or test that builds a target's module take the job from `trace_job`. Torch-free:
the planner imports it, and a plan never pays for torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cgbuild.config.targets import Target, expand
from cgbuild.core.errors import UserError
from cgbuild.identity import toolchain
from cgbuild.plan.workspace import Workspace
from cgbuild.protocol.trace import TraceJob, job_for


def resolve_toolchains(ws: Workspace) -> tuple[dict[str, Any], str]:
    """Toolchains per platform by precedence --toolchain > the Cgfile's lock > probing here
    (the probe cached in the workspace's cache)."""
    cg = ws.cg
    try:
        return toolchain.resolve(
            ws.toolchain_lock,
            str(cg.toolchain_lock) if cg.toolchain_lock else None,
            lambda: toolchain.probe(cg.cxx, cache_path=str(ws.state.cache / "toolchain.json")),
        )
    except toolchain.ToolchainError as exc:
        raise _toolchain_refusal(ws, exc) from None


def check_compiler(ws: Workspace) -> None:
    """The Cgfile's `[toolchain] cxx`, identified here as the mint's worker will: a compiler that
    is missing or fails is refused (exit 2) before anything is traced or compiled, even where a
    lock keys the targets and nothing probed it."""
    from cgbuild.identity import compiler

    if ws.cg.cxx is None:
        return
    try:
        compiler.cxx_component(compiler.choose_cxx(ws.cg.cxx))
    except compiler.CompilerError as exc:
        refused = toolchain.ToolchainError(exc.path, "toolchain.cxx", exc.message)
        raise _toolchain_refusal(ws, refused) from None


def _toolchain_refusal(ws: Workspace, exc: toolchain.ToolchainError) -> UserError:
    """A toolchain input refused, named by the Cgfile field that set it where one did (its
    `cxx`, its `lock`), else by the file at fault (a `--toolchain` lock, the default compiler)."""
    cg = ws.cg
    if exc.field == "toolchain.cxx" and cg.cxx is not None:
        return cg.error_in(exc, "toolchain", "cxx")
    if ws.toolchain_lock is None and cg.toolchain_lock is not None and exc.path == str(cg.toolchain_lock):
        return cg.error_in(exc, "toolchain", "lock")
    return UserError(exc.message, file=exc.path, line=exc.line, field=exc.field)


def trace_job(ws: Workspace, target: Target | str, toolchains: Mapping[str, Any] | None = None) -> TraceJob:
    """The trace job of a target (or its label), with the components of the target's platform.

    `toolchains` are the per-platform blocks a plan carries (`plan["toolchains"]`); without them
    they are resolved as the plan resolves them, so the job is the one the mint sends its worker.
    """
    if isinstance(target, str):
        label = target
        found = next((t for t in expand(ws.cg) if t.label == label), None)
        if found is None:
            raise UserError(f"no target {label} in the Cgfile", file=str(ws.cg.path), field="label")
        target = found
    if toolchains is None:
        toolchains = resolve_toolchains(ws)[0]
    return job_for(ws.cg, target, toolchains[target.device].get("components"))
