"""A family's `[lanes]` table read: each axis the family's entry (its `LANES` table, read without
importing it) or one of its layouts' quant rules owns, its values, and what each value needs.
"""

from __future__ import annotations

from typing import Any

from cgbuild.config.reader import Reader, is_str_list, kind
from cgbuild.core.errors import UserError
from cgbuild.identity.quantrule import QUANT_RULES
from cgbuild.lanes import Needs, read_lane_table


def _axis_owners() -> dict[str, str]:
    """Every quant rule's lane axis → the rule that owns it; two rules may not claim one axis."""
    owners: dict[str, str] = {}
    for rule in QUANT_RULES.values():
        for axis in rule.lanes:
            if axis in owners:
                raise ValueError(f"lane axis {axis!r} is both {owners[axis]!r}'s and {rule.name!r}'s")
            owners[axis] = rule.name
    return owners


RULE_AXES = _axis_owners()
"""Every quant rule's lane axis → the rule that owns it."""


def _rule_axes(rules: set[str]) -> dict[str, dict[str, Needs]]:
    """axis → (value → needs) for the lane axes of the rules a family uses."""
    return {
        axis: {v: Needs.from_json(n) for v, n in QUANT_RULES[rule].lanes[axis].items()}
        for axis, rule in RULE_AXES.items()
        if rule in rules
    }


def family_lanes(
    r: Reader, where: tuple[str, ...], raw: Any, entry: str, rules: set[str]
) -> tuple[tuple[tuple[str, tuple[str, ...]], ...], dict[str, dict[str, Needs]]]:
    """`[family.<name>.lanes]`: axis = [values], each value a real implementation.

    An axis is the entry's (its `LANES` literal, read from its source, never imported) or a quant
    rule's (`QuantRule.lanes`: the rule's own modules switch on it) when one of the family's
    layouts uses that rule (`RULE_AXES` names it). Every axis must keep
    one value with no needs, so every target that carries it can build one implementation.
    """
    here = (*where, "lanes")
    declared = r.table(raw, here, None)
    if not declared:
        raise r.fail('empty lanes table: declare at least one axis, e.g. linear = ["baseline", ...]', *here)
    root = r.path.resolve().parent
    owned = _rule_axes(rules)
    table = read_lane_table(root, entry)
    entry_axes = table.axes if table is not None else {}
    clash = next((axis for axis in entry_axes if axis in RULE_AXES), None)
    if table is not None and clash is not None:  # whether or not a layout here uses the rule yet
        raise UserError(
            f"LANES[{clash!r}]: '{clash}' is a quant rule's lane axis; rename the entry's",
            file=table.file,
            line=table.line,
            field="LANES",
        )
    axes: list[tuple[str, tuple[str, ...]]] = []
    needs: dict[str, dict[str, Needs]] = {}
    for axis, values in declared.items():
        at = (*here, axis)
        r.name(axis, *at)
        if not is_str_list(values):
            raise r.fail(f"expected an array of lane values, got {kind(values)} {values!r}", *at)
        if not values:
            raise r.fail(f"empty lane axis '{axis}': declare at least one value", *at)
        if len(set(values)) != len(values):
            dup = next(v for v in values if values.count(v) > 1)
            raise r.fail(f"duplicate lane value '{dup}'", *at)
        provider = f"entry '{entry}'"
        if axis in owned:
            provided, provider = owned[axis], f"quant rule '{RULE_AXES[axis]}'"
        elif axis in entry_axes:
            provided = entry_axes[axis]
        elif table is None and not _owner_hint(axis):
            raise r.fail(
                f"entry '{entry}' declares no LANES table in its source under {root.name or root}/ "
                "(axis -> value -> needs, a literal): lanes must name implementations the entry provides",
                *here,
            )
        else:
            others = sorted({*entry_axes, *owned})
            axes_here = f" (axes here: {', '.join(others)})" if others else ""
            raise r.fail(f"unknown lane axis '{axis}' for entry '{entry}'{axes_here}{_owner_hint(axis)}", *at)
        for v in values:
            if v not in provided:
                raise r.fail(
                    f"unknown lane value '{v}' for axis '{axis}' "
                    f"({provider} provides: {', '.join(provided)})",
                    *at,
                )
        if all(provided[v].to_json() for v in values):
            raise r.fail(
                f"lane axis '{axis}' declares no value that builds everywhere (each of "
                f"{', '.join(values)} needs something): add one with no needs, e.g. the reference",
                *at,
            )
        axes.append((axis, tuple(values)))
        needs[axis] = {v: n for v, n in provided.items() if v in values}
    return tuple(axes), needs


def _owner_hint(axis: str) -> str:
    """A rule's axis declared on a family none of whose layouts uses the rule: say which rule."""
    if axis not in RULE_AXES:
        return ""
    return f"; '{axis}' belongs to quant rule '{RULE_AXES[axis]}', which no layout of this family uses"
