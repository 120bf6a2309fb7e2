"""`cgbuild manifest SELECTOR [-o FILE]`: the serving manifest of the selected targets.

Every selected target must be fresh (a verified artifact for its key is in the store): a
manifest that named a key nothing was built for would only serve eager in production, so a
selection with any other target is refused (exit 2) naming each one and its status. A manifest
serves one family's modules, so the selection must stay inside one family, and records where
each module attaches, so a selected module without `serves` (its name is no attribute path) is
refused at its Cgfile line; both before any trace. The manifest
(`cgbuild.serving-manifest/3`, `cgbuild.protocol.manifest`) lists, per module, where it attaches
in a pipeline and every graph class × layout × sm selected with its key, layout stamp, envelope
and whether its layout is compiled-only; `adopt_manifest` keeps the entries
of the serving device's sm and one layout. Written to FILE atomically, else to stdout.
"""

from __future__ import annotations

import argparse

from cgbuild.cli.main import add_workspace_args, workspace
from cgbuild.cli.render import console, print_json, progress_bar
from cgbuild.config.labels import parse_selector
from cgbuild.core.errors import UserError, Where
from cgbuild.plan.reasons import Status


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("label", help="label or selector of fresh targets, e.g. //flux2-klein:sm_90")
    add_workspace_args(p)
    p.add_argument("-o", "--output", metavar="FILE", help="write the manifest to FILE (default: stdout)")


def run(args: argparse.Namespace) -> int:
    from cgbuild.config.targets import expand, select
    from cgbuild.core.fs import write_json
    from cgbuild.plan.planner import make_plan
    from cgbuild.protocol import manifest

    ws = workspace(args)
    selector = parse_selector(args.label)
    where: Where = {"field": "label"}
    selected = select(ws.cg, expand(ws.cg), selector)
    families = sorted({t.id.family for t in selected})
    if not families:
        raise UserError(f"'{args.label}' selects no target: there is nothing to serve", **where)
    if len(families) > 1:  # checked before any trace: the selector is what must change
        raise UserError(
            f"a serving manifest is one family's; '{args.label}' selects {', '.join(families)} "
            f"(select one, e.g. //{families[0]})",
            **where,
        )
    fam = ws.cg.families[families[0]]
    for name in sorted({t.id.module for t in selected}):
        if fam.modules[name].serves is None:  # before any trace, as above
            raise ws.cg.error(
                f"module '{name}' names no pipeline attribute, which a serving manifest records: "
                'write serves = "..." with the attribute it serves (e.g. serves = "vae.decode")',
                "family",
                fam.name,
                "module",
                name,
                "serves",
            )
    update, close = progress_bar("tracing")
    try:
        plan = make_plan(ws, selector, progress=update)
    finally:
        close()
    targets = plan.entries
    stale = sorted((t.label, t.status.value) for t in targets if t.status is not Status.FRESH)
    if stale:
        names = ", ".join(f"{label} ({status})" for label, status in stale[:10])
        more = f" and {len(stale) - 10} more" if len(stale) > 10 else ""
        raise UserError(
            f"{len(stale)} of {len(targets)} selected targets are not fresh, no artifact serves them: "
            f"{names}{more}; mint them first (cgbuild mint '{args.label}') or select fresh targets only",
            **where,
        )
    from cgbuild.identity.quantrule import QUANT_RULES

    serves = {name: m.serves for name, m in fam.modules.items() if m.serves is not None}
    compiled_only = {name: QUANT_RULES[lay.quant].compiled_only for name, lay in ws.cg.layouts.items()}
    rows = [
        (
            t.module,
            manifest.Entry(
                t.graph_class, t.key, t.layout, t.sm, t.stamp, dict(t.envelope), compiled_only[t.layout]
            ),
        )
        for t in targets
        if t.key is not None  # every one: a target without a key is not fresh, refused above
    ]
    doc = manifest.build(families[0], rows, serves, fam.calls)
    if not args.output:
        print_json(doc)
        return 0
    try:
        write_json(args.output, doc, indent=1)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the name
        raise UserError(
            f"cannot write the manifest: {getattr(exc, 'strerror', None) or exc}", file=args.output
        ) from None
    entries = sum(len(module["entries"]) for module in doc["modules"].values())
    console().print(
        f"wrote {args.output}: {entries} entries of {len(doc['modules'])} modules of {families[0]}",
        markup=False,
        highlight=False,
    )
    return 0
