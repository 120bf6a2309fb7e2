"""cgbuild: a declarative build tool for compiled PyTorch graphs.

The engine in this package never imports torch: everything that needs torch lives in
`cgbuild_rules` (the `rules/` folder) and runs in child processes, so a warm `cgbuild plan`
costs what parsing a Cgfile and hashing small JSON costs.
"""

__version__ = "0.1.0"
