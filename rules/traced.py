"""Is the live module structured as the module the program was traced from?

A package runs the traced program and nothing else: a hook on a submodule, an instance `forward`,
a class whose `forward` was patched, an instance attribute shadowing a parameter, a submodule in
train mode, torch's global hooks — eager runs each, the package none. Comparing the live module
with itself as adopted would take any of them in as the baseline and serve compiled and wrong.
So the mint records the module as traced (`row` per submodule, in the configuration record's
tree, and torch's global hooks beside it), and adopt and every re-bind hold the live module to
that record (`changed`), naming the first difference (`module-changed`) with the fix.

Left out on both sides: cgbuild's own lane switches (`cgbuild_rules.lanes.LaneSwitch`, and what
they hold), whose candidate lists are the platform's, not the user's. Never compared on the
root: its hooks (they run around the compiled and the eager path alike) and its instance
`forward` (an entry may trace a method as the forward, e.g. `vae.forward = vae.decode`; the
router itself is installed there). A diffusers hook registry holding only hooks marked inert
(`INERT`, the dtype a quantized model reports) is no override: it changes no computation.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from cgbuild_rules.bound import ADAPTER_HINT, SHADOW_FIX, Moved, global_hooks, qualified
from cgbuild_rules.lanes import LaneSwitch
from torch import nn

INERT = "cgbuild_inert"
"""A class attribute marking a diffusers `ModelHook` that changes no call (what adopt adds)."""


@dataclass(frozen=True)
class Row:
    """One submodule as traced (or as first bound, for an artifact sealed without the record)."""

    cls: str
    forward: str
    hooks: tuple[int, int]
    override: bool
    shadows: tuple[str, ...]
    training: bool


@dataclass(frozen=True)
class Traced:
    """The module as traced: its submodules by FQN and whether torch's global hooks were set."""

    rows: Mapping[str, Row]
    global_hooks: bool


def forward_code(cls: type) -> str:
    """Which code a class's `forward` is: its name and its code object's own name, so a patch
    under the same name (`functools.wraps`) is told apart (`pkg.Attention.forward:forward`)."""
    fn = getattr(cls, "forward", None)
    name = f"{getattr(fn, '__module__', None)}.{getattr(fn, '__qualname__', type(fn).__name__)}"
    code = getattr(fn, "__code__", None)
    return f"{name}:{code.co_name}" if code is not None else name


def inert_override(m: nn.Module) -> bool:
    """True when `m`'s instance `forward` is a diffusers hook registry's whose hooks are all inert."""
    registry = m.__dict__.get("_diffusers_hook")
    hooks = getattr(registry, "hooks", None)
    inert = isinstance(hooks, Mapping) and all(getattr(h, INERT, False) for h in hooks.values())
    return inert and bool(hooks)


def shadows(m: nn.Module) -> tuple[str, ...]:
    """Instance attributes that hide a parameter, buffer or submodule of the same name: eager
    reads the attribute, the program the tensor it was bound to."""
    held = m._parameters.keys() | m._buffers.keys() | m._modules.keys()
    return tuple(sorted(name for name in m.__dict__ if name in held))


def row(m: nn.Module) -> Row:
    override = "forward" in m.__dict__ and not inert_override(m)
    return Row(
        qualified(type(m)),
        forward_code(type(m)),
        (len(m._forward_hooks), len(m._forward_pre_hooks)),
        override,
        shadows(m),
        m.training,
    )


