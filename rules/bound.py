"""Is the live module still the module the package was bound to? Asked before every compiled call.

A package reads the tensors it was bound to, not the module: after `weight.data = ...`, a new
`nn.Parameter`, `module.to(...)`, a submodule swapped for another (an injected adapter, a
wrapper), a hook or a `forward` override on a submodule, or a train/eval switch, eager computes
something the package does not. `Watch` snapshots, at bind, what each of those reads, by object
identity, and `moved()` answers in one pass over the bound tensors and the module tree:

- per bound tensor (every name it has): the table entry (`_parameters`, `_buffers` or the
  attribute) still holds the same tensor object, with the bound data pointer, shape and strides
  (`.data =` a view of its own storage keeps the pointer, not the layout), and no instance
  attribute of its owner shadows it (`lin.__dict__["weight"] = ...`: eager reads that);
- per submodule: its parent still holds it under that name and no instance attribute of the
  parent shadows it, its class and that class's `forward` (a patched class), `training` flag,
  number of children and whether it has forward hooks or an instance `forward` are as they were;
- per submodule, every public attribute that is not a tensor or a module (a norm's `eps`, an
  attention's `heads` and `processor`: what the program baked in) holds the same value;
- torch's global forward hooks, present or not, are as they were.

In-place updates (`add_`, `copy_`, `fuse_lora()`'s default) keep every one of these: the package
sees them, and nothing moves. The cost is a few attribute reads per tensor and per submodule
(benchmarks/bind_check.py measures it against a step).

What the module must be held to at bind and re-arm is the module as traced, not as bound:
`cgbuild_rules.traced`. This watch only sees what moved since.
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _torch_module


@dataclass(frozen=True)
class Moved:
    """What moved first: a tensor or submodule by FQN (`""`: the module itself), and how."""

    name: str
    how: str

    def __str__(self) -> str:
        return f"{self.name or 'the module'} {self.how}"


_GONE = object()
_data_ptr = torch.Tensor.data_ptr
_size = operator.attrgetter("shape")
_stride = torch.Tensor.stride
_training = operator.attrgetter("training")
_forward = operator.attrgetter("forward")


def _plain(value: Any) -> bool:
    """A value compared by `==` (numbers, strings, tuples of them); any other by identity."""
    if value is None or isinstance(value, bool | int | float | str):
        return True
    return isinstance(value, tuple) and all(_plain(v) for v in value)


def qualified(cls: type) -> str:
    """`torch.nn.modules.linear.Linear`: a class by its full name (peft's LoRA layer is a `Linear` too)."""
    return f"{cls.__module__}.{cls.__qualname__}"


class Attached:
    """A router set on a module to serve its calls (`Adopted`): not a setting of the module."""


def settings(m: nn.Module) -> Iterator[tuple[str, Any]]:
    """A module's own public attributes that are neither tensors nor modules (`eps`, `heads`,
    `processor`): what a traced program bakes in as constants. `training` is watched apart, and
    a router attached to serve the module's calls is none of them."""
    for name, value in m.__dict__.items():
        kept = isinstance(value, torch.Tensor | nn.Module | Attached)
        if not (name.startswith("_") or name == "training" or kept):
            yield name, value


def _hook_counts(m: nn.Module) -> tuple[int, int, bool]:
    """(forward hooks, forward pre-hooks, an instance `forward`) of a submodule."""
    return len(m._forward_hooks), len(m._forward_pre_hooks), "forward" in m.__dict__


def _hooks_text(counts: tuple[int, int, bool]) -> str:
    hooks, pre, override = counts
    return f"{hooks} forward hook(s), {pre} pre-hook(s){' and a forward override' if override else ''}"


def global_hooks() -> bool:
    return bool(_torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks)


def _table(owner: nn.Module, name: str) -> dict[str, Any]:
    if name in owner._parameters:
        return owner._parameters
    if name in owner._buffers:
        return owner._buffers
    return owner.__dict__


class Watch:
    """A bind's snapshot of `module`, for the tensors named in `names` (the bound FQNs and
    their tied aliases) that the module holds."""

    def __init__(self, module: nn.Module, names: Collection[str]) -> None:
        self.root = module
        self.names = frozenset(names)
        self.root_kids = len(module._modules)
        self.root_class = type(module)
        self.root_training = module.training
        self.global_hooks = global_hooks()
        self._shadowed: list[tuple[str, dict[str, Any], str]] = []
        """(FQN, the owner's instance dict, name) of every bound parameter, buffer and submodule."""
        tensors: list[tuple[str, dict[str, Any], str, torch.Tensor, int, torch.Size, tuple[int, ...]]] = []
        for fqn in sorted(names):
            prefix, _, name = fqn.rpartition(".")
            try:
                owner = module.get_submodule(prefix) if prefix else module
            except AttributeError:
                continue
            table = _table(owner, name)
            t = table.get(name)
            if isinstance(t, torch.Tensor):
                tensors.append((fqn, table, name, t, t.data_ptr(), t.shape, t.stride()))
                if table is not owner.__dict__:  # a parameter or buffer: no attribute may hide it
                    self._shadowed.append((fqn, owner.__dict__, name))
        self.tensors = tensors
        edges: list[tuple[str, dict[str, Any], str, nn.Module, type, bool, int, tuple[int, int, bool]]] = []
        values: list[tuple[str, dict[str, Any], str, Any]] = []
        for fqn, parent in module.named_modules(remove_duplicate=False):  # one walk for both
            for name, value in settings(parent):
                values.append((f"{fqn}.{name}" if fqn else name, parent.__dict__, name, value))
            for name, child in parent._modules.items():
                if child is None:
                    continue
                where = f"{fqn}.{name}" if fqn else name
                state = (type(child), child.training, len(child._modules), _hook_counts(child))
                edges.append((where, parent._modules, name, child, *state))
                self._shadowed.append((where, parent.__dict__, name))
        self.edges = edges
        self.values = values
        self._columns()

    def _columns(self) -> None:
        """The snapshot as parallel lists, so `unchanged` compares each in one C-level pass."""
        self._tables = [r[1] for r in self.tensors]
        self._tnames = [r[2] for r in self.tensors]
        self._tensors = [r[3] for r in self.tensors]
        self._ptrs = [r[4] for r in self.tensors]
        self._sizes = [r[5] for r in self.tensors]
        self._strides = [r[6] for r in self.tensors]
        self._kids = [r[1] for r in self.edges]
        self._knames = [r[2] for r in self.edges]
        self._children = [r[3] for r in self.edges]
        self._classes = [r[4] for r in self.edges]
        self._modes = [r[5] for r in self.edges]
        self._grandkids = [r[3]._modules for r in self.edges]
        self._counts = [r[6] for r in self.edges]
        self._hooks = [r[3]._forward_hooks for r in self.edges]
        self._pre_hooks = [r[3]._forward_pre_hooks for r in self.edges]
        self._dicts = [r[3].__dict__ for r in self.edges]
        self._hook_counts = [r[7][0] for r in self.edges]
        self._pre_hook_counts = [r[7][1] for r in self.edges]
        self._overrides = [r[7][2] for r in self.edges]
        self._forwards = [_forward(r[4]) for r in self.edges]
        self.root_forward = _forward(self.root_class)
        self._owners = [r[1] for r in self._shadowed]
        self._owned = [r[2] for r in self._shadowed]
        self._shadows = list(map(operator.contains, self._owners, self._owned))
        plain = [r for r in self.values if _plain(r[3])]
        other = [r for r in self.values if not _plain(r[3])]
        self._plain_dicts, self._plain_names = [r[1] for r in plain], [r[2] for r in plain]
        self._plain_values = [r[3] for r in plain]
        self._object_dicts, self._object_names = [r[1] for r in other], [r[2] for r in other]
        self._objects = [r[3] for r in other]

    def bound_tensors(self) -> list[torch.Tensor]:
        """The tensors the package reads, as bound."""
        return self._tensors

    def unchanged(self) -> bool:
        """True when nothing the snapshot holds moved: one C-level pass per column."""
        root = self.root
        return (
            all(map(operator.is_, map(dict.get, self._tables, self._tnames), self._tensors))
            and list(map(_data_ptr, self._tensors)) == self._ptrs
            and list(map(_size, self._tensors)) == self._sizes
            and list(map(_stride, self._tensors)) == self._strides
            and all(map(operator.is_, map(dict.get, self._kids, self._knames), self._children))
            and list(map(type, self._children)) == self._classes
            and list(map(_training, self._children)) == self._modes
            and list(map(len, self._grandkids)) == self._counts
            and list(map(len, self._hooks)) == self._hook_counts
            and list(map(len, self._pre_hooks)) == self._pre_hook_counts
            and list(map(operator.contains, self._dicts, repeat("forward"))) == self._overrides
            and all(map(operator.is_, map(_forward, self._classes), self._forwards))
            and list(map(operator.contains, self._owners, self._owned)) == self._shadows
            and list(map(dict.get, self._plain_dicts, self._plain_names, repeat(_GONE))) == self._plain_values
            and all(map(operator.is_, map(dict.get, self._object_dicts, self._object_names), self._objects))
            and len(root._modules) == self.root_kids
            and type(root) is self.root_class
            and _forward(self.root_class) is self.root_forward
            and root.training is self.root_training
            and global_hooks() is self.global_hooks
        )

    def moved(self) -> Moved | None:
        """The first thing that differs from the snapshot, or None (the package may run)."""
        if self.unchanged():
            return None
        for fqn, table, name, t, ptr, size, stride in self.tensors:
            held = table.get(name)
            if held is not t:
                return Moved(fqn, "was replaced by another tensor" if held is not None else "was removed")
            if t.data_ptr() != ptr:
                return Moved(fqn, "holds another storage (.data assigned, or moved to another device/dtype)")
            if t.shape != size or t.stride() != stride:  # `.data =` a view of its own storage
                return Moved(
                    fqn, f"is now {list(t.shape)} with stride {list(t.stride())} over the bound storage"
                )
        for (where, owner, name), was in zip(self._shadowed, self._shadows, strict=True):
            if name in owner and not was:
                return Moved(where, f"is shadowed by an instance attribute: {SHADOW_FIX}")
        for where, kids, name, child, cls, training, n, hooks in self.edges:
            if (now := kids.get(name)) is not child:
                how = "was removed" if now is None else f"was replaced by a {qualified(type(now))}"
                return Moved(where, how)
            if type(child) is not cls:
                return Moved(where, f"changed class to {qualified(type(child))}")
            if child.training is not training:
                return Moved(where, f"was switched to {'train' if child.training else 'eval'} mode")
            if len(child._modules) != n:
                return Moved(where, f"has {len(child._modules)} submodules, {n} when bound")
            if (now_hooks := _hook_counts(child)) != hooks:
                return Moved(where, f"has {_hooks_text(now_hooks)}, {_hooks_text(hooks)} when bound")
        for (where, *_), cls, forward in zip(self.edges, self._classes, self._forwards, strict=True):
            if _forward(cls) is not forward:
                return Moved(where, f"runs another forward: {qualified(cls)}.forward was replaced")
        for where, attrs, name, value in self.values:
            now = attrs.get(name, _GONE)
            if now is not value and not (_plain(value) and now == value):
                return Moved(where, "was removed" if now is _GONE else f"changed from {value!r} to {now!r}")
        root = self.root
        if len(root._modules) != self.root_kids:
            return Moved("", f"has {len(root._modules)} submodules, {self.root_kids} when bound")
        if type(root) is not self.root_class:
            return Moved("", f"changed class to {qualified(type(root))}")
        if _forward(self.root_class) is not self.root_forward:
            return Moved("", f"runs another forward: {qualified(self.root_class)}.forward was replaced")
        if root.training is not self.root_training:
            return Moved("", f"was switched to {'train' if root.training else 'eval'} mode")
        if global_hooks() is not self.global_hooks:
            return Moved("", "sees torch's global forward hooks changed")
        return Moved("", "changed since it was bound")  # `unchanged` saw what the walk above did not


SHADOW_FIX = (
    "eager reads the attribute, the program the module's own; delete it "
    "(del owner.__dict__[name]) or assign the tensor through the module"
)

ADAPTER_HINT = (
    "an adapter layer (PEFT LoRA) wraps it, unfused: fuse it into the weights and remove the "
    "adapter layers (diffusers: fuse_lora() then unload_lora(); peft: merge_and_unload()), then rebind()"
)


def adapter_wrapped(names: Collection[str]) -> str | None:
    """The first module an unfused adapter wraps, read from the live tensor names (`x.base_layer.w`)."""
    for name in sorted(names):
        if ".base_layer." in name:
            return name.split(".base_layer.")[0]
    return None
