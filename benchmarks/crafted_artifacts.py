"""Count the crafted-artifact cases the tests try, and their outcomes, into a committed result.

The cases live in the tests (one real mint forged into hostile artifacts against the real
loader, and the seal's own archive checks): tests/rules/test_hostile_artifacts.py and
tests/store/test_seal.py. This runs exactly those files with pytest and records every test item
(parametrized cases apart), its outcome and its duration, so docs/reliability.md can cite
counts that a run produced rather than a count by hand.

Writes benchmarks/results/crafted_artifacts.json.

    python benchmarks/crafted_artifacts.py [--out OUT_JSON]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from harness import REPO, write_result

OUT = REPO / "benchmarks" / "results" / "crafted_artifacts.json"
FILES = ("tests/rules/test_hostile_artifacts.py", "tests/store/test_seal.py")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="cgbuild-crafted-") as tmp:
        junit = Path(tmp) / "junit.xml"
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *FILES],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        cases = []
        for case in ET.parse(junit).getroot().iter("testcase"):
            outcome = "passed"
            for tag in ("failure", "error", "skipped"):
                if case.find(tag) is not None:
                    outcome = {"failure": "failed"}.get(tag, tag)
            cases.append(
                {
                    "file": case.get("classname", "").replace(".", "/") + ".py",
                    "case": case.get("name"),
                    "outcome": outcome,
                    "seconds": round(float(case.get("time") or 0), 2),
                }
            )
    numbers = {
        "what": "every crafted-artifact test case (forged archives, packages, metadata, literals) "
        "against the real seal checks and the real AOTI loader through adopt and inspect",
        "files": list(FILES),
        "pytest_exit": proc.returncode,
        "counts": dict(Counter(c["outcome"] for c in cases)) | {"cases": len(cases)},
        "cases": cases,
    }
    write_result(args.out, "crafted_artifacts", numbers, packages=("cgbuild",))
    print(json.dumps(numbers["counts"]))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
