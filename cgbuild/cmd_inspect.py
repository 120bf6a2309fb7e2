"""`cgbuild inspect ARTIFACT|LABEL`: an artifact's sealed metadata, members and its mint record."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .cli import add_workspace_args, workspace
from .errors import UserError
from .output import print_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", help="a sealed artifact file, a key, or a canonical label")
    add_workspace_args(p)
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from .seal import member_digests, read_metadata

    record: dict[str, Any] | None = None
    path = Path(args.what)
    if not path.is_file():
        from .labels import parse_label, parse_selector
        from .planner import make_plan
        from .store import Store

        ws = workspace(args)
        key = args.what
        if args.what.startswith("//"):
            tid = parse_label(args.what)
            plan = make_plan(ws, parse_selector(tid.label), run_traces=False)
            key = plan["targets"][0]["key"] if plan["targets"] else None
            if not key:
                raise UserError(f"{tid.label} has no known key (plan it first)", field="label")
        store = Store(ws.cg.store_dir)
        if store.read_ref(key) is None:
            raise UserError(f"no artifact for key {key[:12]} in the store (mint it first)", field="what")
        path = store.resolve(key, verify=True).path
        rec = ws.state / "mint" / f"{key}.json"
        record = json.loads(rec.read_text()) if rec.exists() else None
    meta = read_metadata(path)
    doc = {"artifact": str(path), "metadata": meta, "members": member_digests(path), "mint_record": record}
    if args.json:
        print_json(doc)
        return 0
    print(json.dumps(doc, indent=2, sort_keys=True))
    return 0
