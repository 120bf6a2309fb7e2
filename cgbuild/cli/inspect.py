"""`cgbuild inspect ARTIFACT|KEY|LABEL`: a readable summary of an artifact (key, labels, the four
axes, toolchain, layout stamp, lane verdict and evidence, sizes, call signature, store state);
`--json` the full document: sealed metadata, members, its mint record and the lane evidence
recorded beside it (raw timings per host and mint; the sealed verdict is only the discrete
outcome)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cgbuild.cli.main import add_workspace_args, workspace
from cgbuild.cli.render import component_summary, console, phase_times, print_json
from cgbuild.config.dims import Range
from cgbuild.core.codes import Code
from cgbuild.core.errors import UserError
from cgbuild.lanes import LaneBlock
from cgbuild.protocol.contract import Baked, CallContract, Leaf

if TYPE_CHECKING:
    from cgbuild.store.seal import SealError
    from cgbuild.store.sealed import Sealed


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", help="a sealed artifact file, a key, or a canonical label")
    add_workspace_args(p)
    p.add_argument(
        "--json", action="store_true", help="the full document: metadata, members, record, evidence"
    )


def run(args: argparse.Namespace) -> int:
    from cgbuild.core.fields import Malformed
    from cgbuild.store.seal import SealError, member_digests, read_metadata
    from cgbuild.store.sealed import parse

    record: dict[str, Any] | None = None
    evidence: dict[str, Any] | None = None
    stored: dict[str, Any] | None = None
    path = Path(args.what)
    if not path.is_file():
        from cgbuild.config.labels import parse_label, parse_selector
        from cgbuild.plan.planner import make_plan
        from cgbuild.store.errors import StoreError
        from cgbuild.store.local import Store

        ws = workspace(args)
        key = args.what
        if args.what.startswith("//"):
            tid = parse_label(args.what)
            plan = make_plan(ws, parse_selector(tid.label), run_traces=False)
            key = plan.entries[0].key if plan.entries else None
            if not key:
                raise UserError(f"{tid.label} has no known key (plan it first)", field="label")
        store = Store(ws.cg.store_dir)
        try:
            if store.read_ref(key) is None:
                raise UserError(f"no artifact for key {key[:12]} in the store (mint it first)", field="what")
            resolved = store.resolve(key, verify=True)
        except StoreError as e:  # malformed ref, missing or corrupt object: reported, never raised
            raise UserError(f"{key[:12]}: {e.code}: {e.detail}", field="what") from None
        path = resolved.path
        stored = {
            "store": str(ws.cg.store_dir),
            "state": "fresh (re-hashed now)",
            "ref": resolved.ref.to_json(),
        }
        record = ws.state.read_record(key)
        # with a shared store: every card's runs published beside the artifact, not this host's only
        evidence = (ws.shared(store) or store).read_evidence(key)
    try:
        meta, members = read_metadata(path), member_digests(path)
        sealed = parse(meta)  # the fields adopt and this summary read, as adopt checks them
    except Malformed as e:
        return _refused(args, path, SealError(str(e), Code.BAD_METADATA))
    except SealError as e:
        return _refused(args, path, e)
    doc = {
        "artifact": str(path),
        "metadata": meta,
        "members": members,
        "mint_record": record,
        "lane_evidence": evidence,
        "stored": stored,
    }
    if args.json:
        print_json(doc)
        return 0
    show(doc, sealed)
    return 0


def _refused(args: argparse.Namespace, path: Path, e: SealError) -> int:
    """A crafted or broken archive: what adopt would refuse, named."""
    if args.json:
        print_json({"artifact": str(path), "refusal": {"code": e.code, "detail": e.detail}})
        return 2
    raise UserError(f"artifact refused ({e.code}): {e.detail}") from None


def show(doc: dict[str, Any], sealed: Sealed) -> None:
    """The summary a person reads; every value comes from the document `--json` prints (its
    metadata as parsed: `sealed`)."""
    from rich.markup import escape
    from rich.table import Table

    record = doc.get("mint_record") or {}
    stored = doc.get("stored")
    axes = sealed.axes
    graph, tc = axes.get("graph") or {}, axes.get("toolchain") or {}
    lay = axes.get("layout") or {}
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()

    def row(name: str, value: str) -> None:
        grid.add_row(name, escape(value))

    row("key", sealed.key)
    labels = record.get("labels") or ((stored or {}).get("ref", {}).get("metadata") or {}).get("labels") or []
    row("labels", "\n".join(labels) or "(not recorded here)")
    row("covers", "; ".join(_facet(f) for f in sealed.facets) or "-")
    row(
        "graph",
        f"{graph.get('digest') or sealed.graph_digest} ({sealed.nodes} nodes, "
        f"traced with torch {graph.get('traced_with', sealed.torch)})",
    )
    row("sm", f"{sealed.sm} (device {sealed.device})")
    row("toolchain", f"{tc.get('platform', sealed.toolchain.get('platform'))} fold {sealed.toolchain_fold}")
    for name, comp in sorted((sealed.toolchain.get("components") or {}).items()):
        try:
            row(f"  {name}", component_summary(name, comp))
        except (AttributeError, KeyError, TypeError, ValueError):  # forensics only: say so, go on
            row(f"  {name}", "(unreadable)")
    row(
        "layout",
        f"{sealed.stamp}: topology {str(lay.get('topology'))[:16]} "
        f"(from {lay.get('topology_source')}), quant {str(lay.get('quant'))[:16]} ({lay.get('quant_rule')})",
    )
    host = sealed.host
    row(
        "host",
        f"isa {host.isa.get('level')}, {host.cxx_family} {host.cxx.get('version')}; "
        f"needs {_runtime(host.runtime)}; cgbuild {sealed.cgbuild}",
    )
    selector = sealed.lanes.switches.selector if sealed.lanes else None
    row("signature", _signature(sealed.contract.without([selector.input] if selector else [])))
    for i, line in enumerate(_lane_summary(sealed.lanes, doc.get("lane_evidence"))):
        row("lanes" if i == 0 else "", line.removeprefix("lanes: ").strip())
    members = doc.get("members") or {}
    size = Path(doc["artifact"]).stat().st_size if Path(doc["artifact"]).exists() else None
    top = [m for m in members if "!" not in m]
    row(
        "size", f"{_bytes(size)} sealed; members {', '.join(top)} ({len(members) - len(top)} package entries)"
    )
    result = record.get("result") or {}
    phases = result.get("phases") or {}
    if phases:
        row("minted", phase_times(phases))
    if stored:
        ref = stored["ref"]
        row(
            "store",
            f"{stored['state']}: object sha256 {ref['object'][:16]}, {_bytes(ref['size'])}, "
            f"in {stored['store']}",
        )
    else:
        row("store", f"not looked up: a file given by path ({doc['artifact']})")
    console().print(grid)


def _runtime(runtime: Mapping[str, str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(runtime.items()))


def _facet(f: Mapping[str, Any]) -> str:
    text = f"{f.get('shape')}" + (f" frames {_size(f['frames'])}" if f.get("frames") is not None else "")
    text += f" (pixel frames {_size(f['pixel_frames'])})" if f.get("pixel_frames") is not None else ""
    text += f" batch {_size(f.get('batch'))}"
    text += f" text {_size(f['text_len'])}" if f.get("text_len") is not None else ""
    return text + (f" guidance {', '.join(f['guidance'])}" if f.get("guidance") else "")


def _size(value: Any) -> str:
    """A facet's size: its value, or a declared range as its ends (`2..4`)."""
    declared = Range.from_json(value)
    return declared.text if declared is not None else str(value)


