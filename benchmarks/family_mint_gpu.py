"""A family mint: flux2-klein's bf16 and fp8 targets at 768² and 1024² (four keys) in ONE
`cgbuild mint` on one GPU, keys minted in parallel (`-j`), each traced by the worker that
compiles it (one trace per mint), all sharing the machine's fixed compile sandbox.

    python benchmarks/family_mint_gpu.py WORK OUT_JSON [--jobs 4] [--lanes] [--commit SHA]

The workspace is a copy of examples/flux2_klein with the family's layouts cut to bf16 and fp8
(its int8 targets are not part of this measurement) and, unless `--lanes`, its lane tables
dropped (the plain programs, as `gpu_vs_compile.py --no-lanes` mints them). Records the whole
command's wall time, each key's phases from the summary, whether each key's trace was its own
worker's, and the machine, versions, date and commit. `--selector LABEL` mints one of the four alone
(each single in a cold sandbox: empty it first), for the sum the family is compared with.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness import commit_option, write_result
from targets import drop_lanes

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "flux2_klein"
SELECTOR = "//flux2-klein:sm_90"


def main(
    work: Path, out_json: Path, jobs: int, lanes: bool, selector: str = SELECTOR, commit: str | None = None
) -> dict[str, Any]:
    ws = work / "ws"
    shutil.rmtree(ws, ignore_errors=True)
    shutil.copytree(EXAMPLE, ws, ignore=shutil.ignore_patterns(".cgbuild", "__pycache__"))
    cgfile = ws / "Cgfile"
    text = cgfile.read_text()
    assert 'layouts = ["bf16", "int8", "fp8"]' in text
    cgfile.write_text(text.replace('layouts = ["bf16", "int8", "fp8"]', 'layouts = ["bf16", "fp8"]', 1))
    if not lanes:
        drop_lanes(cgfile)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "cgbuild.cli", "-C", str(ws), "mint", selector, "--json", "-j", str(jobs)],
        capture_output=True,
        text=True,
    )
    wall = round(time.perf_counter() - t0, 2)
    lines = proc.stdout.strip().splitlines()
    summary = json.loads(lines[-1]) if lines else None
    records = [json.loads(p.read_text()) for p in sorted((ws / ".cgbuild" / "mint").glob("*.json"))]
    numbers: dict[str, Any] = {
        "selector": selector,
        "layouts": ["bf16", "fp8"],
        "lanes": lanes,
        "jobs": jobs,
        "rc": proc.returncode,
        "wall_s": wall,
        "keys": [
            {"labels": r["labels"], "traced_here": r.get("traced_here"), "phases": r["result"].get("phases")}
            for r in records
        ],
        "summary": summary,
        "progress": [ln for ln in proc.stderr.splitlines() if ln.startswith("mint ")][-40:],
    }
    if proc.returncode:
        numbers["stderr_tail"] = proc.stderr[-3000:]
    doc = write_result(out_json, "family_mint_gpu", numbers, torch=True, commit=commit)
    print(json.dumps({k: doc[k] for k in ("rc", "wall_s", "keys")}, indent=1))
    return doc


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("work", type=Path)
    p.add_argument("out_json", type=Path)
    p.add_argument("--jobs", type=int, default=4)
    p.add_argument("--lanes", action="store_true")
    p.add_argument("--selector", default=SELECTOR, help="one label: that key's single mint, for the sum")
    commit_option(p)
    a = p.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    main(a.work, a.out_json, a.jobs, a.lanes, a.selector, a.commit)
