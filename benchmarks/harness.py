"""What every benchmark shares: the stamp of where and on what it ran, one result writer, the timers.

A result is one JSON document that starts with what produced it (`benchmark`, `date`, `commit`,
`machine`, `versions`) and goes on with the benchmark's own numbers, so any two results can be
compared on the same facts. A GPU machine may get a copy of the tree without .git: there the
commit comes from `--commit`. The engine's benchmarks measure processes that must not import
torch, so the stamp never imports it unasked: torch's version comes from its installed metadata,
and its CUDA runtime and the GPU only where torch is already loaded (or `torch=True` asks).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata as md
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


# -- where and on what it ran ------------------------------------------------------------------------
def load_average() -> list[float]:
    """1, 5 and 15 minute load averages: the boxes are shared, so they say how quiet a run was."""
    return [round(x, 2) for x in os.getloadavg()]


def _torch(load: bool) -> Any:
    """torch where this process has loaded it or `load` asks for it; None otherwise."""
    if load:
        import torch

        return torch
    return sys.modules.get("torch")


def _text(path: str) -> str:
    return Path(path).read_text() if Path(path).exists() else ""


def machine(*, torch: bool = False) -> dict[str, Any]:
    """The host (CPU model, cores, memory, system) and, where torch is loaded and sees one, the GPU."""
    model = re.search(r"^model name\s*:\s*(.+)$", _text("/proc/cpuinfo"), re.M)
    mem = re.search(r"^MemTotal:\s*(\d+) kB", _text("/proc/meminfo"), re.M)
    out: dict[str, Any] = {
        "cpu": model.group(1).strip() if model else platform.processor(),
        "cores": os.cpu_count(),
        "memory_gib": round(int(mem.group(1)) / (1 << 20), 1) if mem else None,
        "system": f"{platform.system()} {platform.machine()}",
    }
    loaded = _torch(torch)
    if loaded is not None and loaded.cuda.is_available():
        from cgbuild_rules.lanes import device_facts  # how a mint's lane evidence names its device

        index = loaded.cuda.current_device()
        gpu = device_facts(loaded.device("cuda", index))
        major, minor = loaded.cuda.get_device_capability(index)
        out |= {
            "gpu": gpu["name"],
            "sm": f"sm_{major}{minor}",
            "gpu_memory_gib": round(gpu["memory_bytes"] / (1 << 30), 1),
            "driver": gpu["driver"],
        }
    return out


def _installed(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def versions(*packages: str, torch: bool = False) -> dict[str, Any]:
    """Python, torch, triton and `packages` as installed (None where absent; `tomli-w` as `tomli_w`);
    where torch is loaded, its own version and the CUDA runtime it was built with (None: a CPU build)."""
    out: dict[str, Any] = {"python": platform.python_version()}
    out |= {name.replace("-", "_"): _installed(name) for name in ("torch", "triton", *packages)}
    loaded = _torch(torch)
    if loaded is not None:
        out |= {"torch": loaded.__version__, "cuda": loaded.version.cuda}
    return out


# -- the commit --------------------------------------------------------------------------------------
def git(*args: str) -> str:
    """`git ARGS` in the checkout, its output stripped; raises where git fails."""
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def _git_or_none(*args: str) -> str | None:
    try:
        return git(*args)
    except (OSError, subprocess.CalledProcessError):  # no git, or no checkout: a copied tree
        return None


def commit_measured(given: str | None = None) -> str | None:
    """`given` (`--commit`: the tree was copied without .git), else HEAD, else None (no git here)."""
    return given or _git_or_none("rev-parse", "HEAD")


def uncommitted(*paths: str) -> list[str] | None:
    """`git status --porcelain` lines under `paths` (the whole checkout by default): what HEAD lacks;
    None where there is no git to ask."""
    status = _git_or_none("status", "--porcelain", "--", *paths)
    return None if status is None else status.splitlines()


def commit_option(parser: argparse.ArgumentParser) -> None:
    """`--commit SHA`, for a run on a copy of the tree that carries no .git."""
    parser.add_argument("--commit", default=None, help="the commit measured (the tree may carry no .git)")


# -- the result --------------------------------------------------------------------------------------
def stamp(*packages: str, torch: bool = False, commit: str | None = None) -> dict[str, Any]:
    """`date` (UTC), `commit`, `machine` and `versions` (with `packages`): what every result starts with."""
    return {
        "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
        "commit": commit_measured(commit),
        "machine": machine(torch=torch),
        "versions": versions(*packages, torch=torch),
    }


def write_json(path: Path, doc: Mapping[str, Any]) -> None:
    """`doc` as indented JSON at `path` (its folder made), replaced whole: a run cut short leaves the
    last full file. Written here, not by cgbuild: a benchmark may run from a checkout it never installed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, path)


