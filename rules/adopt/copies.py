"""What a copy of a served module holds where the original holds its router.

`copy.deepcopy`, `pickle` and `torch.save` copy a module's `__dict__`, and a served module keeps
its router (`Adopted`) there, as its instance `forward` (or a method, `decode`). The router holds
a loaded package, which no copy can carry, bound to the ORIGINAL's tensors, which the copy does
not hold: a copied router would compute with the original's weights. So `Adopted` copies as an
`Unserved` stand-in: the copy runs its class's own method, as a module never adopted does, and
the original keeps serving untouched. A compiled-only module (its layout quantizes activations)
has no eager path that computes right, so its copy refuses every call with `CompiledRequired`,
naming the fix: adopt the copy.
"""

from __future__ import annotations

from typing import Any

from cgbuild_rules.adopt.refusal import AdoptRefused, CompiledRequired, Refusal
from cgbuild_rules.bound import Attached
from torch import nn

from cgbuild.core.codes import Code


class Unserved(Attached):
    """A copy's stand-in for its original's router: calls run `type(module).<name>`, or raise
    where the original never served eager (`compiled_only`, `strict`)."""

    def __init__(self, module: nn.Module, name: str, compiled_only: str | None, strict: bool) -> None:
        self.module = module
        self.name = name
        self.compiled_only = compiled_only
        self.strict = strict

    @property
    def refusal(self) -> Refusal:
        return Refusal(
            Code.COPY_NOT_ADOPTED,
            f"this {type(self.module).__name__} is a copy of a served module and holds no artifact: "
            "adopt the copy to serve it (adopt_pipeline on the copied pipeline, or adopt(...).install())",
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.compiled_only is not None:
            raise CompiledRequired(self.compiled_only, self.refusal)
        if self.strict:
            raise AdoptRefused(self.refusal)
        return self.eager(*args, **kwargs)

    @property
    def eager(self) -> Any:
        """The class's own method, bound to the copy: what it runs as a plain module."""
        return getattr(type(self.module), self.name).__get__(self.module)


def served_name(module: nn.Module, eager: Any) -> str:
    """The method of `module`'s class a router serves: its eager callable's name (`forward`,
    `decode`) when the class has it, else `forward`."""
    name = getattr(eager, "__name__", None)
    return name if isinstance(name, str) and callable(getattr(type(module), name, None)) else "forward"
