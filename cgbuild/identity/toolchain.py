"""The toolchain key axis: what compiles a target, per platform, folded to one digest.

A platform's toolchain is a flat map of named components, each a small readable block; the fold
is the sha256 of their canonical JSON. Members (docs/identity.md, "Toolchain fold"):

* cpu:  torch, cxx (host C++ compiler), isa (the clamped level), settings (`cgbuild.identity.policy`)
* cuda: the same, plus triton, ptxas, and torch's native CUDA runtime closure (every installed
  `nvidia-*` / `cuda-*` distribution torch requires, transitively), one component per wheel.

Trace-time libraries (diffusers, transformers, peft) are not members: whatever they change
arrives in the graph digest. Their versions are kept in a non-identity `forensics` section.

A wheel is identified by the RECORD rows of its own files: each row carries the wheel's own hash
of that file, so nothing is read but RECORD, and rows an installer writes (INSTALLER, REQUESTED,
direct_url.json, RECORD itself, byte-compiled files, console scripts whose shebang names the
interpreter) are left out, so one wheel digests alike on every machine whichever installer put
it there.

The engine never imports torch: distributions are read with `importlib.metadata` and their
dist-info folders. A probe is cached on disk, keyed by the stat of everything it read, so a warm
`cgbuild plan` pays a few stat calls.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from cgbuild.core import fs, jsonfile, statefile
from cgbuild.core.canon import NotCanonical, canonical_json, digest
from cgbuild.core.errors import UserError
from cgbuild.identity import compiler, policy

if TYPE_CHECKING:
    from importlib import metadata

LOCK_SCHEMA = "cgbuild.toolchain-lock/1"
FOLD_SCHEME = "cgbuild.toolchain-fold/1"
CACHE_SCHEMA = "cgbuild.toolchain-cache/1"
PLATFORMS = ("cpu", "cuda")
ABSENT: dict[str, Any] = {"absent": True}

TRITON_DISTS = ("triton", "pytorch-triton")
TRACE_ONLY = ("diffusers", "peft", "transformers")
PTXAS_DIR = "triton/backends/nvidia/bin/"
# dist-info files a wheel itself ships and no installer rewrites; every other dist-info file is
# installer-written (INSTALLER, REQUESTED, direct_url.json, RECORD, uv_cache.json, …) or inert.
_WHEEL_META = frozenset({"METADATA", "WHEEL"})
_CUDA_MEMBER = re.compile(r"(nvidia|cuda)-")
_EXTRA_GATE = re.compile(r"""\bextra\s*==\s*["']([^"']+)["']""")
_CACHE_ENTRIES = 8

Components = dict[str, dict[str, Any]]


class ToolchainError(UserError):
    """A toolchain input is unusable (a lock, the compiler, a RECORD): names the file, or
    "<environment>", and the field at fault. A `UserError`, so the CLI prints one line."""

    def __init__(self, path: str, field: str, message: str, line: int | None = None) -> None:
        super().__init__(message, file=path, field=field, line=line)
        self.path = path


# --- wheels -------------------------------------------------------------------------------------


def dist_name(name: str) -> str:
    """PEP 503 normalised distribution name: one spelling per distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def own_rows(record_text: str) -> list[tuple[str, str]]:
    """The sorted (path, hash) RECORD rows of the wheel's own files."""
    rows = []
    for row in csv.reader(record_text.splitlines()):
        if len(row) < 2 or not row[1]:
            continue  # hashless rows are written by the installer (RECORD itself, *.pyc)
        path = row[0]
        parts = path.split("/")
        if path.startswith(("../", "/")) or "__pycache__" in parts or path.endswith(".pyc"):
            continue  # scripts and data outside site-packages are installer-rewritten
        if parts[0].endswith(".dist-info") and not (len(parts) == 2 and parts[1] in _WHEEL_META):
            continue
        rows.append((path, row[1]))
    rows.sort()
    return rows


def _find(name: str, paths: list[str]) -> metadata.Distribution | None:
    """The distribution `name` as import would see it: the first on `paths`."""
    # Imported here: importlib.metadata costs ~50 ms (email parsing) that a warm probe never pays.
    from importlib import metadata

    return next(iter(metadata.distributions(name=name, path=paths)), None)


def _distinfo(dist: metadata.Distribution) -> Path:
    # Path-based finders yield PathDistribution, whose folder is `_path` (stable since 3.8; the
    # public API offers no other way to stat RECORD without parsing every row into objects).
    folder = getattr(dist, "_path", None)
    if folder is None:
        raise ToolchainError(str(dist), "RECORD", "distribution has no dist-info folder")
    return Path(str(folder))


