"""The `layout` key axis: quant(topology), identified by a digest pair.

TOPOLOGY (`cgbuild.identity.topology`) is which tensors a module has; the QUANT RULE
(`cgbuild.identity.quantrule`) is what their bytes mean. The axis's identity is the two digests
alone. Display names (`flux2-klein.transformer@1+int8-rowwise@1`) are for people and never parsed.
This module and both of those never import torch.
"""

from __future__ import annotations

from cgbuild.identity.keys import LAYOUT, Axis
from cgbuild.identity.quantrule import QuantRule
from cgbuild.identity.topology import TOPOLOGY_SCHEME


def layout_identity(topology: str, quant: QuantRule) -> dict[str, str]:
    """The layout axis's identity block: the digest pair, and nothing else."""
    return {"topology": topology, "quant": quant.digest}


def layout_stamp(family: str, component: str, quant: QuantRule) -> str:
    """`<family>.<component>@<topology scheme>+<rule>@<version>`: for people, never parsed."""
    return f"{family}.{component}@{TOPOLOGY_SCHEME}+{quant.display}"


def layout_axis(family: str, component: str, quant: QuantRule, topology: str, source: str) -> Axis:
    """The layout axis; its identity holds digests only."""
    return LAYOUT.axis(
        {
            **layout_identity(topology, quant),
            "stamp": layout_stamp(family, component, quant),
            "topology_source": source,
            "quant_rule": quant.display,
        }
    )
