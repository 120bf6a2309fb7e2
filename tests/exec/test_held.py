"""Which key a held worker may mint: one of the unit it traced, on the sm it reported (no
process here: the choice is the executor's, from the worker's trace line)."""

from __future__ import annotations

from pathlib import Path

from cgbuild.config import cgfile
from cgbuild.config.targets import expand
from cgbuild.exec.held import Held
from cgbuild.plan.planner import TraceUnit
from cgbuild.protocol.trace import job_for

KLEIN = Path(__file__).resolve().parents[2] / "examples" / "flux2_klein" / "Cgfile"


def test_a_held_worker_serves_only_its_units_targets_on_the_sm_it_traced_on(tmp_path: Path) -> None:
    cg = cgfile.load(KLEIN)
    shape = "//flux2-klein/transformer/1024x1024-t512-b1@bf16"
    by_label = {t.label: t for t in expand(cg)}
    h200, rtx = by_label[f"{shape}:sm_90"], by_label[f"{shape}:sm_120"]
    other = by_label["//flux2-klein/transformer/768x768-t512-b1@bf16:sm_90"]
    unit = TraceUnit("f" * 64, job_for(cg, h200).with_id("f" * 64), [h200, rtx])

    def held(trace: dict) -> Held:
        h = Held(unit, tmp_path, tmp_path / "held.log", None)
        h._trace(trace)  # what the worker's `{"traced": ...}` line carries
        return h

    on_h200 = held({"ok": True, "sm": "sm_90"})
    assert on_h200.serves(h200) and not on_h200.serves(rtx) and not on_h200.serves(other)
    assert not held({"ok": True, "sm": None}).serves(h200)  # no device here: traced fake, mints nothing
    assert not held({"ok": False, "code": "entry-error", "sm": "sm_90"}).serves(h200)
