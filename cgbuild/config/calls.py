"""Call adapters: how a pipeline's call of a module maps to the call an entry traced.

An entry whose traced call is the serving call needs none. One that traces another convention
(a model subclass whose forward takes positions, returns a tensor, reads the first row of its
id tensors) declares, beside `LANES`, a literal `CALLS = {module: adapter}` that cgbuild reads
without importing the entry. It is outside every key: it changes how a call reaches the program,
never the program. `cgbuild manifest` carries it to the serving side, where the router applies
it before the contract is checked and after the program returns:

- `passes`: parameter → the one value the serving call may pass for it although the program
  never took it (`{"return_dict": False}`); any other value is not served compiled;
- `first_row`: inputs the serving call passes with one more leading dimension than traced,
  whose first row is what the module itself reads (FLUX.2's `img_ids` of shape (B, N, 4));
- `returns`: `"tuple"` when the serving call expects `(output,)` and the program returns the
  output itself;
- `traced_class`: the entry's subclass of the pipeline's module that differs from it only in its
  call (the class the program's configuration record names at its root); the live module's own
  class is then not held against it. Every submodule's class and setting still is;
- `substitutes`: entry class → the stock class it stands for, where the entry replaced something
  of the stock module to trace it (FLUX.2's attention processors, routed through a lane switch):
  adopt accepts the stock class where the configuration record names the entry's, as a
  submodule or as an attribute's object, and refuses any other (`config-drift`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cgbuild.config.labels import ATTRIBUTE_PATH
from cgbuild.config.reader import NAME
from cgbuild.core.errors import UserError
from cgbuild.core.literal import read_entry_table

TABLE_NAME = "CALLS"
RETURNS = ("tuple",)
_KEYS = ("passes", "first_row", "returns", "traced_class", "substitutes")
_MAX_SUBSTITUTES = 64
_SCALARS = (str, int, float, bool, type(None))


@dataclass(frozen=True)
class CallAdapter:
    """One module's adapter (see the module docstring)."""

    passes: Mapping[str, Any] = field(default_factory=dict)
    first_row: tuple[str, ...] = ()
    returns: str | None = None
    traced_class: str | None = None
    substitutes: Mapping[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.passes:
            out["passes"] = dict(self.passes)
        if self.first_row:
            out["first_row"] = list(self.first_row)
        if self.returns is not None:
            out["returns"] = self.returns
        if self.traced_class is not None:
            out["traced_class"] = self.traced_class
        if self.substitutes:
            out["substitutes"] = dict(self.substitutes)
        return out


def adapter_from_json(raw: Any, where: str) -> CallAdapter:
    """An adapter from its JSON (an entry's literal or a manifest's field); `ValueError` names
    the bad field under `where`."""
    if not isinstance(raw, Mapping) or not raw:
        raise ValueError(f"{where}: an adapter is a non-empty object of {', '.join(_KEYS)}")
    if extra := sorted(set(raw) - set(_KEYS)):
        raise ValueError(f"{where}: unknown field {extra[0]!r} (an adapter has {', '.join(_KEYS)})")
    passes = raw.get("passes", {})
    if not isinstance(passes, Mapping) or not all(
        isinstance(k, str) and k.isidentifier() and isinstance(v, _SCALARS) for k, v in passes.items()
    ):
        raise ValueError(f"{where}.passes: parameter name → a literal scalar (or None)")
    rows = raw.get("first_row", [])
    if not isinstance(rows, list | tuple) or not all(isinstance(r, str) and r.isidentifier() for r in rows):
        raise ValueError(f"{where}.first_row: a list of input names")
    if len(set(rows)) != len(rows) or set(rows) & set(passes):
        raise ValueError(f"{where}.first_row: names each input once, none of them in passes")
    returns = raw.get("returns")
    if returns is not None and returns not in RETURNS:
        raise ValueError(f"{where}.returns: {returns!r} is none of {', '.join(RETURNS)}")
    traced = raw.get("traced_class")
    if traced is not None and not (isinstance(traced, str) and ATTRIBUTE_PATH.fullmatch(traced)):
        raise ValueError(
            f"{where}.traced_class: a qualified class name, e.g. 'flux2_entry.Flux2KleinTransformer'"
        )
    subs = raw.get("substitutes", {})
    qualified = "a qualified class name, e.g. 'flux2_entry.JointAttnProcessor'"
    if not isinstance(subs, Mapping) or len(subs) > _MAX_SUBSTITUTES:
        raise ValueError(f"{where}.substitutes: entry class → the stock class it stands for ({qualified})")
    for entry_class, stock_class in subs.items():
        for name in (entry_class, stock_class):
            if not (isinstance(name, str) and ATTRIBUTE_PATH.fullmatch(name) and "." in name):
                raise ValueError(f"{where}.substitutes: {name!r} is not {qualified}")
        if entry_class == stock_class:
            raise ValueError(f"{where}.substitutes: {entry_class!r} stands for itself")
    return CallAdapter(dict(passes), tuple(rows), returns, traced, dict(subs))


def read_calls(root: Path, entry: str) -> dict[str, CallAdapter]:
    """module → its adapter, from the entry's `CALLS` under `root` ({} when it declares none)."""
    found = read_entry_table(root, entry, TABLE_NAME, "module -> adapter", NAME)
    if found is None:
        return {}
    raw, line, path = found
    out: dict[str, CallAdapter] = {}
    for module, adapter in raw.items():
        try:
            out[module] = adapter_from_json(adapter, f"{TABLE_NAME}[{module!r}]")
        except ValueError as e:
            raise UserError(str(e), file=path, line=line, field=TABLE_NAME) from None
    return out
