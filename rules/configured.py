"""Is the live module configured as the module the artifact was minted from?

A compiled program bakes a module's Python-level hyperparameters in as constants: a norm's
`eps`, an attention's head count, a scale, the class of a processor. Two modules with the same
tensors but another `eps` compute different things, and no tensor check sees it. So the mint
records the module's configuration (`record`) and adopt compares the live module with it
(`drift`) before binding, naming the first value that moved (`config-drift`).

The record has two parts:
- `config`: a diffusers or transformers model's own `config` (its constructor arguments), when
  it has one; keys that are forensics, not computation (library versions, checkpoint names),
  are left out;
- `tree`: per submodule (by FQN) its class and its public scalar attributes (numbers, strings,
  booleans, None, short tuples of them), plain objects by class, functions by name. Private
  attributes (`_name`) and `training` (watched per call, `cgbuild_rules.bound`) are left out.

Values are stored in canonical JSON, which has no floats: a float is `{"float": hex}` (exact).
Artifacts sealed before the record existed carry none: they adopt as before, marked unverified.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import torch
from cgbuild_rules import traced
from cgbuild_rules.bound import global_hooks, qualified, settings
from torch import nn

# Config keys that describe where a model came from, not what it computes.
_FORENSIC_KEYS = frozenset({"transformers_version", "architectures", "name_or_path", "torch_dtype", "dtype"})
_MAX_ITEMS = 64
_MAX_DEPTH = 3


def encode(value: Any, depth: int = 0) -> Any:
    """`value` as canonical-JSON data that compares equal exactly when the values do."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return {"float": value.hex()}
    if isinstance(value, torch.dtype | torch.device):
        return {"torch": str(value)}
    if isinstance(value, list | tuple) and depth < _MAX_DEPTH and len(value) <= _MAX_ITEMS:
        return [encode(v, depth + 1) for v in value]
    if isinstance(value, Mapping) and depth < _MAX_DEPTH and len(value) <= _MAX_ITEMS:
        return {str(k): encode(v, depth + 1) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, types.FunctionType | types.BuiltinFunctionType | types.MethodType):
        return {"callable": f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"}
    kind = type(value)
    if isinstance(value, list | tuple | Mapping):
        return {"object": f"{kind.__qualname__}[{len(value)}]"}
    return {"object": f"{kind.__module__}.{kind.__qualname__}"}


def show(value: Any) -> str:
    """An encoded value as a person reads it (`1e-06`, `8`, `AttnProcessor2_0`)."""
    if isinstance(value, dict) and len(value) == 1:
        ((tag, text),) = value.items()
        if tag == "float" and isinstance(text, str):
            try:
                return repr(float.fromhex(text))
            except ValueError:
                return text
        if tag in ("object", "callable", "torch") and isinstance(text, str):
            return text
    if isinstance(value, list):
        return "[" + ", ".join(show(v) for v in value) + "]"
    return repr(value)


def _hyper(module: nn.Module) -> dict[str, Any]:
    return {name: encode(value) for name, value in sorted(settings(module))}


def _config(module: nn.Module) -> dict[str, Any] | None:
    config = getattr(module, "config", None)
    if config is None:
        return None
    to_dict = getattr(config, "to_dict", None)
    raw = to_dict() if callable(to_dict) else config
    if not isinstance(raw, Mapping):
        return None
    return {
        str(k): encode(v)
        for k, v in sorted(raw.items(), key=lambda kv: str(kv[0]))
        if not str(k).startswith("_") and str(k) not in _FORENSIC_KEYS
    }


def record(module: nn.Module) -> dict[str, Any]:
    """What the mint writes into the sealed metadata's `module` block: the configuration, and
    per submodule the structure it was traced with (`cgbuild_rules.traced`)."""
    return {
        "config": _config(module),
        "tree": {
            fqn: {"class": qualified(type(m)), "hyper": _hyper(m), **traced.to_json(traced.row(m))}
            for fqn, m in traced.walk(module)
        },
        "global_hooks": global_hooks(),
    }


def _same(old: Any, new: Any, substitutes: Mapping[str, str]) -> bool:
    """Equal, or the entry's class `old` where the live module holds the stock class it stands for."""
    if old == new:
        return True
    if isinstance(old, Mapping) and isinstance(new, Mapping) and len(old) == len(new) == 1:
        ((tag, was),), ((now_tag, now),) = old.items(), new.items()
        return tag == now_tag == "object" and isinstance(was, str) and substitutes.get(was) == now
    return False


def drift(
    recorded: Mapping[str, Any],
    module: nn.Module,
    traced_as: str | None = None,
    substitutes: Mapping[str, str] | None = None,
) -> str | None:
    """The first configuration value the live module holds otherwise than at mint, as a
    sentence (`norm_eps 1e-06 → 0.1`), or None.

    Compared: the model config key by key; per submodule present in both, its class (the root's
    too: a wrapper the entry returned is the module to adopt) and every attribute both hold.
    A submodule only one side has is the structure check's (`cgbuild_rules.traced`).
    `traced_as`: a root class (a call adapter's `traced_class`) that differs from the live root's
    only in its call, so the root's class alone is not compared when the record names it.
    `substitutes`: entry class → the stock class it stands for (a call adapter's): the stock
    class is accepted where the record names the entry's, as a submodule or as an attribute's
    object (an attention processor); any other class is not. cgbuild's lane switches are no
    configuration and are left out.
    """
    stands = dict(substitutes or {})
    config = recorded.get("config")
    if isinstance(config, Mapping):
        live = _config(module) or {}
        for name in sorted(set(config) | set(live)):
            old, new = config.get(name, "(absent)"), live.get(name, "(absent)")
            if old != new:
                return f"config {name} {show(old)} → {show(new)}"
    tree = recorded.get("tree")
    if not isinstance(tree, Mapping):
        return None
    for fqn, m in traced.walk(module):
        row = tree.get(fqn)
        if not isinstance(row, Mapping):
            continue
        where = fqn or "the module"
        skip = fqn == "" and traced_as is not None and row.get("class") == traced_as
        if not skip and not _same({"object": row.get("class")}, {"object": qualified(type(m))}, stands):
            return f"{where} is a {qualified(type(m))}, the program was traced with a {row.get('class')}"
        hyper = row.get("hyper")
        if not isinstance(hyper, Mapping):
            continue
        live = _hyper(m)
        for name in sorted(set(hyper) & set(live)):
            if not _same(hyper[name], live[name], stands):
                return f"{where}.{name} {show(hyper[name])} → {show(live[name])}"
    return None
