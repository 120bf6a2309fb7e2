"""The Cgfile: what a workspace declares, validated with file:line:field errors.

A declaration either takes effect or is refused: unknown keys, wrong types, bad names, dangling
SKU/layout references, empty envelopes and lane values the family's entry does not provide all
stop the run with exit code 2 and one line that says where. The file itself is hostile until read:
invalid UTF-8, nesting too deep to parse, non-finite or absurd numbers, paths that cannot be folders
and identifiers with whitespace or control characters are refused the same way. Every pattern is
matched whole (`fullmatch`): `$` would let a final newline through.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cgbuild.config.calls import CallAdapter, read_calls
from cgbuild.config.dims import MAX_DIM, Declared, Range, dimension
from cgbuild.config.frames import TABLE_NAME as FRAMES_TABLE
from cgbuild.config.frames import Temporal, latent_frames, read_pixel_frames
from cgbuild.config.labels import ATTRIBUTE_PATH
from cgbuild.config.lanes import RULE_AXES, family_lanes
from cgbuild.config.reader import (
    CONTROL,
    Reader,
    config_value,
    is_num,
    is_num_list,
    is_str,
    is_str_list,
)
from cgbuild.config.tomlpos import KeyLines
from cgbuild.core import userfile
from cgbuild.core.errors import UserError
from cgbuild.core.publickey import public_key_bytes
from cgbuild.identity.quantrule import QUANT_RULES, compute_dtype
from cgbuild.identity.topology import Reading
from cgbuild.lanes import Needs

SM = re.compile(r"cpu|sm_[0-9]{2,3}[a-z]?")
SHAPE = re.compile(r"([1-9][0-9]{0,6})x([1-9][0-9]{0,6})")
ENTRY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")
COMPONENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
VARIANT = re.compile(r"[A-Za-z0-9_-]+")
# anchored as well: the store module matches it with `match`
REMOTE = re.compile(r"^s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(?:/([A-Za-z0-9._/-]*))?$")
GIB = 1 << 30
MAX_GIB = 1 << 20
"""A SKU's memory above 1 PiB is a typo, not a device."""


@dataclass(frozen=True)
class Sku:
    name: str
    sm: str
    memory_bytes: int


@dataclass(frozen=True)
class Layout:
    name: str
    quant: str
    reference: Path | None
    dtype: str = "float32"
    """The compute dtype: the one the rule fixes (plain.*) or the one declared (quantized rules)."""
    variant: str | None = None
    """The reference's file variant to read (`fp16`: `*.fp16.safetensors`); None: the full files."""
    prefix: tuple[tuple[str, str], ...] = ()
    """component → what the entry's module puts before the reference's tensor names (`unet.`)."""
    tied: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()
    """component → (omitted tensor → the tensor it is tied to), for checkpoints that record no alias."""

    def reading(self, component: str) -> Reading:
        """How this layout's reference names `component`'s tensors."""
        return Reading(dict(self.prefix).get(component, ""), self.variant, dict(self.tied).get(component, ()))


@dataclass(frozen=True)
class Envelope:
    """The declared serving region of one module; graph classes are its static buckets."""

    shapes: tuple[tuple[int, int], ...]
    text_lengths: Declared | None
    batch_sizes: Declared
    guidance: tuple[str, ...]
    frames: Declared | None = None
    """A video module's own input frames (latent frames for a denoiser), one graph class each or
    one range; None for an image module, whose labels and facets then carry no frames at all."""


@dataclass(frozen=True)
class Module:
    name: str
    component: str
    envelope: Envelope
    serves: str | None = None
    """The pipeline attribute this module's artifacts serve (`transformer`, `vae.decode`): where
    `adopt_pipeline` attaches them. Defaults to the module's name where that is an attribute
    path; None where it is not (`vae-decode`) and none is written: the module then has no
    pipeline attachment, and what needs one (a serving manifest) asks for `serves`."""
    layouts: tuple[str, ...] = ()
    """The family's layouts this module is minted in; the family's own when not declared (a VAE
    decoder kept bf16 beside an fp8 transformer)."""
    temporal: Temporal | None = None
    """The entry's pixel → latent frame rule for this module (`cgbuild.config.frames`), when it
    states one: facets then show the pipeline's count beside the module's."""