class _Reader:
    """One cold probe: reads wheels and remembers the stat of every file it reads.

    Each stat is taken BEFORE the read: a file that changes in between then mismatches on the
    next probe and is re-read, instead of caching old content under its new stat.
    """

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        self.stats: dict[str, list[int] | None] = {p: _stat(p) for p in paths}

    def watch(self, path: str) -> None:
        self.stats[path] = _stat(path)

    def wheel(self, dist: metadata.Distribution) -> tuple[dict[str, Any], list[tuple[str, str]]]:
        record = _distinfo(dist) / "RECORD"
        self.watch(str(record))
        try:
            text = record.read_text(encoding="utf-8")
        except OSError:
            raise ToolchainError(
                str(record), "RECORD", "missing or unreadable: cannot identify this wheel's files"
            ) from None
        rows = own_rows(text)
        blob = json.dumps(rows, separators=(",", ":"), ensure_ascii=True).encode("ascii")
        name = dist_name(dist.metadata["Name"] or "")
        return {"dist": name, "version": dist.version, "digest": hashlib.sha256(blob).hexdigest()}, rows

    def find(self, name: str) -> metadata.Distribution | None:
        return _find(name, self.paths)


def wheel_component(name: str, paths: Iterable[str] | None = None) -> dict[str, Any]:
    """{"dist", "version", "digest"} of the installed distribution `name`, or {"absent": true}."""
    reader = _Reader([str(p) for p in (sys.path if paths is None else paths)])
    dist = reader.find(name)
    return reader.wheel(dist)[0] if dist is not None else dict(ABSENT)


def _requirement(req: str) -> tuple[str, frozenset[str], list[str]]:
    """(name, requested extras, extras the requirement is gated behind) of a Requires-Dist."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?", req)
    if m is None:
        return "", frozenset(), []
    extras = frozenset(dist_name(e) for e in (m.group(2) or "").split(",") if e.strip())
    gates = [dist_name(g) for g in _EXTRA_GATE.findall(req.partition(";")[2])]
    return dist_name(m.group(1)), extras, gates


def _cuda_closure(reader: _Reader, torch: metadata.Distribution) -> tuple[Components, list[str]]:
    """Installed nvidia-*/cuda-* distributions torch requires, walked through those only.

    Extras are followed as requested: torch asks for `cuda-toolkit[cublas,cudart,…]`, whose
    libraries are gated behind those extras; a library behind an extra nobody asked for is not a
    member even when installed. Other markers are not evaluated: what is installed is what loads,
    and a required-but-missing member is reported in forensics.
    """
    members: Components = {}
    walked: dict[str, frozenset[str]] = {}
    missing: set[str] = set()
    stack: list[tuple[metadata.Distribution, frozenset[str]]] = [(torch, frozenset())]
    while stack:
        dist, active = stack.pop()
        for req in dist.requires or []:
            name, extras, gates = _requirement(req)
            if not _CUDA_MEMBER.match(name) or (gates and not active.intersection(gates)):
                continue
            if name in walked and extras <= walked[name]:
                continue
            dep = reader.find(name)
            if dep is None:
                missing.add(name)
                continue
            if name not in members:
                members[name] = reader.wheel(dep)[0]
            walked[name] = walked.get(name, frozenset()) | extras
            stack.append((dep, walked[name]))
    return members, sorted(missing)


def _tool_version(path: str) -> str:
    """ "12.9.86" from `ptxas --version` ("… V12.9.86"), or "unknown" when it cannot run here."""
    if not os.access(path, os.X_OK):
        return "unknown"
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=20, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    m = re.search(r"\bV(\d+(?:\.\d+)+)", out)
    return m.group(1) if m else "unknown"


def _ptxas(
    reader: _Reader,
    triton: metadata.Distribution,
    rows: list[tuple[str, str]],
    environ: Mapping[str, str],
) -> dict[str, Any]:
    """triton's bundled ptxas binaries (their RECORD hash, already inside the triton digest, and
    their version), and any recorded override (`policy.PASS_RECORDED`) by its bytes."""
    bundled = {}
    for path, row_hash in rows:
        name = path[len(PTXAS_DIR) :]
        if path.startswith(PTXAS_DIR) and name.startswith("ptxas") and "/" not in name:
            bundled[name] = {"hash": row_hash, "version": _tool_version(str(triton.locate_file(path)))}
    overrides = {}
    for var in policy.PASS_RECORDED:
        value = environ.get(var)
        if not value:
            continue
        reader.watch(value)
        try:
            with open(value, "rb") as f:
                file_digest = hashlib.file_digest(f, "sha256").hexdigest()
        except OSError as exc:
            raise ToolchainError(value, var, f"ptxas override unreadable: {exc.strerror}") from None
        overrides[var] = {"sha256": file_digest, "version": _tool_version(value)}
    if not bundled and not overrides:
        return dict(ABSENT)
    block: dict[str, Any] = {"dist": "triton", "bundled": bundled}
    if overrides:
        block["override"] = overrides
    return block


def _read_wheels(paths: list[str], environ: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The expensive, cacheable part of a probe: wheel components and forensics."""
    reader = _Reader(paths)
    torch = reader.find("torch")
    tritons = [d for n in TRITON_DISTS if (d := reader.find(n)) is not None]
    if len(tritons) > 1:
        names = " and ".join(dist_name(d.metadata["Name"] or "") for d in tritons)
        raise ToolchainError(
            "<environment>", "triton", f"{names} are both installed: two sources for one fact"
        )
    triton_c, ptxas_c = dict(ABSENT), dict(ABSENT)
    if tritons:
        triton_c, rows = reader.wheel(tritons[0])
        ptxas_c = _ptxas(reader, tritons[0], rows, environ)
    closure, missing = _cuda_closure(reader, torch) if torch is not None else ({}, [])
    trace_only = {n: (d.version if (d := reader.find(n)) else None) for n in TRACE_ONLY}
    wheels = {
        "torch": reader.wheel(torch)[0] if torch is not None else dict(ABSENT),
        "triton": triton_c,
        "ptxas": ptxas_c,
        "closure": closure,
        "forensics": {"trace_only": trace_only, "cuda_missing": missing},
    }
    return wheels, reader.stats


