"""Output for people (rich, on demand) and machines (JSON on stdout).

rich is imported only when something is shown to a person, so `--json` runs never pay for it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

STATUS_STYLE = {"fresh": "green", "mint": "yellow", "trace": "cyan", "blocked": "red"}


def console(stderr: bool = False) -> Console:
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=True)


def print_json(data: Any, out: Any = None) -> None:
    stream = out or sys.stdout
    # json.dumps, not json.dump: dump always takes the pure-Python encoder (one write per token),
    # 4x slower on a 10,000-target plan; dumps takes the C encoder and writes the same bytes once.
    stream.write(json.dumps(data, indent=None, sort_keys=True, separators=(",", ":")) + "\n")


def progress_bar(description: str) -> tuple[Callable[[int, int, str], None], Callable[[], None]]:
    """(update(done, total, item), close()) drawing a bar on stderr when it is a terminal."""
    if not sys.stderr.isatty():

        def plain(done: int, total: int, item: str) -> None:
            print(f"{description} [{done}/{total}] {item}", file=sys.stderr, flush=True)

        return plain, lambda: None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[item]}"),
        console=console(stderr=True),
        transient=True,
    )
    task = bar.add_task(description, total=None, item="")
    bar.start()

    def update(done: int, total: int, item: str) -> None:
        bar.update(task, completed=done, total=total, item=item)

    return update, bar.stop


def component_summary(name: str, comp: Any) -> str:
    """One short phrase per toolchain component, as a reader wants it: versions, and for the
    compile settings the settings themselves rather than their scheme's name."""
    from cgbuild.identity import toolchain_changes

    if name == "settings" and isinstance(comp, dict) and isinstance(comp.get("inductor"), dict):
        inductor = ", ".join(f"{k}={v}" for k, v in sorted(comp["inductor"].items()))
        env = comp.get("env") or {}
        fixed = ", ".join(f"{k}={v}" for k, v in sorted((env.get("set") or {}).items()))
        scrubbed = len(env.get("scrub") or []) + len(env.get("scrub_prefixes") or [])
        return f"inductor {inductor or 'defaults'}; env {fixed or 'as found'}, {scrubbed} variables scrubbed"
    return toolchain_changes.summary(name, comp)


def phase_times(phases: dict[str, Any] | None) -> str:
    """A mint's phase seconds in execution order (its result lists them sorted by name; phases
    the worker does not announce: before total)."""
    from cgbuild.protocol.mint import PHASES

    order = ("wait", "export", *PHASES, "total")
    items = [(k, v) for k, v in (phases or {}).items() if isinstance(v, int | float)]
    rank = {name: float(i) for i, name in enumerate(order)}
    items.sort(key=lambda kv: (rank.get(kv[0], len(order) - 1.5), kv[0]))
    return ", ".join(f"{k} {v:.1f}s" for k, v in items)


def key_line(tag: str, entry: Any, rest: str = "") -> str:
    """One row of a per-key summary: `  tag  key12 labels…rest` (mint, fetch)."""
    return f"  {tag} {entry['key'][:12]} {' '.join(entry['labels'])}{rest}"
