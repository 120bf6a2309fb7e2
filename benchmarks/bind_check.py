"""What proving a compiled call's bindings costs, against the step it guards.

    python benchmarks/bind_check.py WS LABEL OUT_JSON [--store-archive STORE.tgz --plan PLAN.json]
        [--no-lanes] [--commit SHA]

Before every compiled call adopt proves that the live module still holds what the package was
bound to (`cgbuild_rules.bound.Watch.moved`: every bound tensor's table entry and storage, every
submodule's place, class, mode, hooks and public attributes) and that the call's inputs fit the
contract, strides included (`cgbuild_rules.adopt.fit`). This measures, in one process on the
module the mint built (seed-0 weights, on the target's device):
  check_us     median of 2,000 `moved()` calls (perf_counter), and what it walks
  fit_us       median of 2,000 `fit()` calls on the step's inputs
  step_ms      the served step: 3 warm-up calls, median of 15 (CUDA events on a GPU)
  side_by_side rounds alternating 15 served steps with the watch and 15 with its check
               replaced by one that proves nothing (the pre-guard path), medians of each: the
               check's cost as the step sees it
  restrided    per tensor input, the step with that input handed as a view of other strides
               (the same values; what `t.expand(b)` or a transposed buffer hands adopt): the
               copy into the traced layout, against the contiguous step
The artifact comes from the workspace's store (`cgbuild plan --json` names the key), or from a
store archive and the plan that keyed it (`--store-archive`, `--plan`: a GPU session measures a
banked artifact without minting). Writes one JSON document (machine, versions, date, commit).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import commit_option, cuda_timed, load_average, timed, write_result
from targets import built_of, drop_lanes


def _artifact(ws: Path, label: str, archive: Path | None, plan: Path | None) -> Path:
    from cgbuild.store.local import Store

    if archive is not None and plan is not None:
        work = ws.parent
        with tarfile.open(archive) as tar:
            tar.extractall(work, filter="data")
        targets = json.loads(plan.read_text())["targets"]
        return Store(work / "store").resolve(next(t["key"] for t in targets if t["label"] == label)).path
    out = subprocess.run(
        [sys.executable, "-m", "cgbuild.cli", "-C", str(ws), "plan", label, "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    (target,) = json.loads(out)["targets"]
    assert target["status"] == "fresh", f"{label} is {target['status']}: mint it first"
    return Store(ws / ".cgbuild" / "store").resolve(target["key"]).path


def _median_us(fn: Callable[[], Any]) -> float:
    return round(timed(fn, reps=2000) * 1e6, 2)


def _step_ms(fn: Callable[[], Any], cuda: bool, warm: int = 3) -> float:
    """The median of 15 steps after `warm`: CUDA events on a GPU, the host's clock on the CPU."""
    return round((cuda_timed if cuda else timed)(fn, reps=15, warmup=warm) * 1e3, 4)


def _other_strides(x: Any) -> Any:
    """The same values as a view with every stride doubled (a feature slice of a wider buffer,
    as `buf[..., :n]` hands it), or None for an input with no dimension longer than one."""
    import torch

    if not any(n > 1 for n in x.shape):
        return None
    return torch.stack([x, x], -1)[..., 0]


def _unmoved() -> None:
    """What the watch answers on the path before the guard: nothing proved before the call."""
    return None


def measure(ws: Path, label: str, artifact: Path, rounds: int) -> dict[str, Any]:
    import torch
    from cgbuild_rules.adopt import adopt, fit

    built = built_of(ws, label)
    module, args, kwargs = built.module, tuple(built.args), dict(built.kwargs)
    served = adopt(artifact, module)
    assert served.refusals == {}, served.refusals
    (art,) = served.armed
    cuda = next(module.parameters()).is_cuda
    rec: dict[str, Any] = {"label": label, "device": str(next(module.parameters()).device)}
    watch = art.watch
    assert watch is not None
    rec["watched"] = {
        "tensors": len(watch.tensors),
        "submodules": len(watch.edges),
        "values": len(watch.values),
    }
    with torch.inference_mode():
        step = lambda: served(*args, **kwargs)  # noqa: E731
        for _ in range(20):  # a CPU package's first calls run while its thread pool spins up
            step()
        rec["step_ms"] = _step_ms(step, cuda)
        rec["check_us"] = _median_us(watch.moved)
        rec["fit_us"] = _median_us(lambda: fit(art.contract, args, kwargs))
        with_watch, without = [], []
        for _ in range(rounds):
            with_watch.append(_step_ms(step, cuda, warm=1))
            watch.moved = _unmoved  # type: ignore[method-assign]  # the path before the guard
            without.append(_step_ms(step, cuda, warm=1))
            del watch.moved
        rec["side_by_side"] = {
            "rounds": rounds,
            "with_check_ms": round(statistics.median(with_watch), 4),
            "without_check_ms": round(statistics.median(without), 4),
        }
        restrided: dict[str, Any] = {}
        names = [i.name for i in art.contract.inputs]
        flat = list(args) + [kwargs[n] for n in names[len(args) :]]
        for name, value in zip(names, flat, strict=True):
            if not isinstance(value, torch.Tensor) or (other := _other_strides(value)) is None:
                continue
            assert torch.equal(other, value)
            call = list(flat)
            call[names.index(name)] = other
            pos, kw = tuple(call[: len(args)]), dict(zip(names[len(args) :], call[len(args) :], strict=True))
            before = served.counters["restrided"]
            ms = _step_ms(lambda pos=pos, kw=kw: served(*pos, **kw), cuda)
            assert served.counters["restrided"] > before
            restrided[name] = {"shape": list(value.shape), "stride": list(other.stride()), "step_ms": ms}
        rec["restrided"] = restrided
    rec["check_share_of_step"] = round(rec["check_us"] / 1e3 / rec["step_ms"], 5)
    rec["counters"] = dict(served.counters)
    assert served.counters.get("rebound", 0) == 0 and not any(k.startswith("eager") for k in served.counters)
    return rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ws", type=Path)
    p.add_argument("label")
    p.add_argument("out_json", type=Path)
    p.add_argument("--store-archive", type=Path)
    p.add_argument("--plan", type=Path)
    p.add_argument("--no-lanes", action="store_true", help="drop the copy's lanes (a banked plain key)")
    p.add_argument("--rounds", type=int, default=5)
    commit_option(p)
    a = p.parse_args()
    if (a.store_archive is None) != (a.plan is None) or (a.no_lanes and a.store_archive is None):
        p.error("--store-archive and --plan go together, and --no-lanes needs them")
    ws = a.ws
    if a.store_archive is not None:  # a copy beside the archive's store, never the checkout itself
        ws = Path(tempfile.mkdtemp(prefix="bind-check-")) / "ws"
        shutil.copytree(a.ws, ws, ignore=shutil.ignore_patterns(".cgbuild", "__pycache__"))
    if a.no_lanes:
        drop_lanes(ws / "Cgfile")
    sys.path.insert(0, str(ws))
    artifact = _artifact(ws, a.label, a.store_archive, a.plan)
    numbers = {
        "load_before": load_average(),
        "result": measure(ws, a.label, artifact, a.rounds),
        "load_after": load_average(),
    }
    write_result(a.out_json, "bind_check", numbers, packages=("diffusers",), commit=a.commit)
    print(json.dumps(numbers["result"], indent=1))


if __name__ == "__main__":
    main()
