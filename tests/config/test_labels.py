"""Labels and selectors: canonical form, composition, and errors for unknown parts."""

from __future__ import annotations

from pathlib import Path

import pytest

from cgbuild.config import cgfile
from cgbuild.config.labels import parse_label, parse_selector
from cgbuild.config.targets import expand, select
from cgbuild.core.errors import UserError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


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
        ("//...", 28),
        ("//flux2-klein", 16),
        ("//flux2-klein/transformer", 12),
        ("//flux2-klein/vae.decode", 4),  # bf16 only, at both shapes, on sm_90 and sm_120
        ("//flux2-klein:sm_120", 8),
        (":rtx5090", 8),
        (":sm_90", 14),
        (":cpu", 6),
        ("@bf16", 8),
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


@pytest.mark.parametrize(
    ("selector", "names"),
    [
        # parts that exist, but never together
        ("//flux2-klein-tiny@bf16", "//flux2-klein-tiny has no layout 'bf16'; its layouts: fp32, int8"),
        ("//flux2-klein:cpu", "//flux2-klein has no sm 'cpu'; its sms: sm_120, sm_90"),
        ("//flux2-klein@fp8:rtx-pro-6000", None),  # exists: selects
        ("//flux2-klein-tiny:rtx5090", "//flux2-klein-tiny has no SKU 'rtx5090'"),
        # typos: the closest existing value is named
        ("//flux2-klein/transformers/...", "no module 'transformers' (did you mean 'transformer'?)"),
        (
            "//flux2-klein/transformer/1024x1024",
            "no graph class '1024x1024' (did you mean '1024x1024-t512-b1'?",
        ),
        ("//flux2-klien", "no family 'flux2-klien' in the Cgfile (did you mean 'flux2-klein'"),
        ("@int9", "no layout 'int9' in the Cgfile (did you mean 'int8'?)"),
        (":sm_91", "(did you mean 'sm_90' or 'sm_120'?)"),
    ],
)
def test_a_selector_that_names_nothing_names_the_closest(
    klein: cgfile.Cgfile, selector: str, names: str | None
) -> None:
    if names is None:
        assert labels(klein, selector)
        return
    with pytest.raises(UserError) as err:
        labels(klein, selector)
    assert names in str(err.value) and err.value.exit_code == 2


def test_every_selecting_command_refuses_a_selector_that_names_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cgbuild.cli.main import main

    (tmp_path / "Cgfile").write_text((EXAMPLES / "flux2_klein" / "Cgfile").read_text())
    (tmp_path / "flux2_entry.py").write_text((EXAMPLES / "flux2_klein" / "flux2_entry.py").read_text())
    typo = "//flux2-klein-tiny/transformer/64x48"
    for argv in (
        ["plan", typo],
        ["mint", typo],
        ["query", typo],
        ["verify", typo],
        ["why", typo + "-t8-b2@fp32:cpu"],
        ["inspect", typo + "-t8-b2@fp32:cpu"],
    ):
        assert main(["-C", str(tmp_path), *argv]) == 2, argv
        err = capsys.readouterr().err
        assert "did you mean" in err and "Traceback" not in err, (argv, err)
    assert not (tmp_path / ".cgbuild" / "traces.sqlite").exists()  # refused before any trace
    # (`fetch` selects the same way, after it has checked that a shared store is declared)