def write_result(
    path: Path,
    benchmark: str,
    numbers: Mapping[str, Any],
    *,
    packages: tuple[str, ...] = (),
    torch: bool = False,
    commit: str | None = None,
) -> dict[str, Any]:
    """`benchmark`'s result at `path`: the stamp, then `numbers`. A `machine` or `versions` entry of
    `numbers` adds to the stamp's (the load it ran under, the code under test). Returns the document."""
    doc: dict[str, Any] = {"benchmark": benchmark, **stamp(*packages, torch=torch, commit=commit)}
    for key, value in numbers.items():
        doc[key] = {**doc[key], **value} if key in ("machine", "versions") else value
    write_json(path, doc)
    return doc


# -- a run's folder ----------------------------------------------------------------------------------
@contextlib.contextmanager
def scratch(prefix: str, keep: bool = False) -> Iterator[Path]:
    """A temporary folder for one run, removed after it unless `keep` (then its path is printed)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    finally:
        if keep:
            print(f"kept: {path}")
        else:
            shutil.rmtree(path, ignore_errors=True)


# -- the timers --------------------------------------------------------------------------------------
def wall_times(fn: Callable[[], object], *, reps: int, warmup: int = 0) -> list[float]:
    """Seconds of each of `reps` calls of `fn` (perf_counter), after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def timed(fn: Callable[[], object], *, reps: int, warmup: int = 0) -> float:
    """Median seconds of `reps` calls of `fn` after `warmup` untimed ones: the median, because other
    work on a shared box inflates single calls."""
    return statistics.median(wall_times(fn, reps=reps, warmup=warmup))


def cuda_times(fn: Callable[[], object], *, reps: int, warmup: int = 0) -> list[float]:
    """Seconds of each of `reps` calls of `fn` timed with CUDA events, after `warmup` untimed ones:
    the device's time for the work a call queues, which the host's clock misses (the call returns
    first)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def cuda_timed(fn: Callable[[], object], *, reps: int, warmup: int = 0) -> float:
    """Median seconds of `reps` calls of `fn` timed with CUDA events (`cuda_times`)."""
    return statistics.median(cuda_times(fn, reps=reps, warmup=warmup))


def rel_l2(got: Any, ref: Any, digits: int = 6) -> float:
    """‖got − ref‖ / ‖ref‖ in float32, rounded to `digits`: the error every GPU result quotes."""
    return round(float((got.float() - ref.float()).norm() / ref.float().norm()), digits)


class PhaseClock:
    """Named phases of one run and the wall seconds each took, written into `record` as they end:
    `with clock.phase("weights"): ...` times a block; `clock.lap("arm")` the time since the last lap
    (or the clock's start). Seconds are rounded to `digits` (None: as measured); a phase that raises
    records nothing."""

    def __init__(self, record: dict[str, Any] | None = None, *, digits: int | None = 3) -> None:
        self.record: dict[str, Any] = {} if record is None else record
        self.digits = digits
        self.started = self.last = time.perf_counter()

    def _put(self, name: str, seconds: float, digits: int | None) -> float:
        self.record[name] = seconds if digits is None else round(seconds, digits)
        return float(self.record[name])

    @contextlib.contextmanager
    def phase(self, name: str, *, digits: int | None = None) -> Iterator[None]:
        """The block's wall seconds as `name`, rounded to `digits` where given, else as the clock rounds."""
        start = time.perf_counter()
        yield
        self._put(name, time.perf_counter() - start, self.digits if digits is None else digits)

    def lap(self, name: str) -> float:
        """Seconds since the last lap (or the start) as `name`."""
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        return self._put(name, seconds, self.digits)

    def total(self, name: str) -> float:
        """Seconds since the clock started as `name`."""
        return self._put(name, time.perf_counter() - self.started, self.digits)


if __name__ == "__main__":
    # Another Python's versions (a benchmark that measures an interpreter other than its own):
    # `PY benchmarks/harness.py PACKAGE...` prints them as one JSON line, torch imported.
    print(json.dumps(versions(*sys.argv[1:], torch=True)))


def cgbuild(ws: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`cgbuild -C WS ARGS` in a child process, its output captured; with `check`, a failure ends
    the benchmark naming the command and the tail of what it printed."""
    proc = subprocess.run(
        [sys.executable, "-m", "cgbuild.cli", "-C", str(ws), *args], capture_output=True, text=True
    )
    if check and proc.returncode != 0:
        raise SystemExit(f"cgbuild {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc
