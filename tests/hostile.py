"""Generated hostile inputs: Cgfiles, plan files, toolchain locks and command lines.

Each generator starts from a valid document and applies a few mutations (a value of the wrong
type, non-finite or huge numbers, strings with whitespace and control characters, deletions,
unknown keys, nesting thousands deep), then optionally damages the bytes (invalid UTF-8, NUL,
truncation). `run` calls `cgbuild.cli.main` in-process and classifies the outcome; the contract is
exit 0 or exit 2 with one `error:` line, never anything else. Shared by the property tests and
benchmarks/soak_inputs.py.

Plans never trace: `--no-trace` is passed (the entry holds only its lane table); every Cgfile run takes
the toolchain from a lock, so nothing probes.
"""

from __future__ import annotations

import copy
import datetime
import io
import json
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w
from hypothesis import strategies as st

from cgbuild.cli.main import main

DEEP = "@@deep@@"
"""Marks a string replaced, after rendering, by arrays nested N levels deep (no writer recurses so far)."""

CGFILE: dict[str, Any] = {
    "workspace": {"state": ".cgbuild"},
    "toolchain": {"cxx": "g++"},
    "sku": {"cpu": {"sm": "cpu", "memory_gib": 24}, "h200": {"sm": "sm_90", "memory_gib": 141.5}},
    "layout": {
        "fp32": {"quant": "plain.fp32"},
        "bf16": {"quant": "plain.bf16"},
        "fp8": {"quant": "fp8-rowwise"},
    },
    "family": {
        "toy": {
            "entry": "models:build",
            "sources": ["*.py", "pkg/**/*.py"],
            "skus": ["cpu", "h200"],
            "layouts": ["fp32", "bf16", "fp8"],
            "config": {"hidden": 8, "ratio": 2.5, "names": ["a", "b"], "nested": {"x": True}},
            "lanes": {"linear": ["baseline", "fast"], "fp8-gemm": ["scaled-mm", "triton"]},
            "module": {
                "mlp": {"shapes": ["8x64", "16x64"], "batch_sizes": [1, 2], "guidance": [3.5, 4]},
                "conv": {
                    "shapes": ["32x32"],
                    "text_lengths": [8],
                    "batch_sizes": {"min": 1, "max": 4},
                    "component": "conv",
                },
                "vae.decode": {
                    "shapes": ["8x8"],
                    "pixel_frames": [5, 17],  # 2 and 5 latent frames by the entry's PIXEL_FRAMES
                    "serves": "vae.decode",
                    "layouts": ["bf16"],
                },
            },
        }
    },
}

ENTRY_SOURCE = (
    'LANES = {"linear": {"baseline": {}, "fast": {"device": "cuda", "min_sm": 90}}}\n'
    'CALLS = {"mlp": {"passes": {"return_dict": False}, "first_row": ["ids"], "returns": "tuple"}}\n'
    'PIXEL_FRAMES = {"vae.decode": 4}\n'
)
"""The entry's source: its lane table, call adapters and pixel -> latent frame rule are read
(never imported); nothing traces, so no `build`."""

_TORCH = {"dist": "torch", "version": "2.0.0+cpu", "digest": "0" * 64}
LOCK: dict[str, Any] = {
    "schema": "cgbuild.toolchain-lock/1",
    "platforms": {
        "cpu": {"components": {"torch": _TORCH, "isa": {"level": "x86-64-v2"}}},
        "cuda": {"components": {"torch": _TORCH, "triton": {"absent": True}}},
    },
}

PLAN: dict[str, Any] = {
    "schema": "cgbuild.plan/1",
    "workspace": {"cgfile": "Cgfile", "store": ".cgbuild/store"},
    "toolchains": {
        "cpu": {"fold": "a" * 64, "source": "probe", "components": {"torch": _TORCH, "isa": {"level": "v2"}}},
        "cuda": {
            "fold": "b" * 64,
            "source": "probe",
            "components": {"torch": _TORCH, "ptxas": {"bundled": {"nvcc": {"version": "12.8"}}}},
        },
    },
    "targets": [
        {
            "label": f"//toy/mlp/8x64-b1@{layout}:{sm}",
            "family": "toy",
            "module": "mlp",
            "graph_class": "8x64-b1",
            "layout": layout,
            "stamp": f"toy.mlp@1+plain.{layout}@1",
            "sm": sm,
            "skus": ["cpu" if sm == "cpu" else "h200"],
            "envelope": {"shape": "8x64", "batch": 1},
            "key": key,
            "status": status,
            "axes": {
                "graph": {"digest": "c" * 64},
                "sm": {"sm": sm},
                "toolchain": {"platform": "cpu" if sm == "cpu" else "cuda", "fold": "a" * 64},
                "layout": {"topology": None, "quant": layout},
            },
            "reasons": [{"code": "missing-from-store", "detail": "", "root": True}],
            "trace_inputs": "f" * 64,
        }
        for layout, sm, key, status in (
            ("fp32", "cpu", "d" * 64, "mint"),
            ("bf16", "cpu", None, "trace"),
            ("fp32", "sm_90", "e" * 64, "fresh"),
        )
    ],
}