def _signature(contract: CallContract) -> str:
    """`x: float32[1, 8, 64] -> float32[1, 8, 10]` from the sealed call contract."""

    def leaf(v: Leaf | Baked) -> str:  # a tensor, or a constant the program baked in (None, False, 2)
        return f"{v.dtype}{list(v.shape)}" if isinstance(v, Leaf) else repr(v)

    ins = ", ".join(f"{i.name}: {' | '.join(leaf(v) for v in i.leaves)}" for i in contract.inputs)
    outs = ", ".join(leaf(v) for v in contract.outputs.leaves)
    symbols = ", ".join(f"{s.name} ∈ [{s.min}, {s.max}]" for s in contract.symbols)
    return f"({ins}) -> {outs}" + (f"; symbols {symbols}" if symbols else "")


def _bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def _lane_summary(lanes: LaneBlock | None, evidence: dict[str, Any] | None) -> list[str]:
    """People's view of the lanes: the sealed verdict, then each recorded run's medians."""
    if not lanes:
        return []
    v = lanes.verdict
    sel = lanes.switches.selector
    switch = f"selector {sel.input}[{', '.join(sel.axes)}]" if sel else "one-hot literals"
    out = [
        f"lanes: winner {v.winner} ({v.binding}); fallback {' > '.join(v.fallback)}; "
        + ", ".join(f"{lane} peak {p / (1 << 30):.2f} GiB" for lane, p in v.peaks.items())
        + f"; switched by {switch}"
    ]
    for host, doc in sorted((evidence or {}).items()):
        for run in doc.get("runs", []):
            medians = ", ".join(
                f"{lane} {m['median_ns'] / 1e6:.3f} ms / {m['peak_bytes'] / 2**20:.0f} MiB"
                for lane, m in (run.get("measured") or {}).items()
            )
            out.append(f"  evidence {host} ({run.get('how')}): {medians or 'nothing measured'}")
    return out