# --- probe and its cache ------------------------------------------------------------------------


_CACHED = frozenset({"torch", "triton", "ptxas", "closure", "forensics", "cxx"})
_CODE = (__file__, compiler.__file__)


def _stat(path: str) -> list[int] | None:
    return fs.stat_stamp(path or ".")  # "" on sys.path is the working directory


def _valid_cache(doc: Any) -> bool:
    """{"schema", "entries": {request digest: {"stats": {path: stat}, "result": {...}}}}, each
    result holding the blocks a probe reads back (a crafted entry whose stats match must not
    crash the probe)."""
    if (
        not isinstance(doc, dict)
        or doc.get("schema") != CACHE_SCHEMA
        or not isinstance(doc.get("entries"), dict)
    ):
        return False
    for entry in doc["entries"].values():
        if not isinstance(entry, dict) or not isinstance(entry.get("stats"), dict):
            return False
        result = entry.get("result")
        if not isinstance(result, dict) or not all(isinstance(result.get(k), dict) for k in _CACHED):
            return False
    return True


def _load_cache(cache_path: str) -> dict[str, Any]:
    doc = statefile.read_json(Path(cache_path), _valid_cache, "toolchain probe cache")
    return doc["entries"] if doc is not None else {}


def _save_cache(cache_path: str, entries: dict[str, Any]) -> None:
    """Best effort, atomic: a cache that cannot be written only costs the next probe."""
    while len(entries) > _CACHE_ENTRIES:
        entries.pop(next(iter(entries)))
    with contextlib.suppress(OSError):
        fs.write_json(cache_path, {"schema": CACHE_SCHEMA, "entries": entries})


