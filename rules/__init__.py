"""cgbuild's rules: the only code that imports torch (trace, mint, adopt).

Installed as `cgbuild_rules`. The engine runs these in child processes and talks to them in
canonical JSON, so a crash in the compiler never takes the engine down.
"""
