"""Pixel frames: a module of an entry that states its pixel -> latent frame rule (`PIXEL_FRAMES`)
declares the pipeline's count or its own and gets the same targets and jobs (hence keys), with
the pipeline's count in every facet; each way of getting it wrong is refused with file, line
and field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.cgfiles import VIDEO_MODULE, error_of, write

from cgbuild.config import cgfile
from cgbuild.config.targets import expand
from cgbuild.core.errors import UserError
from cgbuild.protocol.trace import job_for

BASE = VIDEO_MODULE
RULE = 'PIXEL_FRAMES = {"wan": 4}\n'


def _entry(tmp_path: Path, source: str) -> None:
    (tmp_path / "m.py").write_text("def build(spec):\n    raise NotImplementedError\n\n" + source)


def _classes(tmp_path: Path, dims: str, source: str = RULE) -> dict[str, tuple[Any, Any]]:
    """Graph class name → (facet, job spec) of the module with `dims` under an entry of `source`."""
    _entry(tmp_path, source)
    cg = cgfile.load(write(tmp_path, BASE + dims))
    return {t.graph_class.name: (t.facet, job_for(cg, t).spec) for t in expand(cg)}


@pytest.mark.parametrize(
    ("pixel", "own", "names", "shown"),
    [
        ("[5, 9]", "[2, 3]", ["8x8-f2-b1", "8x8-f3-b1"], [5, 9]),
        ("{ min = 5, max = 13 }", "{ min = 2, max = 4 }", ["8x8-f2..4-b1"], [{"min": 5, "max": 13}]),
    ],
)
def test_either_count_gives_the_same_classes_and_jobs_and_shows_both(
    tmp_path: Path, pixel: str, own: str, names: list[str], shown: list[Any]
) -> None:
    by_pixel = _classes(tmp_path, f"pixel_frames = {pixel}\n")
    by_own = _classes(tmp_path, f"frames = {own}\n")
    assert sorted(by_pixel) == sorted(by_own) == names
    for name, want in zip(names, shown, strict=True):
        assert by_pixel[name] == by_own[name]  # facet and job: what a trace and a key read
        assert by_pixel[name][0]["pixel_frames"] == want
        assert "pixel_frames" not in by_pixel[name][1]  # the job (a trace input) holds no pixel count


def test_the_rule_is_no_identity_of_a_module_that_declares_its_own_frames(tmp_path: Path) -> None:
    """Another factor says another pipeline count, but the module's frames, hence its job (what
    its trace and key read), stay."""
    (four, job4), (eight, job8) = (
        _classes(tmp_path, "frames = [3]\n", f'PIXEL_FRAMES = {{"wan": {f}}}\n')["8x8-f3-b1"] for f in (4, 8)
    )
    assert job4 == job8 and (four["pixel_frames"], eight["pixel_frames"]) == (9, 17)


def test_without_a_rule_the_facet_is_what_it_was(tmp_path: Path) -> None:
    (facet, _) = _classes(tmp_path, "frames = [2]\n", source="")["8x8-f2-b1"]
    assert facet == {"shape": "8x8", "frames": 2, "text_len": None, "batch": 1, "guidance": []}
    (image, _) = _classes(tmp_path, "")["8x8-b1"]  # a rule for a module that takes no frames
    assert "pixel_frames" not in image and "frames" not in image


@pytest.mark.parametrize(
    ("dims", "source", "needle"),
    [
        ("frames = [2]\npixel_frames = [5]\n", RULE, "not both"),
        ("pixel_frames = [5]\n", "", "PIXEL_FRAMES = {'wan'"),
        ("pixel_frames = [5]\n", 'PIXEL_FRAMES = {"other": 4}\n', "needs the entry to state"),
        ("pixel_frames = [5, 7]\n", RULE, "7 pixel frames is no 4k + 1 count"),
        ("pixel_frames = { min = 5, max = 12 }\n", RULE, "declare 9 or 13"),
        ("pixel_frames = [5, 5]\n", RULE, "duplicate value in 'pixel_frames'"),
        ("pixel_frames = [0]\n", RULE, "pixel_frames"),
        ("pixel_frames = { min = 9, max = 5 }\n", RULE, "min 9 > max 5"),
    ],
)
def test_a_bad_pixel_frames_declaration_is_refused_at_its_line(
    tmp_path: Path, dims: str, source: str, needle: str
) -> None:
    _entry(tmp_path, source)
    err = error_of(tmp_path, BASE + dims)
    assert needle in str(err), str(err)
    assert err.line == BASE.count("\n") + dims.count("\n") and "pixel_frames" in (err.field or "")


@pytest.mark.parametrize(
    "rule",
    [
        "PIXEL_FRAMES = {}",
        "PIXEL_FRAMES = [4]",
        'PIXEL_FRAMES = {"wan": 0}',
        'PIXEL_FRAMES = {"wan": "4"}',
        'PIXEL_FRAMES = {"wan": True}',
        'PIXEL_FRAMES = {"wan": 4.0}',
        'PIXEL_FRAMES = {"Wan Video": 4}',
        "PIXEL_FRAMES = {'wan': FACTOR}",
    ],
)
def test_a_bad_rule_is_refused_naming_the_entry_and_its_line(tmp_path: Path, rule: str) -> None:
    _entry(tmp_path, "\n" + rule + "\n")
    with pytest.raises(UserError) as info:
        cgfile.load(write(tmp_path, BASE + "frames = [2]\n"))
    assert info.value.file is not None and info.value.file.endswith("m.py")
    assert info.value.line == 5 and info.value.field == "PIXEL_FRAMES"
