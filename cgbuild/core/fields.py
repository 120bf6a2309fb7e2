"""The field checks sealed metadata is read through: each names the field it refuses.

Shared by the metadata's one check (`cgbuild.store.metadata`) and the call contract's parse
(`cgbuild.protocol.contract`), so a refusal reads the same whichever block it is in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

T = TypeVar("T")


class Malformed(ValueError):
    """One field of the sealed metadata has the wrong shape; the message names it."""


def need(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise Malformed(f"{where}: {what}")


def obj(value: Any, where: str, *, optional: bool = False) -> dict[str, Any]:
    if value is None and optional:
        return {}
    need(isinstance(value, dict), where, "not an object")
    return cast(dict[str, Any], value)


def each(value: Any, where: str, item: Callable[[Any, str], T], *, optional: bool = True) -> list[T]:
    """`item` of each element of the list at `where`, named by index ([] for an optional absent one)."""
    if value is None and optional:
        return []
    need(isinstance(value, list), where, "not a list")
    return [item(v, f"{where}[{i}]") for i, v in enumerate(value)]


def string(value: Any, where: str, *, optional: bool = False) -> None:
    need(isinstance(value, str) or (optional and value is None), where, "not a string")


def natural(value: Any, where: str, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    need(type(value) is int and value >= 0, where, "not a non-negative integer")


def naturals(value: Any, where: str) -> None:
    each(value, where, natural, optional=False)
