"""Adopt: serve a live module through its sealed artifacts, compiled when a call fits, else eager.

`adopt(artifact, module)` checks the artifact's recorded facts against this host BEFORE loading
anything (a package that cannot load here may segfault rather than raise): the device (`sm`),
the torch version (a package is ABI-locked to one torch), the host ISA (the host must support the
clamp level the code was built for), the host compiler family and the C/C++ runtime versions the
package's `.so` requires. It then loads through the package's C++ loader (milliseconds; the
Python `aoti_load_package` adds a ~2 s ISA probe per process), and binds the live module's
weights by FQN without copying, after checking every tensor's dtype, shape, stride and device
against the table the mint recorded.

Nothing on the call path raises because of the artifact: a refused artifact, a call outside its
contract (shapes, dtypes, devices, symbol ranges) or a compiled call that fails is served eager,
and the reason is named and counted. `adopt_manifest` adopts every graph class of a module in one
call and routes each call to the artifact whose contract fits.

The rooms: `host` (this host's facts against the artifact's), `contract` (a call against the
traced contract: `fit`), `bind` (weights, literals, configuration and layout bound and watched),
`artifact` (one artifact loaded and armed, its lane chosen), `state` (an adopted artifact's
states, armed, held, unloaded or replaced, and the transitions between them), `router`
(`Adopted`: each call routed to the artifact that fits, or served eager and named), `manifest`
(a serving manifest adopted), `refusal` (the typed reason a call or an artifact is served
eager), `copies` (what a copy of a served module holds where its router was).
"""

from cgbuild_rules.adopt.artifact import load_artifact
from cgbuild_rules.adopt.contract import fit
from cgbuild_rules.adopt.manifest import adopt_manifest
from cgbuild_rules.adopt.refusal import AdoptRefused, Refusal
from cgbuild_rules.adopt.router import Adopted, adopt, serve_checkpoint
from cgbuild_rules.adopt.state import Artifact

__all__ = [
    "AdoptRefused",
    "Adopted",
    "Artifact",
    "Refusal",
    "adopt",
    "adopt_manifest",
    "fit",
    "load_artifact",
    "serve_checkpoint",
]
