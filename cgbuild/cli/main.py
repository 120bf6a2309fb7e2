"""`cgbuild` command line: parse, dispatch, and turn bad input into one line and exit code 2.

Exit codes: 0 success; 1 `diff|plan --exit-code` found work, or a mint/verify failed; 2 bad input
(Cgfile, label, lock, plan file, a flag); 3 an internal error (a bug: the traceback is printed);
130 interrupted (Ctrl-C), 143 terminated (SIGTERM): either kills every child cgbuild started.
Each command lives in its own module of this package, imported only when it runs, so `cgbuild plan`
never pays for what `mint` needs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING

from cgbuild import __version__
from cgbuild.core.errors import UserError
from cgbuild.protocol.spawn import Terminated, stop_children_on_signals

if TYPE_CHECKING:
    from cgbuild.config.cgfile import Cgfile
    from cgbuild.plan.workspace import Workspace

_CGFILE: ContextVar[Cgfile | None] = ContextVar("cgfile", default=None)
"""The Cgfile the running command loaded: a refusal of one of its fields raised where it is not
known (the shared store's client names `workspace.remote`) is placed in it (`_placed`)."""

DESCRIPTION = (
    "Build compiled PyTorch graphs: plan what a Cgfile declares, mint what is missing with "
    "AOTInductor, seal it into the store, serve it."
)
EPILOG = """examples:
  cgbuild plan                          what exists, what must be minted, and why
  cgbuild mint //flux2-klein:sm_120     build what a label selects
  cgbuild diff base.json head.json      what a toolchain bump re-mints

exit codes: 0 ok; 1 work found (--exit-code) or a mint failed; 2 bad input; 3 internal error;
130 interrupted; 143 terminated. Docs: docs/ in the source tree, README.md first."""

COMMANDS = {
    "plan": ("cgbuild.cli.plan", "what must be minted, and why"),
    "why": ("cgbuild.cli.why", "the derivation of one target's key and the root cause of its status"),
    "diff": ("cgbuild.cli.diff", "compare two plan JSON files (e.g. across a toolchain bump)"),
    "query": ("cgbuild.cli.query", "targets and the rule graph"),
    "toolchain": ("cgbuild.cli.toolchain", "show or lock the toolchain components"),
    "mint": ("cgbuild.cli.mint", "compile, verify, seal and admit what a label selects"),
    "verify": ("cgbuild.cli.verify", "re-hash stored artifacts (and run them against eager)"),
    "manifest": ("cgbuild.cli.manifest", "write the serving manifest of the selected fresh targets"),
    "inspect": ("cgbuild.cli.inspect", "show an artifact's metadata and evidence"),
    "gc": ("cgbuild.cli.gc", "remove store objects no ref reaches"),
    "fetch": ("cgbuild.cli.fetch", "pull the selection's shared artifacts into the local store, verified"),
    "trust": ("cgbuild.cli.trust", "make a publisher signing key for a shared store"),
}


def find_cgfile(start: Path) -> Path:
    """The nearest `Cgfile` at or above `start`."""
    for folder in (start, *start.parents):
        candidate = folder / "Cgfile"
        if candidate.is_file():
            return candidate
    raise UserError(f"no Cgfile in {start} or any folder above it (use -C DIR or --cgfile PATH)")


def positive_int(text: str) -> int:
    """An argparse type: a count such as `-j` (a positive integer, at most 4096)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if not 0 < value <= 4096:
        raise argparse.ArgumentTypeError(f"expected a positive integer up to 4096, got {value}")
    return value


def add_workspace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cgfile", type=Path, help="the Cgfile (default: nearest Cgfile at or above -C/cwd)")
    p.add_argument(
        "--toolchain",
        metavar="LOCK",
        help="toolchain lock file (overrides the Cgfile's lock and probing this environment)",
    )


def workspace(args: argparse.Namespace, *, writes_state: bool = True) -> Workspace:
    """The workspace the command runs in; one that `writes_state` (every command but `query`)
    is refused (exit 2) when its state folder cannot be written, naming the folder and the fix."""
    from cgbuild.config import cgfile
    from cgbuild.plan.workspace import Workspace

    if args.directory is not None and not _is_dir(args.directory):
        raise UserError(f"not a folder: {args.directory!r}", field="-C")
    path = args.cgfile or find_cgfile(Path(args.directory or ".").resolve())
    ws = Workspace(cgfile.load(path), toolchain_lock=getattr(args, "toolchain", None))
    _CGFILE.set(ws.cg)
    if writes_state and (why := ws.state.unwritable()) is not None:
        raise ws.cg.error(
            f"the state folder {ws.state.root} cannot be written ({why}): make it writable for this "
            "user, or point [workspace] state at a folder that is",
            "workspace",
            "state",
        )
    return ws


def _is_dir(path: str) -> bool:
    try:
        return Path(path).is_dir()
    except (OSError, ValueError):  # a NUL, a name too long
        return False


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, dict[str, object]]:
    parser = argparse.ArgumentParser(
        prog="cgbuild",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-C", dest="directory", metavar="DIR", help="run as if started in DIR")
    parser.add_argument("--version", action="version", version=f"cgbuild {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    modules: dict[str, object] = {}
    chosen = next((a for a in argv if a in COMMANDS), None)
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen or chosen is None:
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as exc:
                if exc.name != module_name:
                    raise
                continue
            module.add_arguments(p)
            modules[name] = module
    return parser, modules


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, modules = build_parser(argv)
    try:
        args = parser.parse_args(argv)
        module = modules.get(args.command)
        if module is None:
            parser.error(f"'{args.command}' is not available in this build")
    except SystemExit as exc:  # argparse has printed the usage line: a bad flag is bad input
        return exc.code if isinstance(exc.code, int) else 2
    loaded = _CGFILE.set(None)
    try:
        with stop_children_on_signals():
            return int(module.run(args) or 0)  # type: ignore[attr-defined]
    except UserError as exc:
        print(f"cgbuild: error: {_placed(exc)}", file=sys.stderr)
        return exc.exit_code
    except Terminated:
        print("cgbuild: terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("cgbuild: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception:
        traceback.print_exc()
        print("cgbuild: internal error (a bug: please report the traceback above)", file=sys.stderr)
        return 3
    finally:
        _CGFILE.reset(loaded)


def _placed(exc: UserError) -> UserError:
    """`exc` with the loaded Cgfile's path and line where it names one of the Cgfile's fields
    and no file: what the Cgfile set is refused at the line that set it."""
    cg = _CGFILE.get()
    if cg is not None and exc.file is None and exc.field:
        line = cg.lines.line(*exc.field.split("."))
        if line is not None:
            exc.file, exc.line = str(cg.path), line
    return exc


if __name__ == "__main__":
    sys.exit(main())