def probe(
    cxx: str | None = None,
    *,
    paths: Iterable[str] | None = None,
    cache_path: str | None = None,
    environ: Mapping[str, str] | None = None,
    cpuinfo: str = "/proc/cpuinfo",
) -> dict[str, Any]:
    """This environment's toolchain: {"cpu": {"components", "forensics"}, "cuda": {...}}.

    `cxx` is the Cgfile's `[toolchain] cxx` override (default: the distribution's g++, never
    `CXX`). `paths` is where distributions are looked up (default `sys.path`). `cache_path`
    (the engine passes `<workspace>/.cgbuild/cache/toolchain.json`) keeps the wheel and compiler
    reads, keyed by the request (paths, chosen compiler, ptxas overrides, machine, node) and
    re-validated by the stat (mtime_ns, size, inode) of each search folder, each RECORD read,
    the compiler and any ptxas override. The ISA and settings components are recomputed every
    time (no I/O), so a policy edit takes effect without touching the cache.
    """
    env = os.environ if environ is None else environ
    search = [str(p) for p in (sys.path if paths is None else paths)]
    try:
        cxx_path = compiler.choose_cxx(cxx, env.get("PATH", os.defpath))
    except compiler.CompilerError as exc:
        raise ToolchainError(exc.path, "toolchain.cxx", exc.message) from None
    request = {
        "schema": CACHE_SCHEMA,
        "paths": search,
        "cxx": cxx_path,
        "env": {v: env.get(v) for v in policy.PASS_RECORDED},
        "machine": platform.machine(),
        "node": platform.node(),
    }
    key = hashlib.sha256(canonical_json(request).encode("ascii")).hexdigest()
    entries = _load_cache(cache_path) if cache_path else {}
    entry = entries.get(key)
    cached = None
    stats = entry.get("stats") if isinstance(entry, dict) else None
    if isinstance(entry, dict) and isinstance(stats, dict) and all(_stat(p) == s for p, s in stats.items()):
        cached = entry.get("result")
    if not (isinstance(cached, dict) and cached.keys() >= _CACHED):
        cxx_stat = _stat(cxx_path)
        code = {f: _stat(f) for f in _CODE}  # a new cgbuild may derive components differently
        wheels, stats = _read_wheels(search, env)
        try:
            cxx_c = compiler.cxx_component(cxx_path)
        except compiler.CompilerError as exc:
            raise ToolchainError(exc.path, "toolchain.cxx", exc.message) from None
        cached = {**wheels, "cxx": cxx_c}
        if cache_path:
            entries.pop(key, None)
            entries[key] = {"stats": {**stats, **code, cxx_path: cxx_stat}, "result": cached}
            _save_cache(cache_path, entries)

    clamps = compiler.torch_clamps_march(None if paths is None else search)
    isa_c = compiler.isa_component(clamps=clamps, host_level=compiler.host_isa(cpuinfo=cpuinfo))
    cpu = {"torch": cached["torch"], "cxx": cached["cxx"], "isa": isa_c}
    cpu["settings"] = policy.settings_block(isa_c["arch"], clamps=clamps)
    cuda = {**cpu, "triton": cached["triton"], "ptxas": cached["ptxas"], **cached["closure"]}
    forensics = {
        **cached["forensics"],
        "cxx_path": cxx_path,
        "host_isa": compiler.host_isa(cpuinfo=cpuinfo),
        "python": platform.python_version(),
    }
    return {
        "cpu": {"components": cpu, "forensics": forensics},
        "cuda": {"components": cuda, "forensics": dict(forensics)},
    }


_probe_environment = probe  # `resolve` takes a parameter named `probe`


# --- fold, locks, precedence --------------------------------------------------------------------


def fold(components: Mapping[str, Any]) -> str:
    """sha256 hex over every component present, known or not: an unknown name in a lock still
    moves the fold (fail toward re-mint, never toward a wrong hit)."""
    return digest({"scheme": FOLD_SCHEME, "components": dict(components)})


def platform_blocks(probe_result: Mapping[str, Any]) -> dict[str, Any]:
    """{platform: {"fold", "components", ["forensics"]}}: the shape plans carry."""
    out = {}
    for name, block in probe_result.items():
        out[name] = {"fold": fold(block["components"]), "components": block["components"]}
        if "forensics" in block:
            out[name]["forensics"] = block["forensics"]
    return out


def lock_document(probe_result: Mapping[str, Any]) -> dict[str, Any]:
    """A lock: components and fold per platform; forensics (paths, host level) left out."""
    return {
        "schema": LOCK_SCHEMA,
        "platforms": {
            name: {"fold": fold(block["components"]), "components": block["components"]}
            for name, block in probe_result.items()
        },
    }


def lock_text(document: Mapping[str, Any]) -> str:
    """A lock as sorted, indented JSON: reviewable in a diff, the same bytes wherever it is written."""
    return json.dumps(document, sort_keys=True, indent=2, ensure_ascii=True) + "\n"


def write_lock(path: str, document: Mapping[str, Any]) -> None:
    """Write a lock atomically."""
    fs.write_atomic(path, lock_text(document))


