"""Labels and selectors: canonical form, composition, and errors for unknown parts."""

from __future__ import annotations

from pathlib import Path

import pytest

from cgbuild.config import cgfile
from cgbuild.config.labels import parse_label, parse_selector
from cgbuild.config.targets import expand, select
from cgbuild.core.errors import UserError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def klein() -> cgfile.Cgfile:
    return cgfile.load(EXAMPLES / "flux2_klein" / "Cgfile")


def labels(cg: cgfile.Cgfile, text: str) -> list[str]:
    return [t.label for t in select(cg, expand(cg), parse_selector(text))]


def test_canonical_label_round_trip() -> None:
    text = "//flux2-klein/transformer/1024x1024-t512-b1@bf16:sm_90"
    assert parse_label(text).label == text


def test_graph_class_names(klein: cgfile.Cgfile) -> None:
    assert "//flux2-klein/transformer/1024x1024-t512-b1@bf16:sm_90" in labels(klein, "//...")


@pytest.mark.parametrize(
    ("selector", "count"),
    [
        ("//...", 24),
        ("//flux2-klein", 12),
        ("//flux2-klein/transformer", 12),
        ("//flux2-klein:sm_120", 6),
        (":rtx5090", 6),
        (":sm_90", 12),
        (":cpu", 6),
        ("@bf16", 4),
        ("@int8", 10),
        ("@fp8", 4),
        ("//flux2-klein-tiny@fp32:cpu", 3),
        ("//flux2-klein-tiny/transformer/64x48-t8-b1", 4),
    ],
)
def test_selectors_compose(klein: cgfile.Cgfile, selector: str, count: int) -> None:
    assert len(labels(klein, selector)) == count


def test_sku_selector_means_targets_serving_that_sku(klein: cgfile.Cgfile) -> None:
    assert all(label.endswith(":sm_120") for label in labels(klein, ":rtx5090"))


@pytest.mark.parametrize(
    "bad",
    [
        "flux2-klein",
        "//Flux",
        "//a/b/c/d",
        "@",
        "//x@y:z:w",
        "",
        # whitespace and control characters are never part of a label, not even a final newline
        "//flux2-klein\n",
        " //flux2-klein",
        "//flux2 klein",
        ":cpu\n",
        "@bf16\t",
        "//a/b/c@d:cpu\x00",
    ],
)
def test_bad_selectors(bad: str) -> None:
    with pytest.raises(UserError):
        parse_selector(bad)


@pytest.mark.parametrize("unknown", ["//nope", "@fp4", ":sm_75", ":a100"])
def test_unknown_parts_are_errors_not_empty_sets(klein: cgfile.Cgfile, unknown: str) -> None:
    with pytest.raises(UserError):
        labels(klein, unknown)


def test_selector_is_not_a_label() -> None:
    with pytest.raises(UserError, match="selector, not a canonical label"):
        parse_label("//flux2-klein:sm_90")
