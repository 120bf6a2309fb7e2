"""Declared ranges, engine side: `frames = {min = 2, max = 4}` (and the same for text lengths and
batches) read with file, line and field on every refusal, named by one graph class, stated by
its facet and its job, and read back from a manifest and sealed metadata (with the pipeline's
`pixel_frames` beside a video module's frames)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.cgfiles import VIDEO_MODULE, error_of, write

from cgbuild.config import cgfile
from cgbuild.config.dims import Range
from cgbuild.config.targets import expand
from cgbuild.protocol import manifest
from cgbuild.protocol.trace import BadJob, TraceJob, job_for
from cgbuild.store.metadata import metadata_problem

BASE = VIDEO_MODULE
LINE = BASE.count("\n") + 1
"""The line a dimension appended to BASE is declared on."""


def _classes(tmp_path: Path, dims: str) -> dict[str, Any]:
    """Graph class name → (its facet, its job's spec) of the module with `dims` appended."""
    cg = cgfile.load(write(tmp_path, BASE + dims))
    return {t.graph_class.name: (t.facet, job_for(cg, t).spec) for t in expand(cg)}


def test_a_range_is_one_class_named_by_its_ends_traced_inside() -> None:
    assert (Range(2, 4).traced, Range(2, 4).points) == (3, (2, 3, 4))
    assert (Range(5, 81).traced, Range(5, 81).points) == (43, (5, 43, 81))
    assert (Range(1, 3).traced, Range(1, 3).points) == (2, (1, 2, 3))
    assert (Range(1, 2).traced, Range(1, 2).points) == (2, (1, 2))  # never traced at 1: specialized
    assert (Range(2, 3).traced, Range(2, 3).points) == (2, (2, 3))  # no size between the ends


def test_frames_text_and_batch_ranges_name_the_class_and_fill_facet_and_job(tmp_path: Path) -> None:
    dims = "frames = { min = 2, max = 4 }\ntext_lengths = { min = 8, max = 64 }\nbatch_sizes = [1, 2]\n"
    classes = _classes(tmp_path, dims)
    assert set(classes) == {"8x8-f2..4-t8..64-b1", "8x8-f2..4-t8..64-b2"}
    facet, spec = classes["8x8-f2..4-t8..64-b2"]
    assert facet == {
        "shape": "8x8",
        "frames": {"min": 2, "max": 4},
        "text_len": {"min": 8, "max": 64},
        "batch": 2,
        "guidance": [],
    }
    assert (spec["frames"], spec["text_len"], spec["batch"]) == (3, 36, 2)
    assert spec["ranges"] == {"frames": {"min": 2, "max": 4}, "text_len": {"min": 8, "max": 64}}
    (name,) = _classes(tmp_path, "batch_sizes = { min = 1, max = 4 }\n")
    assert name == "8x8-b1..4"


def test_a_module_without_a_range_keeps_its_name_facet_and_job(tmp_path: Path) -> None:
    classes = _classes(tmp_path, "frames = [9]\ntext_lengths = [16]\n")
    facet, spec = classes["8x8-f9-t16-b1"]
    assert facet == {"shape": "8x8", "frames": 9, "text_len": 16, "batch": 1, "guidance": []}
    assert "ranges" not in spec  # the job (a trace input) is what it was
    _, image = _classes(tmp_path, "")["8x8-b1"]
    assert "ranges" not in image and "frames" not in image


@pytest.mark.parametrize(
    ("dims", "field", "message"),
    [
        ("frames = { min = 5, max = 2 }", "frames", "min 5 > max 2"),
        ("batch_sizes = { min = 4, max = 4 }", "batch_sizes", "a range of one value (4): declare it as"),
        ("frames = { min = 0, max = 4 }", "frames.min", "must be positive"),
        ("text_lengths = { min = -8, max = 4 }", "text_lengths.min", "must be positive"),
        ("frames = { min = 2, max = 99999999 }", "frames.max", "at most"),
        ("frames = { min = 2.5, max = 4 }", "frames.min", "expected an integer, got float"),
        ('frames = { min = "2", max = 4 }', "frames.min", "expected an integer, got string"),
        ("batch_sizes = { min = true, max = 4 }", "batch_sizes.min", "expected an integer, got boolean"),
        ("frames = { min = 2 }", "frames.max", "missing required key 'max'"),
        ("frames = { min = 2, max = 4, step = 1 }", "frames.step", "unknown key 'step'"),
        ("frames = [2, { min = 3, max = 4 }]", "frames", "an array of values or one range"),
        ("frames = 3", "frames", "expected an array of the module's input frame counts or a range"),
        ("frames = [0]", "frames", "must be positive"),
        ("frames = [2, 2]", "frames", "duplicate value"),
        ("batch_sizes = []", "batch_sizes", "declares no values"),
    ],
)
def test_a_bad_dimension_is_refused_with_file_line_and_field(
    tmp_path: Path, dims: str, field: str, message: str
) -> None:
    err = error_of(tmp_path, BASE + dims + "\n")
    assert message in err.message
    assert (err.file, err.line, err.field) == (str(tmp_path / "Cgfile"), LINE, f"family.v.module.wan.{field}")


def test_a_dimension_given_twice_is_a_syntax_error_on_its_line(tmp_path: Path) -> None:
    err = error_of(tmp_path, BASE + "frames = [2, 3]\nframes = { min = 2, max = 4 }\n")
    assert "TOML syntax error" in err.message and err.line == LINE + 1


def _job(spec: dict[str, Any]) -> dict[str, Any]:
    base = {"family": "v", "module": "wan", "graph_class": "c", "height": 8, "width": 8, "text_len": None}
    return {
        "id": "j",
        "entry": "m:build",
        "root": ".",
        "quant": "plain.fp32",
        "spec": {**base, "batch": 1, "dtype": "float32", "device": "cpu", **spec},
    }


@pytest.mark.parametrize(
    "spec",
    [
        {"frames": 3, "ranges": []},
        {"frames": 3, "ranges": {"width": {"min": 2, "max": 4}}},
        {"frames": 3, "ranges": {"frames": {"min": 4, "max": 2}}},
        {"frames": 3, "ranges": {"frames": {"min": True, "max": 4}}},
        {"frames": 3, "ranges": {"frames": {"min": 2, "max": 4, "step": 1}}},
        {"frames": 9, "ranges": {"frames": {"min": 2, "max": 4}}},
        {"ranges": {"text_len": {"min": 2, "max": 4}}},
    ],
)
def test_a_jobs_ranges_are_checked(spec: dict[str, Any]) -> None:
    """A job is input another process wrote: its ranges must be ranges its sizes lie in."""
    with pytest.raises(BadJob, match=r"spec\.(ranges|frames|text_len)"):
        TraceJob.from_json(_job(spec))
    ok = TraceJob.from_json(_job({"frames": 3, "ranges": {"frames": {"min": 2, "max": 4}}}))
    assert ok.spec["ranges"] == {"frames": {"min": 2, "max": 4}}


def _manifest(envelope: dict[str, Any]) -> dict[str, Any]:
    entry = {"graph_class": "c", "layout": "fp32", "sm": "cpu", "key": "k", "stamp": "s"}
    entry |= {"compiled_only": False, "envelope": envelope}
    return {
        "schema": manifest.SCHEMA,
        "family": "v",
        "modules": {"wan": {"serves": "wan", "entries": [entry]}},
    }


SEALED = {
    "key": "k",
    "kind": "aot-inductor",
    "sm": "cpu",
    "torch": "2",
    "graph": {"digest": "d", "contract": {}},
    "toolchain": {"fold": "f"},
}
"""Sealed metadata with the fields every artifact has: a test adds the facets it checks."""


def test_a_manifest_and_sealed_metadata_carry_a_range_and_refuse_a_broken_one() -> None:
    facet = {"shape": "8x8", "frames": {"min": 2, "max": 4}, "text_len": 4, "batch": 1, "guidance": []}
    (entry,) = manifest.read(_manifest(facet))["wan"]
    assert entry.envelope == facet
    meta = SEALED | {"facets": [facet]}
    assert metadata_problem(meta) is None
    for broken in ({"min": 4, "max": 2}, {"min": 2}, {"min": 2, "max": 4.0}):
        with pytest.raises(manifest.BadManifest, match=r"envelope\.frames"):
            manifest.read(_manifest({**facet, "frames": broken}))
        problem = metadata_problem({**meta, "facets": [{**facet, "frames": broken}]})
        assert problem is not None and problem.startswith("facets[0].frames")


def test_the_manifest_and_sealed_facets_carry_the_pipeline_count_only_beside_frames() -> None:
    facet = {"shape": "8x8", "frames": 2, "pixel_frames": 5, "text_len": None, "batch": 1, "guidance": []}
    ranged = facet | {"frames": {"min": 2, "max": 4}, "pixel_frames": {"min": 5, "max": 13}}
    meta = SEALED
    for good in (facet, ranged):
        (entry,) = manifest.read(_manifest(good))["wan"]
        assert entry.envelope == good
        assert metadata_problem(meta | {"facets": [good]}) is None
    alone = {k: v for k, v in facet.items() if k != "frames"}
    for bad in (alone, facet | {"pixel_frames": "5"}, facet | {"pixel_frames": {"min": 5}}):
        with pytest.raises(manifest.BadManifest, match="pixel_frames"):
            manifest.read(_manifest(bad))
    problem = metadata_problem(meta | {"facets": [facet | {"pixel_frames": {"min": 5}}]})
    assert problem is not None and problem.startswith("facets[0].pixel_frames")