def walk(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every submodule by FQN (shared ones under each name), lane switches and theirs left out."""
    lanes = {fqn for fqn, m in module.named_modules(remove_duplicate=False) if isinstance(m, LaneSwitch)}
    for fqn, m in module.named_modules(remove_duplicate=False):
        if not any(fqn == lane or fqn.startswith(f"{lane}.") for lane in lanes):
            yield fqn, m


def snapshot(module: nn.Module) -> Traced:
    return Traced({fqn: row(m) for fqn, m in walk(module)}, global_hooks())


def to_json(r: Row) -> dict[str, Any]:
    """The fields a row adds to its configuration-record tree row."""
    return {
        "forward": r.forward,
        "hooks": list(r.hooks),
        "override": r.override,
        "shadows": list(r.shadows),
        "training": r.training,
    }


def from_record(block: Mapping[str, Any]) -> Traced | None:
    """The traced structure a sealed `module` block carries (validated by the store's metadata
    check), or None for a record sealed before it."""
    tree = block.get("tree")
    if not isinstance(tree, Mapping) or not isinstance(block.get("global_hooks"), bool):
        return None
    rows: dict[str, Row] = {}
    for fqn, r in tree.items():
        if not isinstance(r, Mapping) or "forward" not in r:
            return None
        hooks = r["hooks"]
        rows[fqn] = Row(
            r["class"], r["forward"], (hooks[0], hooks[1]), r["override"], tuple(r["shadows"]), r["training"]
        )
    return Traced(rows, block["global_hooks"])


def _hooks(r: Row) -> str:
    text = f"{r.hooks[0]} forward hook(s), {r.hooks[1]} pre-hook(s)"
    return f"{text} and an instance forward" if r.override else text


def changed(
    traced: Traced,
    module: nn.Module,
    traced_as: str | None = None,
    substitutes: Mapping[str, str] | None = None,
) -> Moved | None:
    """The first way the live module differs from `traced`, with its fix, or None.

    A submodule of another class is named first (a wrapper is in train mode and holds new
    submodules too, but what moved is that it replaced the traced one), unless it is the stock
    class an entry's substitute stands for (`substitutes`: entry class → stock class) or the root
    a call adapter says was traced as `traced_as`; then its `forward` is not compared.
    """
    if global_hooks() and not traced.global_hooks:
        return Moved("", f"sees torch's global forward hooks (register_module_forward_hook): {NEVER_RUN}")
    live = {fqn: row(m) for fqn, m in walk(module)}
    for fqn in sorted(traced.rows.keys() | live.keys()):
        was, now = traced.rows.get(fqn), live.get(fqn)
        if now is None:
            return Moved(fqn, "is gone: the program was traced with it")
        if was is None:
            hint = f": {ADAPTER_HINT}" if fqn.rsplit(".", 1)[-1] in ("base_layer", "lora_A", "lora_B") else ""
            return Moved(fqn, f"is new (a {now.cls}{hint}); the program was traced without it")
        if moved := _row_changed(fqn, was, now, traced_as, substitutes or {}):
            return moved
    return None


NEVER_RUN = "the program never runs them; remove them before adopting, or serve eager"


def _row_changed(
    fqn: str, was: Row, now: Row, traced_as: str | None, substitutes: Mapping[str, str]
) -> Moved | None:
    stands_in = (fqn == "" and traced_as is not None) or substitutes.get(was.cls) == now.cls
    if now.cls != was.cls and not stands_in:
        return Moved(fqn, f"was replaced by a {now.cls} (traced as a {was.cls})")
    if now.training != was.training:
        fix = "eval" if now.training else "train"
        return Moved(
            fqn, f"is in {'train' if now.training else 'eval'} mode, traced in the other: call .{fix}()"
        )
    if extra := [n for n in now.shadows if n not in was.shadows]:
        return Moved(
            f"{fqn}.{extra[0]}" if fqn else extra[0], f"is shadowed by an instance attribute: {SHADOW_FIX}"
        )
    same_class = now.cls == was.cls and not stands_in
    # the root's own forward is the traced call (an entry may set it); its hooks run on both paths
    compare_forward = same_class and (fqn != "" or not was.override)
    if compare_forward and now.forward != was.forward:
        return Moved(fqn, f"runs {now.forward}, traced as {was.forward}: its class's forward was replaced")
    if fqn and (now.hooks, now.override) != (was.hooks, was.override):
        return Moved(fqn, f"has {_hooks(now)}, traced with {_hooks(was)}: {NEVER_RUN}")
    return None
