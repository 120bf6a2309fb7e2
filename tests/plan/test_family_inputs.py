"""A family's trace inputs are read once: the files its digest hashes are the files the plan memo
stats and the snapshot a later plan names moves from."""

from __future__ import annotations

import shutil
from pathlib import Path

from cgbuild.config import cgfile
from cgbuild.plan.inputs import SourceHasher, family_files
from cgbuild.plan.memo import input_stamps

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_digest_the_snapshot_and_the_memo_read_one_file_list(tmp_path: Path) -> None:
    ws = tmp_path / "toy"
    shutil.copytree(
        EXAMPLES / "toy", ws, ignore=shutil.ignore_patterns(".cgbuild", "__pycache__", "reference")
    )
    (ws / "helpers.py").write_text("X = 1\n")  # matched by the family's `*.py` sources only
    cg = cgfile.load(ws / "Cgfile")
    fam = cg.families["toy"]
    inputs = SourceHasher(tmp_path / "cache.json").family_inputs(cg, fam)
    files = family_files(cg, fam)
    assert (
        set(inputs.files) == {p.relative_to(ws).as_posix() for p in files} >= {"helpers.py", "toy_models.py"}
    )
    assert inputs.snapshot["files"] == inputs.files and inputs.snapshot["config"] == fam.config
    assert {str(p) for p in files} <= set(input_stamps(cg, None))
    # a moved file moves the digest and is named by the snapshot
    (ws / "helpers.py").write_text("X = 2\n")
    moved = SourceHasher(tmp_path / "cache.json").family_inputs(cg, fam)
    assert moved.digest != inputs.digest and moved.id != inputs.id
    assert [f for f in moved.files if moved.files[f] != inputs.files[f]] == ["helpers.py"]
