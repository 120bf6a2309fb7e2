"""`cgbuild verify [LABEL]`: re-hash stored artifacts, re-read their metadata, optionally run them.

Without `--run` this needs no torch. With `--run` each artifact is adopted the way a serving
process adopts it, by the mint's own `serve` stage in a fresh child process (a bad package must
not take cgbuild down): the live module built by the entry (seed-0 weights), `adopt` (a refusal
fails with adopt's code), the entry's call, which must be served compiled (no eager fallback),
compared against eager; an artifact with lanes once per lane. The numbers compared are printed.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from cgbuild.cli.main import add_workspace_args, workspace
from cgbuild.cli.render import console, print_json
from cgbuild.config.labels import parse_selector
from cgbuild.core.codes import Code


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("label", nargs="?", default="//...")
    add_workspace_args(p)
    p.add_argument("--run", action="store_true", help="also load each artifact and compare it with eager")
    p.add_argument("--json", action="store_true")


def run_artifact(ws: Any, key: str, path: Path, label: str, toolchains: dict[str, Any]) -> dict[str, Any]:
    """The mint's serve check on a stored artifact (`cgbuild.protocol.stage.serve_check`), on
    the module the mint built: the label's job with the plan's toolchains (`trace_job`)."""
    from cgbuild.plan.jobs import trace_job
    from cgbuild.protocol.stage import serve_check

    return serve_check(trace_job(ws, label, toolchains).with_id(key), path)


def compared(ran: dict[str, Any]) -> list[str]:
    """One line per output compared: the lane, the error against eager, the calls served."""
    calls = {s.get("lane"): s["counters"] for s in ran.get("served", [])}
    lines = []
    for e in ran.get("errors", []):
        lane = e.get("lane")
        served = ", ".join(f"{k} {v}" for k, v in sorted(calls.get(lane, {}).items()))
        lines.append(
            f"  {'lane ' + lane + ' ' if lane else ''}output {e['output']} ({e.get('dtype')}): "
            f"rel-rms {e['rel_rms']:.3g} (tolerance {e.get('tolerance')}), max-abs {e['max_abs']:.3g}; "
            f"served {served}"
        )
    return lines


def run(args: argparse.Namespace) -> int:
    from cgbuild.plan.planner import make_plan
    from cgbuild.store.local import Store

    ws = workspace(args)
    store = Store(ws.cg.store_dir)
    plan = make_plan(ws, parse_selector(args.label), run_traces=False)
    labels: dict[str, list[str]] = {}
    for t in plan.entries:
        if t.key and store.ref_path(t.key).exists():  # well-formed or not: verify judges
            labels.setdefault(t.key, []).append(t.label)
    reports = []
    for key, names in labels.items():
        verdict = store.verify(key)
        report: dict[str, Any] = {
            "key": key,
            "labels": names,
            "status": verdict.status,
            "detail": verdict.detail,
        }
        if verdict.status == "ok":
            sealed = store.check_sealed_key(key)  # another key's object, or no artifact: quarantined
            if sealed is not None:
                report.update(status=sealed.status, detail=sealed.detail)
            elif args.run:
                path = store.resolve(key, verify=False).path
                toolchains = {p: t.to_json() for p, t in plan.toolchains.items()}
                outcome = run_artifact(ws, key, path, names[0], toolchains)
                report["run"] = outcome
                if not outcome.get("ok"):
                    report.update(
                        status=Code.RUN_FAILED, detail=f"{outcome.get('code')}: {outcome.get('detail')}"
                    )
        reports.append(report)
    bad = [r for r in reports if r["status"] != "ok"]
    if args.json:
        print_json({"schema": "cgbuild.verify/1", "artifacts": reports})
    else:
        out = console()
        for r in reports:
            style = "green" if r["status"] == "ok" else "red"
            ran = " (ran vs eager)" if "run" in r and r["status"] == "ok" else ""
            out.print(f"[{style}]{r['status']}[/] {r['key'][:12]} {' '.join(r['labels'])}{ran} {r['detail']}")
            if "run" in r:
                for line in compared(r["run"]):
                    out.print(line, markup=False, highlight=False)
        out.print(f"{len(reports) - len(bad)} verified, {len(bad)} bad")
    return 1 if bad else 0