@dataclass(frozen=True)
class Family:
    name: str
    entry: str
    config: dict[str, Any]
    sources: tuple[str, ...]
    skus: tuple[str, ...]
    layouts: tuple[str, ...]
    modules: dict[str, Module]
    lanes: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """Declared lane axes in declaration order: (axis, values). Not a key axis (docs/lanes.md)."""
    lane_table: dict[str, dict[str, Needs]] = field(default_factory=dict)
    """The implementations of the declared axes (the entry's or a quant rule's), in their
    provider's order, with their needs."""
    calls: dict[str, CallAdapter] = field(default_factory=dict)
    """module → how the pipeline's call of it maps to the traced call (the entry's `CALLS`,
    `cgbuild.config.calls`); outside every key."""

    @property
    def lane_rules(self) -> dict[str, str]:
        """Declared axis → the quant rule that owns it (its modules switch on it); entry axes
        are absent (an entry may not name an axis like a rule's)."""
        return {a: RULE_AXES[a] for a, _ in self.lanes if a in RULE_AXES}

    def lanes_for(self, quant: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """The declared axes a target of a layout with quant rule `quant` carries: the entry's
        axes, and the axes of that rule (another rule's axis has no module to switch here)."""
        return tuple((a, v) for a, v in self.lanes if RULE_AXES.get(a, quant) == quant)


@dataclass
class Cgfile:
    path: Path
    root: Path
    state_dir: Path
    store_dir: Path
    toolchain_lock: Path | None
    cxx: str | None
    skus: dict[str, Sku]
    layouts: dict[str, Layout]
    families: dict[str, Family]
    lines: KeyLines = field(repr=False)
    remote: str | None = None
    """The shared store, `s3://bucket/prefix` (docs/store.md); None: the local store only."""
    trusted: dict[str, bytes] = field(default_factory=dict)
    """Publisher name → raw ed25519 public key whose signatures adopt and fetch accept."""

    store_field: str = "state"
    """The `[workspace]` key the store folder comes from: `store`, or `state` (its default)."""

    def error(self, message: str, *path: str) -> UserError:
        return UserError(message, file=str(self.path), line=self.lines.line(*path), field=".".join(path))

    def error_in(self, exc: UserError, *path: str) -> UserError:
        """`exc`, raised using what the field at `path` names (a lock, a compiler, a checkpoint),
        as a refusal of that field: the Cgfile's line and field, then the file at fault and why."""
        inner = None if exc.field in (None, "$", ".".join(path)) else exc.field
        return self.error(str(UserError(exc.message, file=exc.file, line=exc.line, field=inner)), *path)


MAX_BYTES = 16 * userfile.MIB
"""A Cgfile of thousands of families is a few hundred KiB."""
TOP_KEYS = {"workspace", "toolchain", "sku", "layout", "family"}
MODULE_LANE_KEYS = {"lanes", "lane"}


def load(path: str | Path) -> Cgfile:
    """Parse and validate a Cgfile; raises UserError naming file, line and field."""
    path = Path(path)
    raw = userfile.read(path, "Cgfile", MAX_BYTES)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line_start = raw.rfind(b"\n", 0, exc.start) + 1
        raise UserError(
            f"not UTF-8: byte 0x{raw[exc.start]:02x} at column {exc.start - line_start + 1}",
            file=str(path),
            line=raw.count(b"\n", 0, exc.start) + 1,
        ) from None
    try:
        data = tomllib.loads(text)
    except RecursionError:
        raise UserError("TOML nested too deeply to read", file=str(path)) from None
    except tomllib.TOMLDecodeError as exc:
        at = re.search(r"\(at line (\d+), column \d+\)", str(exc))
        line = int(at.group(1)) if at else None
        msg = str(exc)[: at.start()].strip() if at else str(exc)
        raise UserError(f"TOML syntax error: {msg}", file=str(path), line=line) from None
    return parse(data, path, KeyLines(text))


def parse(data: dict[str, Any], path: Path, lines: KeyLines) -> Cgfile:
    r = Reader(path, lines)
    root = path.resolve().parent
    r.table(data, (), TOP_KEYS)

    ws = r.table(data.get("workspace", {}), ("workspace",), {"state", "store", "remote", "trusted"})
    state = r.get(ws, ("workspace",), "state", is_str, "a path string", default=".cgbuild")
    state_dir = r.folder(root / r.pathname(state, "workspace", "state"), "workspace", "state")
    store = r.get(ws, ("workspace",), "store", is_str, "a path string")
    if store is not None:
        r.pathname(store, "workspace", "store")
    store_dir = r.folder(
        root / store if store else state_dir / "store", "workspace", "store" if store else "state"
    )
    remote, trusted = _shared_store(r, ws)

    tc = r.table(data.get("toolchain", {}), ("toolchain",), {"lock", "cxx"})
    lock = r.get(tc, ("toolchain",), "lock", is_str, "a path string")
    if lock is not None:
        r.pathname(lock, "toolchain", "lock")
    cxx = r.get(tc, ("toolchain",), "cxx", is_str, "a compiler path or name")
    if cxx is not None and os.sep in r.pathname(cxx, "toolchain", "cxx"):
        cxx = str(root / cxx)  # a path is the Cgfile's, like every other; a bare name is looked up on PATH

    skus = _skus(r, data)
    layouts = _layouts(r, data, root)

    families: dict[str, Family] = {}
    for name, raw in r.table(data.get("family", {}), ("family",), None).items():
        families[name] = _family(r, name, raw, skus, layouts)
    _components_declared(r, layouts, families)
    if not families:
        raise r.fail("no [family.*] declared: nothing to build", "family")

    return Cgfile(
        path=path,
        root=root,
        state_dir=state_dir,
        store_dir=store_dir,
        toolchain_lock=root / lock if lock else None,
        cxx=cxx,
        skus=skus,
        layouts=layouts,
        families=families,
        lines=lines,
        remote=remote,
        trusted=trusted,
        store_field="store" if store else "state",
    )


def _skus(r: Reader, data: dict[str, Any]) -> dict[str, Sku]:
    skus: dict[str, Sku] = {}
    for name, raw in r.table(data.get("sku", {}), ("sku",), None).items():
        where = ("sku", name)
        r.name(name, *where)
        t = r.table(raw, where, {"sm", "memory_gib"})
        sm = r.get(t, where, "sm", is_str, "a string like 'sm_90' or 'cpu'", required=True)
        if not SM.fullmatch(sm):
            raise r.fail(f"bad sm '{sm}': expected 'cpu' or 'sm_<digits>' (e.g. sm_90, sm_120)", *where, "sm")
        gib = r.get(t, where, "memory_gib", is_num, "a number of GiB", required=True)
        r.positive(gib, MAX_GIB, *where, "memory_gib")
        if int(gib * GIB) < 1:
            raise r.fail(f"{gib!r} GiB is less than a byte", *where, "memory_gib")
        skus[name] = Sku(name, sm, int(gib * GIB))
    return skus


def _layouts(r: Reader, data: dict[str, Any], root: Path) -> dict[str, Layout]:
    layouts: dict[str, Layout] = {}
    for name, raw in r.table(data.get("layout", {}), ("layout",), None).items():
        where = ("layout", name)
        r.name(name, *where)
        t = r.table(raw, where, {"quant", "reference", "dtype", "variant", "prefix", "tied"})
        quant = r.get(t, where, "quant", is_str, "a quant rule name", required=True)
        if quant not in QUANT_RULES:
            raise r.fail(
                f"unknown quant rule '{quant}' (known: {', '.join(sorted(QUANT_RULES))})", *where, "quant"
            )
        ref = r.get(t, where, "reference", is_str, "a path to a safetensors checkpoint (file or folder)")
        if ref is not None:
            r.pathname(ref, *where, "reference")
        declared = r.get(t, where, "dtype", is_str, "a compute dtype ('float32', 'bfloat16', 'float16')")
        try:
            dtype = compute_dtype(QUANT_RULES[quant], declared)
        except ValueError as exc:
            raise r.fail(str(exc), *where, "dtype" if declared else "quant") from None
        variant, prefix, tied = _reading(r, where, t, ref)
        layouts[name] = Layout(name, quant, root / ref if ref else None, dtype, variant, prefix, tied)
    return layouts


def _components_declared(r: Reader, layouts: dict[str, Layout], families: dict[str, Family]) -> None:
    """A layout's `prefix` or `tied` for a component no module using it has is a typo: refused."""
    for lay in layouts.values():  # a declaration for a component no module of the layout has is a typo
        have = {m.component for f in families.values() for m in f.modules.values() if lay.name in m.layouts}
        for key, declared in (("prefix", lay.prefix), ("tied", lay.tied)):
            for component, _ in declared:
                if component not in have:
                    raise r.fail(
                        f"no module using layout '{lay.name}' has component '{component}' "
                        f"(components: {', '.join(sorted(have)) or 'none'})",
                        "layout",
                        lay.name,
                        key,
                        component,
                    )


def _reading(
    r: Reader, where: tuple[str, ...], t: dict[str, Any], ref: str | None
) -> tuple[str | None, tuple[tuple[str, str], ...], tuple[tuple[str, tuple[tuple[str, str], ...]], ...]]:
    """A layout's `variant`, `prefix` and `tied`: how its reference names each component's tensors
    (docs/layouts.md). Each only means something for a reference, so without one it is refused."""
    variant = r.get(t, where, "variant", is_str, "a file variant name, e.g. 'fp16'")
    if variant is not None and not VARIANT.fullmatch(variant):
        raise r.fail(f"bad variant '{variant}': a file name part of [A-Za-z0-9_-]", *where, "variant")
    prefix: dict[str, str] = {}
    for component, value in r.table(t.get("prefix", {}), (*where, "prefix"), None).items():
        if not isinstance(value, str) or not value or CONTROL.search(value) or value != value.strip():
            raise r.fail(
                f"expected a tensor-name prefix such as 'unet.', got {value!r}", *where, "prefix", component
            )
        prefix[component] = value
    tied: dict[str, tuple[tuple[str, str], ...]] = {}
    for component, table in r.table(t.get("tied", {}), (*where, "tied"), None).items():
        pairs = r.table(table, (*where, "tied", component), None)
        for omitted, kept in pairs.items():
            if not isinstance(kept, str) or not kept or kept == omitted:
                raise r.fail(
                    f"expected the name of the tensor '{omitted}' is tied to, got {kept!r}",
                    *where,
                    "tied",
                    component,
                    omitted,
                )
        tied[component] = tuple(sorted(pairs.items()))
    if ref is None:
        for key in ("variant", "prefix", "tied"):
            if key in t:
                raise r.fail(
                    f"'{key}' says how a reference names its tensors, and this layout has none", *where, key
                )
    return variant, tuple(sorted(prefix.items())), tuple(sorted(tied.items()))


def _shared_store(r: Reader, ws: dict[str, Any]) -> tuple[str | None, dict[str, bytes]]:
    """`remote = "s3://bucket/prefix"` and `trusted = ["name:<base64 ed25519 public key>", ...]`.

    Each needs the other: a remote nobody is trusted on would refuse every pulled artifact, and
    trusted keys without a remote would verify nothing.
    """
    where = ("workspace",)
    remote = r.get(ws, where, "remote", is_str, "an 's3://bucket/prefix' string")
    if remote is not None:
        remote = remote.rstrip("/")
        if not REMOTE.fullmatch(remote):
            raise r.fail(
                f"bad remote '{remote}': expected 's3://bucket/prefix' (bucket: 3-63 of [a-z0-9.-]; "
                "prefix: [A-Za-z0-9._/-])",
                *where,
                "remote",
            )
    entries = r.get(ws, where, "trusted", is_str_list, "an array of 'name:<base64 public key>' strings")
    trusted: dict[str, bytes] = {}
    for entry in entries or []:
        name, sep, text = entry.partition(":")
        if not sep:
            raise r.fail(
                f"bad trusted entry '{entry}': expected 'name:<base64 public key>'", *where, "trusted"
            )
        r.name(name, *where, "trusted")
        try:
            public = public_key_bytes(text)
        except ValueError as e:
            raise r.fail(f"trusted '{name}': {e}", *where, "trusted") from None
        if name in trusted or public in trusted.values():
            raise r.fail(f"trusted '{name}': duplicate name or key", *where, "trusted")
        trusted[name] = public
    if remote and not trusted:
        raise r.fail(
            'a remote needs trusted publisher keys (trusted = ["name:<key>"]; `cgbuild trust keygen` '
            "makes one): without them every shared artifact would be refused",
            *where,
            "remote",
        )
    if trusted and not remote:
        raise r.fail(
            "trusted keys without a remote verify nothing: declare remote or drop them", *where, "trusted"
        )
    return remote, trusted


FAMILY_KEYS = {"entry", "config", "sources", "skus", "layouts", "module", "lanes"}


def _family(r: Reader, name: str, raw: Any, skus: dict[str, Sku], layouts: dict[str, Layout]) -> Family:
    where = ("family", name)
    r.name(name, *where)
    t = r.table(raw, where, FAMILY_KEYS)
    entry = r.get(t, where, "entry", is_str, "'module:function'", required=True)
    if not ENTRY.fullmatch(entry):
        raise r.fail(f"bad entry '{entry}': expected 'package.module:function'", *where, "entry")
    config = r.get(t, where, "config", lambda v: isinstance(v, dict), "a table", default={})
    config = config_value(r, config, (*where, "config"))
    sources = r.get(t, where, "sources", is_str_list, "an array of glob strings", default=[])
    for pattern in sources:
        r.glob(pattern, *where, "sources")
    fam_skus = r.get(t, where, "skus", is_str_list, "an array of SKU names", required=True)
    fam_layouts = r.get(t, where, "layouts", is_str_list, "an array of layout names", required=True)
    for key, values, known in (("skus", fam_skus, skus), ("layouts", fam_layouts, layouts)):
        if not values:
            raise r.fail(f"'{key}' is empty: a family needs at least one", *where, key)
        if len(set(values)) != len(values):
            dup = next(v for v in values if values.count(v) > 1)
            raise r.fail(f"duplicate name '{dup}'", *where, key)
        for v in values:
            if v not in known:
                kind = key[:-1]
                raise r.fail(
                    f"unknown {kind} '{v}' (declared: {', '.join(sorted(known)) or 'none'})", *where, key
                )
    modules_raw = r.table(t.get("module", {}), (*where, "module"), None)
    if not modules_raw:
        raise r.fail("no [family.<name>.module.*] declared", *where, "module")
    temporal = read_pixel_frames(r.path.resolve().parent, entry)
    modules = {
        m: _module(r, (*where, "module", m), m, spec, tuple(fam_layouts), temporal.get(m))
        for m, spec in modules_raw.items()
    }
    rules = {layouts[lay].quant for lay in fam_layouts}
    lanes, table = family_lanes(r, where, t["lanes"], entry, rules) if "lanes" in t else ((), {})
    calls = {m: a for m, a in read_calls(r.path.resolve().parent, entry).items() if m in modules}
    return Family(
        name,
        entry,
        config,
        tuple(sources),
        tuple(fam_skus),
        tuple(fam_layouts),
        modules,
        lanes,
        table,
        calls,
    )


MODULE_KEYS = {
    "component",
    "shapes",
    "frames",
    "pixel_frames",
    "text_lengths",
    "batch_sizes",
    "guidance",
    "serves",
    "layouts",
}


def _module(
    r: Reader,
    where: tuple[str, ...],
    name: str,
    raw: Any,
    family_layouts: tuple[str, ...],
    temporal: Temporal | None,
) -> Module:
    r.name(name, *where)
    if isinstance(raw, dict):
        for lane_key in MODULE_LANE_KEYS & set(raw):
            raise r.fail(
                "lanes are declared per family ([family.<name>.lanes]), not per module", *where, lane_key
            )
    if isinstance(raw, dict):
        for key, value in raw.items():
            if key not in MODULE_KEYS and isinstance(value, dict):  # `[...module.vae.decode]` unquoted
                quoted = ".".join([*where[:-1], f'"{name}.{key}"'])
                raise r.fail(
                    f"unknown key '{key}': a module name with a dot is quoted in TOML, [{quoted}]",
                    *where,
                    key,
                )
    t = r.table(raw, where, MODULE_KEYS)
    component = r.get(
        t, where, "component", is_str, "a checkpoint component name", default=name.split(".")[0]
    )
    if not COMPONENT.fullmatch(component):
        raise r.fail(
            f"bad component '{component}': a checkpoint folder name of [A-Za-z0-9._-], not starting with '.'",
            *where,
            "component",
        )
    shapes_raw = r.get(t, where, "shapes", is_str_list, "an array of 'HxW' strings", required=True)
    shapes: list[tuple[int, int]] = []
    for s in shapes_raw:
        m = SHAPE.fullmatch(s)
        if not m:
            raise r.fail(
                f"bad shape '{s}': expected 'HxW' with positive integers, e.g. '1024x768'", *where, "shapes"
            )
        shapes.append((int(m.group(1)), int(m.group(2))))
    texts = dimension(r, t, where, "text_lengths", "integers")
    frames = dimension(r, t, where, "frames", "the module's input frame counts")
    pixel = dimension(r, t, where, "pixel_frames", "the pipeline's frame counts (num_frames)")
    batches = dimension(r, t, where, "batch_sizes", "integers")
    batches = (1,) if batches is None else batches
    guidance = r.get(t, where, "guidance", is_num_list, "an array of numbers", default=[])
    for key, values in (
        ("shapes", shapes_raw),
        ("frames", frames),
        ("pixel_frames", pixel),
        ("text_lengths", texts),
        ("batch_sizes", batches),
    ):
        if values is None or isinstance(values, Range):
            continue
        if not values:
            raise r.fail(f"empty envelope: '{key}' declares no values", *where, key)
        if len(set(values)) != len(values):
            raise r.fail(f"duplicate value in '{key}'", *where, key)
        for v in [] if key == "shapes" else values:  # a shape's sizes are checked below
            r.positive(v, MAX_DIM, *where, key)
    for h, w in shapes:
        r.positive(max(h, w), MAX_DIM, *where, "shapes")
    for g in guidance:
        r.finite(g, *where, "guidance")
    if pixel is not None:
        frames = _from_pixel(r, where, pixel, frames, temporal)
    serves, layouts = _serving(r, where, t, name, family_layouts)
    envelope = Envelope(tuple(shapes), texts, batches, tuple(_num_text(g) for g in guidance), frames)
    return Module(name, component, envelope, serves, layouts, temporal)


def _from_pixel(
    r: Reader, where: tuple[str, ...], pixel: Declared, frames: Declared | None, temporal: Temporal | None
) -> Declared:
    """`pixel_frames` as the module's own frames, through the entry's rule; refused beside
    `frames`, without a rule, or for a count no pipeline call makes."""
    if frames is not None:
        raise r.fail(
            "declare frames (the module's own input frames) or pixel_frames (the pipeline's), not both",
            *where,
            "pixel_frames",
        )
    if temporal is None:
        raise r.fail(
            f"pixel_frames needs the entry to state its pixel -> latent frame rule ({FRAMES_TABLE} = "
            f"{{'{where[-1]}': <its VAE's temporal factor>}} beside LANES); or declare frames, the "
            "module's own input frames",
            *where,
            "pixel_frames",
        )
    try:
        return latent_frames(temporal, pixel)
    except ValueError as e:
        raise r.fail(str(e), *where, "pixel_frames") from None


def _serving(
    r: Reader, where: tuple[str, ...], t: dict[str, Any], name: str, family_layouts: tuple[str, ...]
) -> tuple[str | None, tuple[str, ...]]:
    """(the pipeline attribute the module serves, the layouts it is minted in), checked: a
    written `serves` is an attribute path of identifiers; unwritten, it is the module's name where
    that is one, else None (any label name plans; only a manifest needs the attachment); the
    layouts are a non-empty subset of the family's without repeats."""
    serves = r.get(t, where, "serves", is_str, "a pipeline attribute path, e.g. 'vae.decode'")
    if serves is None:
        serves = name if ATTRIBUTE_PATH.fullmatch(name) else None
    elif not ATTRIBUTE_PATH.fullmatch(serves):
        raise r.fail(
            f"bad serves '{serves}': a pipeline attribute path of identifiers, e.g. 'transformer' or "
            "'vae.decode'",
            *where,
            "serves",
        )
    declared = r.get(t, where, "layouts", is_str_list, "an array of the family's layout names")
    if declared is None:
        return serves, family_layouts
    if not declared:
        raise r.fail("'layouts' is empty: a module needs at least one", *where, "layouts")
    for lay in declared:
        if declared.count(lay) > 1:
            raise r.fail(f"duplicate name '{lay}'", *where, "layouts")
        if lay not in family_layouts:
            raise r.fail(
                f"layout '{lay}' is not one of the family's layouts ({', '.join(family_layouts)})",
                *where,
                "layouts",
            )
    return serves, tuple(lay for lay in family_layouts if lay in declared)


def _num_text(value: float | int) -> str:
    """Guidance values are facets, not identity; keep them as exact decimal text (no floats in JSON)."""
    return repr(float(value)) if isinstance(value, float) else str(value)