# ---- values -------------------------------------------------------------------------------------
_STRINGS = st.sampled_from(
    [
        "",
        " ",
        "cpu\n",
        "sm_90\n",
        " cpu",
        "a b",
        "a\tb",
        "a\x00b",
        "\x1b[2J",
        "\u2028",
        "..",
        "../x",
        "/dev/null",
        "Cgfile",
        "Cgfile/below",
        "a" * 300,
        "a/" * 2100,
        "**a",
        "*.py",
        "/etc/*",
        "//...",
        "//toy:cpu",
        "plain.fp32",
        "m:f",
        "m:f\n",
        "8x64",
        "0x0",
        "99999999x1",
        "s3://bucket/p",
        "é",
    ]
)
_SCALARS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("inf"), float("-inf"), float("nan"), 1e300, 1e-300, -0.0]),
    _STRINGS,
    st.text(max_size=12),
    st.booleans(),
)
_KEYS = st.one_of(
    st.sampled_from(
        ["x", "sm", "lanes", "lane", "Toy", "a b", "h200\n", "", "variant", "prefix", "tied", "fp8-gemm"]
    ),
    st.text(max_size=6),
)


def _values(toml: bool) -> st.SearchStrategy[Any]:
    leaves = st.one_of(
        _SCALARS,
        st.integers(min_value=40, max_value=3000).map(lambda n: f"{DEEP}{n}"),
        st.datetimes(max_value=datetime.datetime(9999, 1, 1)) if toml else st.none(),
        st.times() if toml else st.text(alphabet="\ud800\udfff\x00", max_size=3),
    )
    return (
        leaves
        | _STRINGS
        | st.recursive(
            leaves,
            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_KEYS, inner, max_size=3),
            max_leaves=5,
        )
    )


# ---- mutations ----------------------------------------------------------------------------------
def _paths(doc: Any, here: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [here]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*here, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*here, i))
    return out


def _at(doc: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        doc = doc[part]
    return doc


@st.composite
def _mutated(draw: st.DrawFn, base: dict[str, Any], toml: bool) -> tuple[dict[str, Any], str]:
    """A copy of `base` with up to three mutations, and a name for the first (the category)."""
    doc = copy.deepcopy(base)
    category = "valid"
    for _ in range(draw(st.integers(min_value=0, max_value=3))):
        paths = _paths(doc)[1:]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent, last = _at(doc, path[:-1]), path[-1]
        op = draw(st.sampled_from(["set", "set", "set", "delete", "add"]))
        if op == "set":
            value = draw(_values(toml))
            parent[last] = value
            kind = "deep" if isinstance(value, str) and value.startswith(DEEP) else type(value).__name__
            op = f"set-{kind}"
        elif op == "delete":
            del parent[last]
        else:
            target = _at(doc, path)
            if isinstance(target, dict):
                target[draw(_KEYS)] = draw(_values(toml))
            elif isinstance(target, list):
                target.append(draw(_values(toml)))
            else:
                parent[last] = [target, draw(_values(toml))]
        if category == "valid":
            category = op
    return doc, category


def _deepen(text: str) -> str:
    """Replace each quoted DEEP marker by arrays nested that deep."""
    while (start := text.find(f'"{DEEP}')) >= 0:
        end = text.index('"', start + 1)
        n = int(text[start + 1 + len(DEEP) : end])
        text = text[:start] + "[" * n + "]" * n + text[end + 1 :]
    return text


@st.composite
def _damaged(draw: st.DrawFn, raw: bytes) -> tuple[bytes, str | None]:
    """`raw`, possibly with bytes inserted (invalid UTF-8, NUL, CR) or cut short."""
    op = draw(st.sampled_from([None, None, None, "bytes", "truncate"]))
    if op is None or not raw:
        return raw, None
    at = draw(st.integers(min_value=0, max_value=len(raw) - 1))
    if op == "truncate":
        return raw[:at], "truncate"
    junk = draw(
        st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b"\r", b"\x1b", b"\xef\xbb\xbf"])
    )
    return raw[:at] + junk + raw[at:], "bytes"


def _contain(doc: dict[str, Any]) -> None:
    """Keep the folders a plan writes (state, store) inside the generated workspace: an absolute
    or `..` path there would write wherever it names. /dev/null stays, as a path that is no folder."""
    ws = doc.get("workspace")
    if not isinstance(ws, dict):
        return
    for key in ("state", "store"):
        value = ws.get(key)
        if isinstance(value, str) and value != "/dev/null" and (value.startswith("/") or ".." in value):
            ws[key] = "x" + value.replace("..", "__")


@dataclass(frozen=True)
class Input:
    kind: str
    category: str
    raw: bytes


@st.composite
def cgfiles(draw: st.DrawFn) -> Input:
    doc, category = draw(_mutated(CGFILE, toml=True))
    _contain(doc)
    try:
        text = tomli_w.dumps(doc)
    except (TypeError, ValueError):  # e.g. a key or value TOML cannot hold: kept as the valid base
        text, category = tomli_w.dumps(CGFILE), "valid"
    raw, damage = draw(_damaged(_deepen(text).encode()))
    return Input("cgfile", damage or category, raw)


