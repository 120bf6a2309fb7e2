"""`cgbuild inspect ARTIFACT|LABEL`: an artifact's sealed metadata, members, its mint record and the
lane evidence recorded beside it (raw timings per host and mint; the sealed verdict is only the
discrete outcome)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from cgbuild.cli.main import add_workspace_args, workspace
from cgbuild.cli.render import print_json
from cgbuild.core.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", help="a sealed artifact file, a key, or a canonical label")
    add_workspace_args(p)
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from cgbuild.store.seal import SealError, member_digests, read_metadata

    record: dict[str, Any] | None = None
    evidence: dict[str, Any] | None = None
    path = Path(args.what)
    if not path.is_file():
        from cgbuild.config.labels import parse_label, parse_selector
        from cgbuild.plan.planner import make_plan
        from cgbuild.store.local import Store, StoreError

        ws = workspace(args)
        key = args.what
        if args.what.startswith("//"):
            tid = parse_label(args.what)
            plan = make_plan(ws, parse_selector(tid.label), run_traces=False)
            key = plan["targets"][0]["key"] if plan["targets"] else None
            if not key:
                raise UserError(f"{tid.label} has no known key (plan it first)", field="label")
        store = Store(ws.cg.store_dir)
        try:
            if store.read_ref(key) is None:
                raise UserError(f"no artifact for key {key[:12]} in the store (mint it first)", field="what")
            path = store.resolve(key, verify=True).path
        except StoreError as e:  # malformed ref, missing or corrupt object: reported, never raised
            raise UserError(f"{key[:12]}: {e.code}: {e.detail}", field="what") from None
        rec = ws.state / "mint" / f"{key}.json"
        record = json.loads(rec.read_text()) if rec.exists() else None
        # with a shared store: every card's runs published beside the artifact, not this host's only
        evidence = (ws.shared(store) or store).read_evidence(key)
    try:
        meta, members = read_metadata(path), member_digests(path)
    except SealError as e:  # a crafted or broken archive: what adopt would refuse, named
        if args.json:
            print_json({"artifact": str(path), "refusal": {"code": e.code, "detail": e.detail}})
            return 2
        raise UserError(f"artifact refused ({e.code}): {e.detail}") from None
    doc = {
        "artifact": str(path),
        "metadata": meta,
        "members": members,
        "mint_record": record,
        "lane_evidence": evidence,
    }
    if args.json:
        print_json(doc)
        return 0
    print(json.dumps(doc, indent=2, sort_keys=True))
    for line in _lane_summary(meta, evidence):
        print(line)
    return 0


def _lane_summary(meta: dict[str, Any], evidence: dict[str, Any] | None) -> list[str]:
    """People's view of the lanes: the sealed verdict, then each recorded run's medians."""
    lanes = meta.get("lanes")
    if not lanes:
        return []
    v = lanes["verdict"]
    out = [
        f"lanes: winner {v['winner']} ({v['binding']}); fallback {' > '.join(v.get('fallback') or [])}; "
        + ", ".join(f"{lane} peak {p / (1 << 30):.2f} GiB" for lane, p in (v.get("peaks") or {}).items())
    ]
    for host, doc in sorted((evidence or {}).items()):
        for run in doc.get("runs", []):
            medians = ", ".join(
                f"{lane} {m['median_ns'] / 1e6:.3f} ms / {m['peak_bytes'] / 2**20:.0f} MiB"
                for lane, m in (run.get("measured") or {}).items()
            )
            out.append(f"  evidence {host} ({run.get('how')}): {medians or 'nothing measured'}")
    return out
