"""The lane rule, pure: capability candidates, fit-constrained speed, the tie band's edge, re-fit.

Vectors are given in decimal GB and milliseconds as the design states them; the rule itself works
in bytes and nanoseconds (integers only).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from cgbuild import lanes
from cgbuild.lanes import GIB, Measured, Needs, Verdict

GB = 10**9
MS = 10**6


def m(lane: str, ms: float, gb: float) -> Measured:
    return Measured(lane, round(ms * MS), round(gb * GB))


FAST_BIG, SLOW_SMALL = ("baseline", 228, 44.1), ("fused", 350, 35.1)


# ---- the rule ------------------------------------------------------------------------------------
def test_speed_wins_when_the_card_has_room() -> None:
    choice = lanes.choose([m(*FAST_BIG), m(*SLOW_SMALL)], 180 * GB)
    assert choice == lanes.Choice("baseline", "speed")


def test_fit_excludes_the_faster_lane_on_a_small_card() -> None:
    # 44.1 GB × 1.2 + 1 GiB = 54.0 GB > 48 GB; 35.1 GB × 1.2 + 1 GiB = 43.2 GB fits
    choice = lanes.choose([m(*FAST_BIG), m(*SLOW_SMALL)], 48 * GB)
    assert choice == lanes.Choice("fused", "fit")


@pytest.mark.parametrize(
    ("slow_ms", "winner", "binding"),
    [
        (306, "small", "tie-peak"),  # 2%: tie, the smaller peak wins
        (319, "big", "speed"),  # 6.3%: outside the band, speed
    ],
)
def test_the_tie_band(slow_ms: int, winner: str, binding: str) -> None:
    choice = lanes.choose([m("big", 300, 44.1), m("small", slow_ms, 35.1)], 180 * GB)
    assert choice == lanes.Choice(winner, binding)


def test_303_vs_316_is_a_tie_won_by_the_smaller_peak() -> None:
    assert (316 - 303) / 303 < 0.05  # 4.3%
    assert lanes.choose([m("big", 303, 44.1), m("small", 316, 35.1)], 180 * GB).lane == "small"


def test_jitter_far_from_the_edge_never_flips() -> None:
    seen = {
        lanes.choose([m("big", 300 + a, 44.1), m("small", 330 + b, 35.1)], 180 * GB)
        for a, b in itertools.product(range(-3, 4), repeat=2)
    }
    assert seen == {lanes.Choice("big", "speed")}


def test_both_sides_of_the_five_percent_edge_and_jitter_on_it_flips() -> None:
    def pick(slow_ns: int) -> str:
        return lanes.choose(
            [Measured("big", 300 * MS, 44 * GB), Measured("small", slow_ns, 35 * GB)], 180 * GB
        ).lane

    assert pick(315 * MS) == "small"  # exactly 5%: inside the band (inclusive)
    assert pick(315 * MS + 1) == "big"  # one nanosecond past it: speed
    assert pick(314 * MS) == "small" and pick(316 * MS) == "big"
    flips = {
        lanes.choose([m("big", 300 + a, 44), m("small", 315 + b, 35)], 180 * GB).lane
        for a, b in itertools.product((-1, 0, 1), repeat=2)
    }
    assert flips == {"big", "small"}  # ±1 ms around the edge: the verdict can flip (docs/lanes.md)


def test_nothing_fits_takes_the_smallest_peak() -> None:
    choice = lanes.choose([m(*FAST_BIG), m(*SLOW_SMALL)], 16 * GB)
    assert choice == lanes.Choice("fused", "no-fit")


def test_required_is_peak_times_1_2_plus_one_gib_in_bytes() -> None:
    assert lanes.required_bytes(10 * GIB) == 13 * GIB
    assert lanes.required_bytes(1) == 2 + GIB  # rounded up to the byte
    assert lanes.quantize(1) == lanes.QUANTUM and lanes.quantize(lanes.QUANTUM) == lanes.QUANTUM
    assert lanes.quantize(round(35.1 * GB)) == 131 * lanes.QUANTUM  # 32.75 GiB


def test_peaks_within_one_quantum_never_decide_a_tie() -> None:
    # Same speed band, peaks 100 MB apart inside one 256 MiB quantum: candidate order decides,
    # whatever the measurement noise says about the bytes.
    a, b = Measured("a", 300 * MS, 1000 * 2**20), Measured("b", 301 * MS, 1010 * 2**20)
    assert lanes.choose([a, b], 180 * GB).lane == "a"
    assert (
        lanes.choose(
            [Measured("a", 300 * MS, 1010 * 2**20), Measured("b", 301 * MS, 1000 * 2**20)], 180 * GB
        ).lane
        == "a"
    )


# ---- the sealed verdict and the re-fit at adopt ---------------------------------------------------
def test_verdict_holds_discrete_facts_and_two_mints_agree() -> None:
    first = lanes.decide([m(*FAST_BIG), m(*SLOW_SMALL)], "b200", 180 * GB)
    again = lanes.decide([m("baseline", 231, 44.2), m("fused", 347, 35.0)], "b200", 180 * GB)
    assert first == again  # other timings, peaks in the same quanta: same sealed bytes
    assert first["winner"] == "baseline" and first["binding"] == "speed"
    assert first["fallback"] == ["baseline", "fused"]
    assert first["peaks"] == {"baseline": 165 * lanes.QUANTUM, "fused": 131 * lanes.QUANTUM}
    assert all(isinstance(v, int) for v in first["peaks"].values())
    assert first["margin"]["tie_band_percent"] == 5
    assert first["margin"]["headroom_bytes"] == 180 * GB - lanes.required_bytes(165 * lanes.QUANTUM)


def test_refit_reasons_on_recorded_peaks() -> None:
    verdict = lanes.decide([m(*FAST_BIG), m(*SLOW_SMALL)], "b200", 180 * GB)
    assert Verdict.from_json(verdict).refit(180 * GB).code == "lane-adopted"
    refit = Verdict.from_json(verdict).refit(48 * GB)
    assert (refit.lane, refit.code) == ("fused", "lane-refit")
    no_fit = Verdict.from_json(verdict).refit(24 * GB)
    assert (no_fit.lane, no_fit.code) == ("fused", "lane-refit-no-fit")
    unverified = Verdict.from_json(lanes.unmeasured("baseline", "one-candidate")).refit(1)
    assert (unverified.lane, unverified.code) == ("baseline", "lane-unverified")


def test_adopt_refits_on_rounded_peaks_stricter_than_mint() -> None:
    # A card on which the MEASURED peak fits by a hair but the recorded (rounded-up) one does not.
    peak = 10 * GIB + 1
    card = lanes.required_bytes(peak)
    assert lanes.fits(peak, card) and not lanes.fits(lanes.quantize(peak), card)
    verdict = lanes.decide([Measured("a", 100, peak), Measured("b", 200, 1 * GIB)], "x", card)
    assert verdict["winner"] == "a"
    assert Verdict.from_json(verdict).refit(card).code == "lane-refit"


# ---- capability ---------------------------------------------------------------------------------
TABLE = {
    "linear": {"baseline": Needs(), "chunked": Needs(), "triton": Needs("cuda", True)},
    "norm": {"plain": Needs(), "fused": Needs(min_sm=100)},
}


def test_candidates_come_from_capability_only() -> None:
    declared = [("linear", ["baseline", "chunked", "triton"]), ("norm", ["plain", "fused"])]
    assert lanes.candidates(declared, TABLE, "cpu", False) == ["baseline+plain", "chunked+plain"]
    assert lanes.candidates(declared, TABLE, "sm_90", False) == ["baseline+plain", "chunked+plain"]
    assert lanes.candidates(declared, TABLE, "sm_90", True) == [
        "baseline+plain",
        "chunked+plain",
        "triton+plain",
    ]
    assert len(lanes.candidates(declared, TABLE, "sm_100", True)) == 6
    assert lanes.candidates(declared, TABLE, "sm_120", True)[-1] == "triton+fused"
    failed = {"linear": {"chunked": False}}
    assert lanes.candidates(declared, TABLE, "cpu", False, failed) == []  # one left: no benchmark


def test_an_axis_with_one_buildable_value_adds_no_candidates() -> None:
    assert lanes.candidates([("norm", ["plain", "fused"])], TABLE, "sm_90", True) == []
    assert lanes.candidates([("linear", ["baseline", "triton"])], TABLE, "cpu", False) == []
    assert lanes.program_lanes([("linear", ["triton", "baseline"])], TABLE, "cpu", False) == {
        "linear": ["baseline"]
    }
    assert lanes.exclusions([("linear", ["triton", "baseline"])], TABLE, "cpu", False) == {
        "linear.triton": "not-buildable: needs a cuda device"
    }


def test_the_triton_lane_is_not_a_candidate_on_a_cpu_target() -> None:
    needs = TABLE["linear"]["triton"]
    assert needs.refusal("cpu", True) == "needs a cuda device"
    assert needs.refusal("sm_90", False) == "needs triton in the toolchain"
    assert needs.refusal("sm_90", True) is None
    assert "triton" not in "".join(
        lanes.candidates([("linear", ["baseline", "chunked", "triton"])], TABLE, "cpu", True)
    )


def test_program_lanes_follow_the_entry_not_the_declaration_order() -> None:
    a = lanes.program_lanes([("linear", ["chunked", "baseline"])], TABLE, "cpu", False)
    b = lanes.program_lanes([("linear", ["baseline", "chunked"])], TABLE, "cpu", False)
    assert a == b == {"linear": ["baseline", "chunked"]}
    assert lanes.split("chunked+plain", ["linear", "norm"]) == {"linear": "chunked", "norm": "plain"}
    with pytest.raises(ValueError):
        lanes.split("chunked", ["linear", "norm"])


def test_has_triton_reads_the_toolchain_component() -> None:
    assert lanes.has_triton({"triton": {"dist": "triton", "version": "3.6.0"}})
    assert not lanes.has_triton({"triton": {"absent": True}})
    assert not lanes.has_triton({"torch": {}})


# ---- lane evidence in the store ------------------------------------------------------------------
def test_evidence_accumulates_beside_the_artifact_and_gc_follows_the_refs(tmp_path: Path) -> None:
    from cgbuild.store.errors import StoreError
    from cgbuild.store.local import EVIDENCE_SCHEMA, Store

    store = Store(tmp_path / "s")
    blob = tmp_path / "a.bin"
    blob.write_bytes(b"artifact")
    store.admit("k1", blob)
    path = store.add_evidence("k1", "host-a", {"how": "mint", "n": 1})
    store.add_evidence("k1", "host-a", {"how": "check", "n": 2})
    store.add_evidence("k1", "host-b", {"how": "mint", "n": 3})
    assert path == store.root / "evidence" / "k1" / "host-a.json"
    docs = store.read_evidence("k1")
    assert docs["host-a"]["schema"] == EVIDENCE_SCHEMA
    assert [r["n"] for r in docs["host-a"]["runs"]] == [1, 2] and len(docs["host-b"]["runs"]) == 1
    assert store.read_evidence("k2") == {}
    assert not list((store.root / "evidence" / "k1").glob("*.tmp"))
    with pytest.raises(StoreError):
        store.add_evidence("k1", "../escape", {})
    store.add_evidence("gone", "host-a", {"how": "mint"})  # a key no ref names
    assert store.gc(dry_run=True).evidence_removed == ["gone"]
    assert store.gc().evidence_removed == ["gone"] and set(store.read_evidence("k1")) == {"host-a", "host-b"}
    assert store.gc(keep=set()).evidence_removed == ["k1"]
