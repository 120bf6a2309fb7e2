"""Lane axes a quant rule owns: declared per family, carried only by targets of that rule's layouts."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from support.cgfiles import KLEIN_ENTRY, KLEIN_LANES, error_of, klein, write

from cgbuild.config import cgfile
from cgbuild.config.targets import Target, expand
from cgbuild.exec.mint import _lanes_request
from cgbuild.protocol.trace import job_for, target_lanes

ENTRY_PLAIN = "def build(spec):\n    return None\n"

TRITON = {"triton": {"version": "3.6.0"}}


def cgfile_text(lanes: str, layouts: str = '["bf16", "fp8"]') -> str:
    """klein with both layouts declared, `layouts` of them served, and these lane axes."""
    return klein(lanes, served=layouts)


def line_of(text: str, start: str) -> int:
    return next(n for n, line in enumerate(text.splitlines(), 1) if line.startswith(start))


def load(tmp_path: Path, lanes: str, entry: str = KLEIN_ENTRY) -> cgfile.Cgfile:
    (tmp_path / "klein_entry.py").write_text(entry)
    return cgfile.load(write(tmp_path, cgfile_text(lanes)))


def targets_by_layout(cg: cgfile.Cgfile) -> dict[str, Target]:
    found = {t.id.layout: t for t in expand(cg)}
    assert {t.id.sm for t in found.values()} == {"sm_90"}
    return found


def test_a_rule_axis_loads_beside_the_entrys_and_is_owned_by_its_rule(tmp_path: Path) -> None:
    fam = load(tmp_path, KLEIN_LANES).families["klein"]
    assert fam.lanes == (("attention", ("flash", "math")), ("fp8-gemm", ("scaled-mm", "triton")))
    assert fam.lane_rules == {"fp8-gemm": "fp8-rowwise"}
    assert fam.lane_table["fp8-gemm"]["scaled-mm"].to_json() == {}
    assert fam.lane_table["fp8-gemm"]["triton"].to_json() == {"device": "cuda", "triton": True, "min_sm": 89}
    assert fam.lanes_for("fp8-rowwise") == fam.lanes
    assert fam.lanes_for("plain.bf16") == (("attention", ("flash", "math")),)


def test_a_rule_axis_of_a_rule_no_layout_uses_is_refused_naming_the_rule(tmp_path: Path) -> None:
    (tmp_path / "klein_entry.py").write_text(KLEIN_ENTRY)
    text = cgfile_text(KLEIN_LANES, layouts='["bf16"]')
    err = error_of(tmp_path, text)
    assert (err.line, err.field) == (line_of(text, "fp8-gemm"), "family.klein.lanes.fp8-gemm"), str(err)
    assert err.file == str(tmp_path / "Cgfile")
    assert "unknown lane axis 'fp8-gemm'" in err.message
    assert "belongs to quant rule 'fp8-rowwise', which no layout of this family uses" in err.message


def test_an_unused_rules_axis_names_the_rule_when_the_entry_has_no_lanes_table(tmp_path: Path) -> None:
    (tmp_path / "klein_entry.py").write_text(ENTRY_PLAIN)
    err = error_of(tmp_path, cgfile_text('fp8-gemm = ["scaled-mm"]\n', layouts='["bf16"]'))
    assert err.field == "family.klein.lanes.fp8-gemm", str(err)
    assert "belongs to quant rule 'fp8-rowwise', which no layout of this family uses" in err.message


def test_an_unknown_value_of_a_rule_axis_names_the_rule_as_provider(tmp_path: Path) -> None:
    (tmp_path / "klein_entry.py").write_text(KLEIN_ENTRY)
    text = cgfile_text('fp8-gemm = ["scaled-mm", "cutlass"]\n')
    err = error_of(tmp_path, text)
    assert (err.line, err.field) == (line_of(text, "fp8-gemm"), "family.klein.lanes.fp8-gemm"), str(err)
    assert (
        "unknown lane value 'cutlass' for axis 'fp8-gemm' (quant rule 'fp8-rowwise' provides: "
        "scaled-mm, triton)" in err.message
    )


def test_a_rule_axis_whose_values_all_need_something_is_refused(tmp_path: Path) -> None:
    (tmp_path / "klein_entry.py").write_text(ENTRY_PLAIN)
    err = error_of(tmp_path, cgfile_text('fp8-gemm = ["triton"]\n'))
    assert err.field == "family.klein.lanes.fp8-gemm", str(err)
    assert "no value that builds everywhere" in err.message


@pytest.mark.parametrize("entry", [ENTRY_PLAIN, None], ids=["no-LANES", "no-entry-file"])
def test_only_rule_axes_need_no_entry_lanes_table(tmp_path: Path, entry: str | None) -> None:
    if entry is not None:
        (tmp_path / "klein_entry.py").write_text(entry)
    fam = cgfile.load(write(tmp_path, cgfile_text('fp8-gemm = ["scaled-mm", "triton"]\n'))).families["klein"]
    assert fam.lanes == (("fp8-gemm", ("scaled-mm", "triton")),)
    assert fam.lane_rules == {"fp8-gemm": "fp8-rowwise"}
    assert fam.lanes_for("plain.bf16") == ()


def test_an_entry_axis_beside_a_rule_axis_still_needs_the_entrys_table(tmp_path: Path) -> None:
    (tmp_path / "klein_entry.py").write_text(ENTRY_PLAIN)
    err = error_of(tmp_path, cgfile_text(KLEIN_LANES))
    assert err.field == "family.klein.lanes", str(err)
    assert "entry 'klein_entry:build' declares no LANES table" in err.message


def test_an_entry_axis_named_like_a_rule_axis_is_refused_at_the_entry(tmp_path: Path) -> None:
    """Whether or not a layout of the family uses the rule yet: adding one later must not turn
    the entry's axis into the rule's."""
    (tmp_path / "klein_entry.py").write_text('LANES = {"fp8-gemm": {"scaled-mm": {}, "mine": {}}}\n')
    for layouts in ('["bf16", "fp8"]', '["bf16"]'):
        err = error_of(tmp_path, cgfile_text('fp8-gemm = ["scaled-mm"]\n', layouts=layouts))
        assert (err.file, err.line, err.field) == (str(tmp_path / "klein_entry.py"), 1, "LANES"), str(err)
        assert "'fp8-gemm' is a quant rule's lane axis; rename the entry's" in err.message


def test_the_fp8_target_carries_the_rule_axis_with_triton_only_when_its_toolchain_has_it(
    tmp_path: Path,
) -> None:
    cg = load(tmp_path, KLEIN_LANES)
    fp8 = targets_by_layout(cg)["fp8"]
    assert job_for(cg, fp8, TRITON).spec["lanes"] == {
        "attention": ["flash", "math"],
        "fp8-gemm": ["scaled-mm", "triton"],
    }
    assert job_for(cg, fp8, {}).spec["lanes"] == {"attention": ["flash", "math"], "fp8-gemm": ["scaled-mm"]}
    assert target_lanes(fp8, "fp8-rowwise", {"triton": {"absent": True}}) == {
        "attention": ["flash", "math"],
        "fp8-gemm": ["scaled-mm"],
    }


def test_the_bf16_target_carries_the_entry_axis_but_not_the_rule_axis(tmp_path: Path) -> None:
    cg = load(tmp_path, KLEIN_LANES)
    bf16 = targets_by_layout(cg)["bf16"]
    assert job_for(cg, bf16, TRITON).spec["lanes"] == {"attention": ["flash", "math"]}
    assert target_lanes(bf16, "plain.bf16", TRITON) == {"attention": ["flash", "math"]}


def test_with_only_a_rule_axis_the_bf16_target_has_no_lanes_at_all(tmp_path: Path) -> None:
    cg = load(tmp_path, 'fp8-gemm = ["scaled-mm", "triton"]\n', entry=ENTRY_PLAIN)
    by_layout = targets_by_layout(cg)
    assert "lanes" not in job_for(cg, by_layout["bf16"], TRITON).spec
    assert target_lanes(by_layout["bf16"], "plain.bf16", TRITON) is None
    assert job_for(cg, by_layout["fp8"], TRITON).spec["lanes"] == {"fp8-gemm": ["scaled-mm", "triton"]}


def test_the_mint_request_carries_only_the_axes_of_the_targets_layout(tmp_path: Path) -> None:
    cg = load(tmp_path, KLEIN_LANES)
    by_layout = targets_by_layout(cg)
    ws = SimpleNamespace(cg=cg)

    def request(layout: str) -> dict | None:
        mk = SimpleNamespace(target=by_layout[layout], entries=[SimpleNamespace(skus=["h200"])])
        return _lanes_request(ws, mk)  # type: ignore[arg-type]

    fp8 = request("fp8")
    assert fp8 is not None
    assert fp8["axes"] == [["attention", ["flash", "math"]], ["fp8-gemm", ["scaled-mm", "triton"]]]
    assert fp8["needs"]["fp8-gemm"]["triton"] == {"device": "cuda", "triton": True, "min_sm": 89}
    bf16 = request("bf16")
    assert bf16 is not None
    assert bf16["axes"] == [["attention", ["flash", "math"]]]
    assert set(bf16["needs"]) == {"attention"}
    assert bf16["sku"] == {"name": "h200", "memory_bytes": 141 << 30}