@st.composite
def plans(draw: st.DrawFn) -> Input:
    doc, category = draw(_mutated(PLAN, toml=False))
    raw, damage = draw(_damaged(_deepen(json.dumps(doc)).encode("utf-8", "surrogatepass")))
    return Input("plan", damage or category, raw)


@st.composite
def locks(draw: st.DrawFn) -> Input:
    doc, category = draw(_mutated(LOCK, toml=False))
    raw, damage = draw(_damaged(_deepen(json.dumps(doc)).encode("utf-8", "surrogatepass")))
    return Input("lock", damage or category, raw)


_LABELS = st.one_of(
    st.sampled_from(["//...", "//toy", "//toy/mlp", "@fp32", ":cpu", ":h200", "//toy/mlp/8x64-b1@fp32:cpu"]),
    _STRINGS,
    st.text(max_size=30),
)


@st.composite
def argvs(draw: st.DrawFn) -> Input:
    """A command line for a read-only command over the valid Cgfile: a label and some flags."""
    command = draw(st.sampled_from(["query", "plan", "why"]))
    argv = [command, draw(_LABELS)]
    if command in ("plan", "why"):
        argv += ["--no-trace", "--json"] if command == "plan" else ["--no-trace"]
        if draw(st.booleans()):
            argv += ["-j", draw(st.sampled_from(["0", "-1", "1", "4", "99999", "x", "1e3", "\x00"]))]
    if command == "query" and draw(st.booleans()):
        argv += ["--output", draw(st.sampled_from(["json", "dot", "yaml", ""]))]
    return Input("argv", command, json.dumps(argv).encode())


# ---- running ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    code: int | str
    stderr: str

    @property
    def name(self) -> str:
        return {0: "ok", 2: "refused"}.get(self.code, f"bad:{self.code}")  # type: ignore[arg-type]

    def problem(self) -> str | None:
        """What breaks the contract (exit 0, or 2 with one error line and no traceback), or None."""
        if self.code not in (0, 2) or "Traceback" in self.stderr:
            return f"exit {self.code}: {self.stderr[-2000:]}"
        if self.code == 2:
            errors = [line for line in self.stderr.splitlines() if "error:" in line]
            if len(errors) != 1:
                return f"exit 2 without exactly one error line: {self.stderr!r}"
        return None


def call(argv: list[str]) -> Outcome:
    """`cgbuild.cli.main(argv)` in this process, its output captured; an escaping exception is a
    failure of the contract too, not of the caller."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with redirect_stdout(out), redirect_stderr(err):
            code: int | str = main(argv)
    except BaseException as exc:  # SystemExit included: main must return, not exit
        code = f"raised {type(exc).__name__}: {exc}"
    return Outcome(code, err.getvalue())


class Workspace:
    """One folder reused by every generated input: the last Cgfile, lock and plans, and a valid
    Cgfile and lock the other kinds run against, so caches stay warm across inputs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.valid = root / "valid"
        self.valid.mkdir(parents=True, exist_ok=True)
        (self.valid / "Cgfile").write_text(tomli_w.dumps(CGFILE))
        self.lock = root / "lock.json"
        self.lock.write_text(json.dumps(LOCK))
        self.base_plan = root / "base.json"
        self.base_plan.write_text(json.dumps(PLAN))
        self.generated = root / "generated"
        self.generated.mkdir(exist_ok=True)
        for folder in (self.valid, self.generated):
            (folder / "models.py").write_text(ENTRY_SOURCE)

    def run(self, item: Input) -> Outcome:
        if item.kind == "cgfile":
            (self.generated / "Cgfile").write_bytes(item.raw)
            return call(
                ["-C", str(self.generated), "plan", "--no-trace", "--json", "--toolchain", str(self.lock)]
            )
        if item.kind == "lock":
            path = self.root / "generated.lock.json"
            path.write_bytes(item.raw)
            return call(["-C", str(self.valid), "plan", "--no-trace", "--json", "--toolchain", str(path)])
        if item.kind == "plan":
            path = self.root / "generated.plan.json"
            path.write_bytes(item.raw)
            first = call(["diff", str(self.base_plan), str(path), "--format", "markdown"])
            # `gc --root` reads plan files too, before it asks for the remote this workspace
            # lacks: a plan diff refused, gc refuses naming the file; one diff read, gc refuses
            # for want of a remote. Exit 2 with one line either way, never 0.
            pinned = call(["-C", str(self.valid), "gc", "--remote", "--dry-run", "--root", str(path)])
            why = str(path) if first.code != 0 else "declares no remote"
            if pinned.code != 2 or pinned.problem() is not None or why not in pinned.stderr:
                return Outcome(f"gc --root: exit {pinned.code}, not refused for {why!r}", pinned.stderr)
            if first.code != 0:
                return first
            return call(["diff", str(path), str(self.base_plan), "--format", "json"])
        argv = json.loads(item.raw)
        return call(
            ["-C", str(self.valid), *argv, *(["--toolchain", str(self.lock)] if argv[0] != "query" else [])]
        )