def read_lock(path: str) -> dict[str, Any]:
    """Read and check a lock; raises ToolchainError naming the file and the field at fault.

    A recorded fold must match the components (a hand edit of one without the other is refused);
    folds are always recomputed, so the returned document carries trustworthy ones.
    """
    try:
        doc = jsonfile.load(path, "lock")
    except UserError as exc:
        raise ToolchainError(path, "$", exc.message, exc.line) from None

    def fail(field: str, message: str) -> ToolchainError:
        return ToolchainError(path, field, message)

    if not isinstance(doc, dict):
        raise fail("$", "a lock is a JSON object")
    if doc.get("schema") != LOCK_SCHEMA:
        raise fail("schema", f"expected {LOCK_SCHEMA!r}, got {doc.get('schema')!r}")
    if extra := sorted(set(doc) - {"schema", "platforms"}):
        raise fail(extra[0], "unknown field")
    platforms = doc.get("platforms")
    if not isinstance(platforms, dict) or not platforms:
        raise fail("platforms", "must be a non-empty object of platform → toolchain")
    for name in PLATFORMS:
        if name not in platforms:
            raise fail(f"platforms.{name}", "missing: a lock keys every platform's targets")
    out = {}
    for name, block in platforms.items():
        where = f"platforms.{name}"
        if not re.fullmatch(r"[a-z0-9_-]+", name):
            raise fail(where, "platform names use [a-z0-9_-]")
        if not isinstance(block, dict):
            raise fail(where, "must be an object with 'components'")
        if extra := sorted(set(block) - {"fold", "components"}):
            raise fail(f"{where}.{extra[0]}", "unknown field")
        components = block.get("components")
        check_components(fail, f"{where}.components", components)
        computed = fold(cast(dict[str, Any], components))
        if "fold" in block and block["fold"] != computed:
            raise fail(f"{where}.fold", "does not match the components (edited by hand?); re-lock")
        out[name] = {"fold": computed, "components": components}
    return {"schema": LOCK_SCHEMA, "platforms": out}


def check_components(fail: Callable[[str, str], UserError], where: str, components: Any) -> None:
    """A platform's components as a lock or a plan holds them; `fail(field, message)` words errors."""
    if not isinstance(components, dict) or not components:
        raise fail(where, "must be a non-empty object")
    if "torch" not in components:
        raise fail(f"{where}.torch", "missing: every toolchain names its torch")
    for cname, comp in components.items():
        _check_component(fail, f"{where}.{cname}", cname, comp)


def _check_component(fail: Callable[[str, str], UserError], field: str, name: str, comp: Any) -> None:
    if not isinstance(comp, dict) or not comp:
        raise fail(field, "a component is a non-empty object")
    try:
        canonical_json(comp)
    except NotCanonical as exc:
        raise fail(field, str(exc).replace("$", name, 1)) from None
    if comp.get("absent") is True:
        if len(comp) != 1:
            raise fail(field, "an absent component holds nothing else")
        if name == "torch":
            raise fail(field, "torch is required: a key without it collides across torch versions")
        return
    if name == "torch":
        for sub in ("dist", "version", "digest"):
            if not isinstance(comp.get(sub), str) or not comp[sub]:
                raise fail(f"{field}.{sub}", "missing or not a string")


def resolve(
    cli_lock: str | None,
    cgfile_lock: str | None,
    probe: Callable[[], Mapping[str, Any]] | Mapping[str, Any] | None = None,
    *,
    cxx: str | None = None,
    cache: str | os.PathLike[str] | None = None,
    paths: Iterable[str] | None = None,
) -> tuple[dict[str, Any], str]:
    """(toolchains, source) by precedence: `--toolchain LOCK` > the Cgfile's lock > probing.

    `probe` is a probe result or a callable producing one; without it this environment is probed
    with `cxx`, `paths` and the cache file `cache`. Probing happens only when no lock applies, so
    CI keying CUDA targets from a lock never probes. `source` is "lock:<path>" or "probe".
    """
    for lock in (cli_lock, cgfile_lock):
        if lock:
            return read_lock(str(lock))["platforms"], f"lock:{lock}"
    result: Mapping[str, Any]
    if probe is None:
        result = _probe_environment(cxx, paths=paths, cache_path=str(cache) if cache else None)
    else:
        result = probe() if callable(probe) else probe
    return platform_blocks(result), "probe"


def torch_version(platform_block: Mapping[str, Any]) -> str | None:
    """The torch version a toolchain names, None when torch is absent from it (a probe of an
    environment without torch; locks always name one). The planner compares it with the torch
    that would trace: different means the graph is unknown."""
    comp = platform_block.get("components", {}).get("torch")
    if isinstance(comp, dict) and isinstance(comp.get("version"), str):
        return cast(str, comp["version"])
    return None
