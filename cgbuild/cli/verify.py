"""`cgbuild verify [LABEL]`: re-hash stored artifacts, re-read their metadata, optionally run them.

Without `--run` this needs no torch. With `--run` each artifact is unsealed into a temp folder and
the mint's own verification stage loads it through the real loader, binds random weights and
compares with eager, in a child process (a bad package must not take cgbuild down).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from cgbuild.cli.main import add_workspace_args, workspace
from cgbuild.cli.render import console, print_json
from cgbuild.config.labels import parse_selector
from cgbuild.protocol.spawn import spawn


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("label", nargs="?", default="//...")
    add_workspace_args(p)
    p.add_argument("--run", action="store_true", help="also load each artifact and compare it with eager")
    p.add_argument("--json", action="store_true")


def run_artifact(
    ws: Any,
    key: str,
    path: Path,
    label: str,
    components: dict[str, Any] | None = None,
    meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The mint's verification stage on a stored artifact: loader + random weights vs eager.

    With the platform's toolchain `components` and the sealed metadata, an artifact with lanes
    is checked on EVERY lane it carries, each against eager with the same lane.
    """
    from cgbuild.config.targets import expand
    from cgbuild.protocol.trace import job_for
    from cgbuild.store.seal import unseal

    target = next(t for t in expand(ws.cg) if t.label == label)
    request: dict[str, Any] = {"job": job_for(ws.cg, target, components).with_id(key).to_json()}
    rows = ((meta or {}).get("lanes") or {}).get("axes") or []
    if rows:
        request["lanes"] = {"axes": [[r["axis"], r["values"]] for r in rows]}
    with tempfile.TemporaryDirectory(prefix="cgbuild-verify-") as tmp:
        work = Path(tmp)
        unseal(path, work)
        (work / "request.json").write_text(json.dumps(request))
        ended = spawn("cgbuild_rules.mint", ["--stage", "verify", str(work)])
        result_file = work / "verify.json"
        if result_file.exists():
            return dict(json.loads(result_file.read_text()))
        return ended.failure("verify stage")


def run(args: argparse.Namespace) -> int:
    from cgbuild.plan.planner import make_plan
    from cgbuild.store.local import Store
    from cgbuild.store.seal import read_metadata

    ws = workspace(args)
    store = Store(ws.cg.store_dir)
    plan = make_plan(ws, parse_selector(args.label), run_traces=False)
    labels: dict[str, list[str]] = {}
    platform: dict[str, str] = {}
    for t in plan["targets"]:
        if t["key"] and store.ref_path(t["key"]).exists():  # well-formed or not: verify judges
            labels.setdefault(t["key"], []).append(t["label"])
            platform[t["key"]] = t["axes"]["toolchain"]["platform"]
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
                meta = read_metadata(path)
                components = plan["toolchains"][platform[key]]["components"]
                ran = run_artifact(ws, key, path, names[0], components, meta)
                report["run"] = ran
                if not ran.get("ok"):
                    report.update(status="run-failed", detail=f"{ran.get('code')}: {ran.get('detail')}")
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
        out.print(f"{len(reports) - len(bad)} verified, {len(bad)} bad")
    return 1 if bad else 0
