"""A module's declared dimensions held to what its entry does with them.

The Cgfile states a video module's frames and any dimension's range (docs/entry.md); the labels,
the facets and the mint's checks all read that declaration, so an entry that ignores it would
make them lie. Two things are checked whenever the entry runs or exports:

- a module that declares frames must have an entry that reads `spec["frames"]` (one that never
  looks would trace one program under labels that name different frame counts);
- every declared range must be exported as a `torch.export.Dim` of the dimension's spec name
  (`frames`, `text_len`, `batch`) with the declared bounds; a derived dimension (`2 * frames`)
  counts by its root.

A refusal is `dimension-mismatch`, naming the Cgfile field that declares the dimension (`field`,
e.g. `family.zoo-video.module.wan.frames`), so the plan can point at its line. A Dim of any other
name, or of one of these names without a declared range, is the entry's own: served over its
traced range (adopt's `symbol-range`), but neither named by the label nor checked at its ends.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from cgbuild_rules.digest import TraceError
from torch.export.dynamic_shapes import Dim, _DerivedDim

from cgbuild.config.dims import FIELD, Range
from cgbuild.core.codes import Code


class DimensionMismatch(TraceError):
    """The entry does not do what the Cgfile declares of a dimension."""

    code = Code.DIMENSION_MISMATCH

    def __init__(self, detail: str, field: str) -> None:
        super().__init__(detail)
        self.field = field
        """The Cgfile field that declares the dimension (`family.<f>.module.<m>.frames`)."""


class SpecReads(dict[str, Any]):
    """The spec as handed to the entry, noting which keys it looked up. Copying or iterating
    it counts as reading every key: only an entry that plainly never asked is refused."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        super().__init__(spec)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)

    def _all(self) -> None:
        self.read.update(super().keys())

    def __iter__(self) -> Iterator[str]:
        self._all()
        return super().__iter__()

    def keys(self) -> Any:
        self._all()
        return super().keys()

    def items(self) -> Any:
        self._all()
        return super().items()

    def values(self) -> Any:
        self._all()
        return super().values()

    def copy(self) -> dict[str, Any]:
        self._all()
        return dict(super().items())


def _where(spec: Mapping[str, Any], name: str) -> str:
    return f"family.{spec['family']}.module.{spec['module']}.{FIELD[name]}"


def declared_ranges(spec: Mapping[str, Any]) -> dict[str, Range]:
    """Spec key → the range the Cgfile declares for it ({} for a module without one)."""
    out: dict[str, Range] = {}
    for name, value in (spec.get("ranges") or {}).items():
        declared = Range.from_json(value)
        assert declared is not None, f"spec.ranges.{name} passed the job's checks"
        out[name] = declared
    return out


def check_read(spec: Mapping[str, Any], reads: SpecReads) -> None:
    """Refuse an entry that never read the frames its module declares."""
    if spec.get("frames") is not None and "frames" not in reads.read:
        raise DimensionMismatch(
            f"{_where(spec, 'frames')} declares frames, but the entry never reads spec['frames']: every "
            "frame count would trace the same program",
            _where(spec, "frames"),
        )


def exported(dynamic_shapes: Any) -> dict[str, tuple[Any, Any]]:
    """Name → (min, max) of every `torch.export.Dim` in an entry's dims (a derived one by its root)."""
    out: dict[str, tuple[Any, Any]] = {}
    stack = [dynamic_shapes]
    while stack:
        node = stack.pop()
        if isinstance(node, Mapping):
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            stack.extend(node)
        elif isinstance(node, Dim):
            root = node.root if isinstance(node, _DerivedDim) else node
            out.setdefault(root.__name__, (root.min, root.max))
    return out


def check_exported(spec: Mapping[str, Any], dynamic_shapes: Any) -> None:
    """Refuse dims that do not export each declared range as a Dim of its name and bounds."""
    dims = exported(dynamic_shapes)
    for name, want in declared_ranges(spec).items():
        field = _where(spec, name)
        where = f"{field} declares {name} {want.text}"
        if name not in dims:
            raise DimensionMismatch(
                f"{where}, but the entry's dims export no torch.export.Dim named {name!r} (return "
                f"e.g. {{'x': {{0: torch.export.Dim({name!r}, min={want.min}, max={want.max})}}}} "
                "as build()'s fourth value)",
                field,
            )
        lo, hi = dims[name]
        if (lo, hi) != (want.min, want.max):
            raise DimensionMismatch(f"{where}, but the entry exports Dim {name!r} over {lo}..{hi}", field)
