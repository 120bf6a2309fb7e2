"""Normalization, measured on torch 2.13 CPU with two compiles of one graph: the package's
top-level folder is its file's basename (fixed: `model`); each generated `.cpp` gets `// Compile
cmd` / `// Link cmd` comment blocks with absolute cache, temp and include paths appended, one more
block per warm-cache compile (stripped); the `// Triton kernels are embedded as comments in
<path>` line names the sandbox (replaced by `<sandbox>`); `.data/serialization_id` is derived from
the records' contents (recomputed by rewriting with torch's own archive writer, records sorted).
The `.so` and the generated file names depend on the cache path, which is why the sandbox path
is fixed. They depend on where torch is installed too (its include folder is in the compile
flags Inductor hashes, and in the `.so` line tables): the same venv reached through a symlinked
path renamed every kernel and wrapper file. Byte-identical packages across machines therefore
need torch at the same path; `mint --check` names the members that differ.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cgbuild_rules.mint.failure import MintFailure

from cgbuild.core.codes import Code
from cgbuild.store.seal import PACKAGE


def _check_clamp(text: str, march: str | None) -> None:
    """Every compile command Inductor recorded must carry the policy's -march (never native)."""
    flags = {tok for tok in text.split() if tok.startswith("-march=")}
    if march is not None and flags and flags != {f"-march={march}"}:
        raise MintFailure(Code.CLAMP_NOT_APPLIED, f"compile used {sorted(flags)}, policy says -march={march}")


def _strip_cpp(text: str, sandbox: str) -> str:
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line == "// Compile cmd" and all(not rest.strip() or rest.startswith("//") for rest in lines[i:]):
            lines = lines[:i]
            break
    return ("\n".join(lines).rstrip("\n") + "\n").replace(sandbox, "<sandbox>")


def normalize_package(src: Path, dest: Path, sandbox: str, march: str | None) -> dict[str, Any]:
    """Rewrite an AOTI package so it reproduces byte for byte (see the module docstring).

    Returns the package's AOTI metadata (device key, CPU ISA) read from its records, and under
    `runtime` the highest GLIBC/GLIBCXX/CXXABI versions its `.so` files require.
    """
    import zipfile

    import torch
    from cgbuild_rules.loader import required_runtime

    writer_owned = {".data/version", ".data/serialization_id", "byteorder"}
    with zipfile.ZipFile(src) as z:
        records = {info.filename.split("/", 1)[1]: z.read(info) for info in z.infolist()}
    if dest.name != PACKAGE:
        raise ValueError(f"the package must be written as {PACKAGE} (its top-level folder is its name)")
    aoti: dict[str, Any] = {}
    for name, data in records.items():
        if name.endswith(".wrapper_metadata.json"):
            aoti.update(json.loads(data))
    aoti["runtime"] = required_runtime(b"".join(d for n, d in sorted(records.items()) if n.endswith(".so")))
    writer = torch._C.PyTorchFileWriter(str(dest))
    writer.set_min_version(6)
    for name in sorted(records):
        if name in writer_owned:
            continue
        data = records[name]
        if name.endswith(".cpp"):
            text = data.decode()
            _check_clamp(text, march)
            data = _strip_cpp(text, sandbox).encode()
        writer.write_record(name, data, len(data))
    writer.write_end_of_file()
    return aoti
