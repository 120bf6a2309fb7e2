"""Toolchain axis: wheel identity, membership per platform, ISA clamp, compiler choice, locks.

Distributions are real dist-info folders in temporary site-packages, read through the real
importlib.metadata; the compiler is a tiny script standing in for g++ unless a test is about the
system's own.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cgbuild.core.canon import canonical_json
from cgbuild.identity import compiler, policy, toolchain_changes
from cgbuild.identity import toolchain as tc

INTEL_V4 = "fpu cx8 cmov mmx fxsr sse sse2 pni ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt xsave avx f16c "
INTEL_V4 += "lahf_lm abm bmi1 avx2 bmi2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni amx_tile"
AMD_V3 = "fpu cx8 cmov mmx fxsr sse sse2 pni ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt xsave avx f16c "
AMD_V3 += "lahf_lm abm sse4a bmi1 avx2 bmi2 xsaveopt"


def _row_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_dist(
    site: Path,
    name: str,
    version: str,
    files: dict[str, bytes] | None = None,
    *,
    requires: tuple[str, ...] = (),
    installer: str = "pip",
    requested: bool = True,
    direct_url: str | None = None,
    script_shebang: str = "#!/usr/bin/python3",
    extra_meta: dict[str, bytes] | None = None,
) -> Path:
    """A dist-info folder as an installer leaves it: the wheel's files plus installer files."""
    folder = f"{name.replace('-', '_')}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    metadata += "".join(f"Requires-Dist: {r}\n" for r in requires)
    pkg = name.replace("-", "_")
    written = {
        f"{folder}/METADATA": metadata.encode(),
        f"{folder}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: false\n",
        f"{folder}/INSTALLER": installer.encode() + b"\n",
        f"{folder}/entry_points.txt": b"",
        **(files if files is not None else {f"{pkg}/__init__.py": f"V = {version!r}\n".encode()}),
    }
    if requested:
        written[f"{folder}/REQUESTED"] = b""
    if direct_url is not None:
        written[f"{folder}/direct_url.json"] = direct_url.encode()
    for rel, data in (extra_meta or {}).items():
        written[f"{folder}/{rel}"] = data
    rows = []
    for rel, data in written.items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        if rel.endswith("/ptxas") or "/ptxas-" in rel:
            path.chmod(0o755)
        rows.append(f"{rel},{_row_hash(data)},{len(data)}")
    script = f"{script_shebang}\nimport {pkg}\n".encode()
    rows.append(f"../../../bin/{pkg}-tool,{_row_hash(script)},{len(script)}")
    rows.append(f"{pkg}/__pycache__/__init__.cpython-311.pyc,,")
    rows.append(f"{folder}/RECORD,,")
    (site / folder / "RECORD").write_text("\n".join(rows) + "\n")
    return site / folder


def remove_dist(site: Path, name: str) -> None:
    for folder in site.glob(f"{name.replace('-', '_')}-*.dist-info"):
        shutil.rmtree(folder)


def fake_gxx(directory: Path, banner: str = "g++ (Fake 12.2.0-14) 12.2.0", name: str = "g++") -> Path:
    """A compiler stand-in that answers --version and counts its calls."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(
        f'#!/bin/sh\necho run >> "{directory}/calls"\necho "{banner}"\n'
        'echo "Copyright (C) 2022 Free Software Foundation, Inc."\n'
    )
    path.chmod(0o755)
    return path


def ptxas_script(path: Path, version: str) -> bytes:
    return f"#!/bin/sh\necho 'Cuda compilation tools, release 12.9, V{version}'\n".encode()


def cuda_site(site: Path, **bump: str) -> Path:
    """A CUDA-build environment: torch + triton + its native closure + trace-only libraries."""
    v = {"torch": "2.11.0+cu130", "triton": "3.6.0", "cublas": "13.0.2", "cudart": "13.0.96", **bump}
    make_dist(
        site,
        "torch",
        v["torch"],
        requires=(
            "sympy>=1.13.3",
            "triton>=3.6; platform_system == 'Linux'",
            "cuda-toolkit[cudart]==13.0.2; platform_system == 'Linux'",
            "nvidia-cudnn-cu13==9.13.0; platform_system == 'Linux'",
            "nvidia-nccl-cu13; extra == 'distributed'",
            "nvidia-cusparselt-cu13; platform_system == 'Linux'",
        ),
    )
    # The toolkit metapackage gates each library behind an extra; torch asks for some of them.
    make_dist(
        site,
        "cuda-toolkit",
        "13.0.2",
        requires=('nvidia-cuda-runtime==13.*; extra == "cudart"', 'nvidia-cufft==12.*; extra == "cufft"'),
    )
    make_dist(site, "nvidia-cuda-runtime", v["cudart"])
    make_dist(site, "nvidia-cufft", v.get("cufft", "12.0.0"))  # installed, but its extra is not asked
    make_dist(site, "nvidia-cudnn-cu13", "9.13.0", requires=("nvidia-cublas-cu13",))
    make_dist(site, "nvidia-cublas-cu13", v["cublas"])
    make_dist(site, "nvidia-nccl-cu13", "2.27.7")  # installed, but only behind an extra
    make_dist(site, "sympy", "1.14.0")
    make_dist(
        site,
        "triton",
        v["triton"],
        {
            "triton/__init__.py": f"__version__ = {v['triton']!r}\n".encode(),
            "triton/backends/nvidia/bin/ptxas": ptxas_script(site, "12.9.86"),
        },
    )
    make_dist(site, "diffusers", v.get("diffusers", "0.42.1"))
    return site


@pytest.fixture
def gxx(tmp_path: Path) -> Path:
    return fake_gxx(tmp_path / "cc")


def run_probe(site: Path, gxx: Path, **kw) -> dict:
    kw.setdefault("environ", {"PATH": os.defpath})
    return tc.probe(str(gxx), paths=[str(site)], **kw)


def folds(result: dict) -> dict[str, str]:
    return {p: tc.fold(b["components"]) for p, b in result.items()}


# --- wheel identity -----------------------------------------------------------------------------


def test_installer_files_do_not_move_a_wheel_but_its_files_do(tmp_path: Path) -> None:
    files = {"torch/__init__.py": b"x = 1\n", "torch/lib/libtorch_cpu.so": b"\x7fELF..."}
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    make_dist(a, "torch", "2.13.0+cpu", files, installer="pip", script_shebang="#!/venv-a/bin/python")
    make_dist(
        b,
        "torch",
        "2.13.0+cpu",
        files,
        installer="uv",
        requested=False,
        direct_url='{"url": "file:///wheels/torch.whl"}',
        script_shebang="#!/elsewhere/bin/python3.11",
        extra_meta={"uv_cache.json": b'{"timestamp": 1}'},
    )
    make_dist(c, "torch", "2.13.0+cpu", {**files, "torch/lib/libtorch_cpu.so": b"\x7fELF.patched"})
    ca, cb, cc = (tc.wheel_component("torch", [str(s)]) for s in (a, b, c))
    assert ca == cb
    assert ca["dist"] == "torch" and ca["version"] == "2.13.0+cpu"
    assert cc["digest"] != ca["digest"] and cc["version"] == ca["version"]


def test_own_rows_keeps_only_the_wheels_files() -> None:
    record = "\n".join(
        [
            "pkg/a.py,sha256=AAA,3",
            '"pkg/with,comma.py",sha256=BBB,4',
            "pkg/__pycache__/a.cpython-311.pyc,,",
            "pkg/b.pyc,sha256=CCC,5",
            "../../../bin/tool,sha256=DDD,6",
            "pkg-1.0.dist-info/METADATA,sha256=EEE,7",
            "pkg-1.0.dist-info/INSTALLER,sha256=FFF,4",
            "pkg-1.0.dist-info/REQUESTED,sha256=GGG,0",
            "pkg-1.0.dist-info/direct_url.json,sha256=HHH,9",
            "pkg-1.0.dist-info/RECORD,,",
        ]
    )
    assert tc.own_rows(record) == [
        ("pkg-1.0.dist-info/METADATA", "sha256=EEE"),
        ("pkg/a.py", "sha256=AAA"),
        ("pkg/with,comma.py", "sha256=BBB"),
    ]


def test_missing_record_is_a_named_error(tmp_path: Path) -> None:
    folder = make_dist(tmp_path, "torch", "2.13.0")
    (folder / "RECORD").unlink()
    with pytest.raises(tc.ToolchainError) as err:
        tc.wheel_component("torch", [str(tmp_path)])
    assert err.value.field == "RECORD" and err.value.path.endswith("RECORD")


# --- membership ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bump", "cpu_moves", "cuda_moves"),
    [
        ({"triton": "3.7.0"}, False, True),
        ({"torch": "2.11.1+cu130"}, True, True),
        ({"cublas": "13.0.3"}, False, True),  # reached only through nvidia-cudnn-cu13
        ({"cudart": "13.0.97"}, False, True),  # reached through cuda-toolkit[cudart]
        ({"cufft": "12.0.1"}, False, False),  # behind an extra nobody asked for
        ({"diffusers": "0.43.0"}, False, False),  # trace-only: arrives through the graph digest
    ],
)
def test_member_bumps(tmp_path: Path, gxx: Path, bump: dict, cpu_moves: bool, cuda_moves: bool) -> None:
    base = folds(run_probe(cuda_site(tmp_path / "base"), gxx))
    moved = folds(run_probe(cuda_site(tmp_path / "moved", **bump), gxx))
    assert (base["cpu"] != moved["cpu"]) is cpu_moves
    assert (base["cuda"] != moved["cuda"]) is cuda_moves


def test_cuda_closure_is_transitive_and_skips_extras(tmp_path: Path, gxx: Path) -> None:
    result = run_probe(cuda_site(tmp_path / "site"), gxx)
    cuda = result["cuda"]["components"]
    assert set(cuda) == {
        "torch",
        "triton",
        "ptxas",
        "cxx",
        "isa",
        "settings",
        "cuda-toolkit",
        "nvidia-cuda-runtime",
        "nvidia-cudnn-cu13",
        "nvidia-cublas-cu13",
    }
    assert set(result["cpu"]["components"]) == {"torch", "cxx", "isa", "settings"}
    assert result["cuda"]["forensics"]["cuda_missing"] == ["nvidia-cusparselt-cu13"]
    assert result["cuda"]["forensics"]["trace_only"]["diffusers"] == "0.42.1"


def test_absent_members_are_recorded(tmp_path: Path, gxx: Path) -> None:
    site = tmp_path / "site"
    make_dist(site, "torch", "2.13.0+cpu", requires=("sympy",))
    cuda = run_probe(site, gxx)["cuda"]["components"]
    assert cuda["triton"] == {"absent": True}
    assert cuda["ptxas"] == {"absent": True}


def test_two_tritons_are_refused(tmp_path: Path, gxx: Path) -> None:
    site = cuda_site(tmp_path / "site")
    make_dist(site, "pytorch-triton", "3.6.0+git1234")
    with pytest.raises(tc.ToolchainError) as err:
        run_probe(site, gxx)
    assert err.value.field == "triton"


def test_ptxas_bundled_version_and_recorded_override(tmp_path: Path, gxx: Path) -> None:
    site = cuda_site(tmp_path / "site")
    result = run_probe(site, gxx)
    ptxas = result["cuda"]["components"]["ptxas"]
    assert ptxas["bundled"]["ptxas"]["version"] == "12.9.86"
    row = ptxas_script(site, "12.9.86")
    assert ptxas["bundled"]["ptxas"]["hash"] == _row_hash(row)  # the bytes the triton digest covers

    other = tmp_path / "cuda-13.0" / "ptxas"
    other.parent.mkdir()
    other.write_bytes(ptxas_script(site, "13.0.88"))
    other.chmod(0o755)
    env = {"PATH": os.defpath, "TRITON_PTXAS_PATH": str(other)}
    overridden = run_probe(site, gxx, environ=env)
    assert overridden["cuda"]["components"]["ptxas"]["override"]["TRITON_PTXAS_PATH"]["version"] == "13.0.88"
    assert folds(overridden)["cuda"] != folds(result)["cuda"]
    assert folds(overridden)["cpu"] == folds(result)["cpu"]


# --- compiler and ISA ---------------------------------------------------------------------------


@pytest.mark.skipif(not os.path.exists(compiler.DEFAULT_CXX), reason="no distribution g++ here")
def test_compiler_choice_ignores_cxx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wrapper = fake_gxx(tmp_path / "wrapper", banner="g++ (GCC) 13.2.0 custom build", name="g++")
    monkeypatch.setenv("CXX", str(wrapper))
    monkeypatch.setenv("PATH", f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}")
    assert compiler.choose_cxx() == compiler.DEFAULT_CXX
    site = tmp_path / "site"
    make_dist(site, "torch", "2.13.0+cpu")
    result = tc.probe(paths=[str(site)])
    assert result["cpu"]["forensics"]["cxx_path"] == compiler.DEFAULT_CXX
    assert "custom build" not in result["cpu"]["components"]["cxx"]["banner"]
    assert not (wrapper.parent / "calls").exists()  # the wrapper never even ran


def test_explicit_compiler_override_is_used_and_identified(tmp_path: Path, gxx: Path) -> None:
    assert compiler.choose_cxx(str(gxx)) == str(gxx)
    assert compiler.choose_cxx("g++", search_path=str(gxx.parent)) == str(gxx)
    with pytest.raises(compiler.CompilerError):
        compiler.choose_cxx(str(tmp_path / "nope"))
    comp = compiler.cxx_component(str(gxx))
    assert (comp["family"], comp["version"]) == ("gcc", "12.2.0")
    assert comp["banner"] == "g++ (Fake 12.2.0-14) 12.2.0"
    assert "path" not in comp and str(gxx) not in json.dumps(comp)


@pytest.mark.parametrize(
    ("banner", "family", "version"),
    [
        ("g++ (Debian 12.2.0-14+deb12u1) 12.2.0", "gcc", "12.2.0"),
        ("g++ (Ubuntu 13.3.0-6ubuntu2~24.04) 13.3.0", "gcc", "13.3.0"),
        ("x86_64-linux-gnu-g++-12 (Debian 12.2.0-14) 12.2.0", "gcc", "12.2.0"),
        ("g++ (GCC) 11.5.0 20240719 (Red Hat 11.5.0-5)", "gcc", "11.5.0"),
        ("Ubuntu clang version 18.1.3 (1ubuntu1)", "clang", "18.1.3"),
        ("clang version 17.0.6", "clang", "17.0.6"),
        ("icpx (R) oneAPI DPC++/C++ Compiler 2024.1", None, None),
    ],
)
def test_compiler_banners(banner: str, family: str | None, version: str | None) -> None:
    assert compiler._identify(banner) == (family, version)


def test_unrecognised_compiler_is_a_named_error(tmp_path: Path) -> None:
    odd = fake_gxx(tmp_path / "odd", banner="icpx (R) oneAPI DPC++/C++ Compiler 2024.1", name="icpx")
    site = tmp_path / "site"
    make_dist(site, "torch", "2.13.0+cpu")
    with pytest.raises(tc.ToolchainError) as err:
        run_probe(site, odd)
    assert err.value.field == "toolchain.cxx"


@pytest.mark.parametrize(
    ("flags", "level"),
    [
        (INTEL_V4, "x86-64-v4"),
        (AMD_V3, "x86-64-v3"),
        (AMD_V3.replace(" abm", ""), "x86-64-v2"),  # LZCNT is printed as abm
        ("fpu cx8 cmov mmx fxsr sse sse2", "x86-64-v1"),
    ],
)
def test_x86_levels_use_cpuinfo_names(flags: str, level: str) -> None:
    assert compiler.x86_level(flags.split()) == level


def test_isa_identity_is_the_clamp_not_the_host(tmp_path: Path, gxx: Path) -> None:
    site = cuda_site(tmp_path / "site")
    # a torch whose Inductor can clamp host code (`cpp.march`); test_isa_keying.py covers one that can't
    (site / "torch" / "_inductor").mkdir(parents=True, exist_ok=True)
    (site / "torch" / "_inductor" / "config.py").write_text("class cpp:\n    march: str | None = None\n")
    infos = {}
    for name, flags in (("v3", AMD_V3), ("v4", INTEL_V4)):
        infos[name] = tmp_path / f"cpuinfo-{name}"
        infos[name].write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    r3 = run_probe(site, gxx, cpuinfo=str(infos["v3"]))
    r4 = run_probe(site, gxx, cpuinfo=str(infos["v4"]))
    assert folds(r3) == folds(r4)
    assert r3["cpu"]["forensics"]["host_isa"] == "x86-64-v3"
    assert r4["cpu"]["forensics"]["host_isa"] == "x86-64-v4"

    clamped = compiler.isa_component("x86_64")
    assert clamped == {"arch": "x86_64", "level": policy.ISA_CLAMP["x86_64"]["level"]}
    assert compiler.isa_refusal(clamped, "x86-64-v4", machine="x86_64") is None
    assert compiler.isa_refusal(clamped, "x86-64-v3", machine="x86_64") is None
    assert "below the clamp" in (compiler.isa_refusal(clamped, "x86-64-v2", machine="x86_64") or "")
    assert compiler.isa_refusal(compiler.isa_component("aarch64"), "aarch64", machine="aarch64")


# --- settings -----------------------------------------------------------------------------------


def test_settings_block_is_canonical_and_clamps_host_code() -> None:
    block = policy.settings_block()
    canonical_json(block)  # refuses floats and foreign types
    inductor = block["inductor"]
    assert inductor["aot_inductor.package_constants_in_so"] is False
    assert inductor["always_keep_tensor_constants"] is True
    assert inductor["aot_inductor.use_runtime_constant_folding"] is False
    assert (inductor["cpp.march"], inductor["cpp.simdlen"]) == ("x86-64-v3", 256)
    assert "aot_inductor.package" not in inductor
    assert "cpp.march" not in policy.settings_block("aarch64")["inductor"]
    with pytest.raises(policy.PolicyError):
        policy.inductor_configs("aarch64")


def test_mint_environment_scrubs_sets_and_records() -> None:
    environ = {
        "CXX": "/opt/gcc/bin/wrapper",
        "TORCHINDUCTOR_CACHE_DIR": "/shared/cache",
        "TORCHINDUCTOR_MAX_AUTOTUNE": "1",
        "TRITON_CACHE_DIR": "/shared/triton",
        "TRITON_PTXAS_PATH": "/usr/local/cuda/bin/ptxas",
        "ATEN_CPU_CAPABILITY": "avx512",
        "OMP_NUM_THREADS": "3",
        "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64",
        "CUDA_VISIBLE_DEVICES": "0",
        "PATH": "/usr/bin",
    }
    sandbox = {"TMPDIR": "/sb/tmp", "TORCHINDUCTOR_CACHE_DIR": "/sb/ind", "TRITON_CACHE_DIR": "/sb/tri"}
    env = policy.mint_environment(environ, sandbox)
    for gone in ("CXX", "TORCHINDUCTOR_MAX_AUTOTUNE", "ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS"):
        assert gone not in env
    assert env["TRITON_PTXAS_PATH"] == "/usr/local/cuda/bin/ptxas"
    assert env["LD_LIBRARY_PATH"] == "/usr/local/nvidia/lib64" and env["CUDA_VISIBLE_DEVICES"] == "0"
    assert env["PYTHONHASHSEED"] == "0"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/sb/ind" and env["TMPDIR"] == "/sb/tmp"
    with pytest.raises(policy.PolicyError):
        policy.mint_environment(environ, {"TMPDIR": "/sb/tmp"})


# --- locks and precedence -----------------------------------------------------------------------


def test_lock_round_trip(tmp_path: Path, gxx: Path) -> None:
    result = run_probe(cuda_site(tmp_path / "site"), gxx)
    lock = tmp_path / "toolchain.lock.json"
    tc.write_lock(str(lock), tc.lock_document(result))
    doc = tc.read_lock(str(lock))
    assert doc == tc.lock_document(result)
    assert {p: b["fold"] for p, b in doc["platforms"].items()} == folds(result)
    assert "forensics" not in lock.read_text() and str(gxx) not in lock.read_text()
    assert tc.torch_version(doc["platforms"]["cuda"]) == "2.11.0+cu130"


def test_unknown_component_in_a_lock_moves_the_fold(tmp_path: Path, gxx: Path) -> None:
    doc = tc.lock_document(run_probe(cuda_site(tmp_path / "site"), gxx))
    before = doc["platforms"]["cuda"]["fold"]
    del doc["platforms"]["cuda"]["fold"]
    doc["platforms"]["cuda"]["components"]["nvidia-cublas-cu14"] = {
        "dist": "nvidia-cublas-cu14",
        "version": "14.0.0",
        "digest": "0" * 64,
    }
    lock = tmp_path / "lock.json"
    lock.write_text(json.dumps(doc))
    assert tc.read_lock(str(lock))["platforms"]["cuda"]["fold"] != before


def test_precedence(tmp_path: Path, gxx: Path) -> None:
    cli_site = cuda_site(tmp_path / "cli", torch="2.12.0+cu130")
    cgfile_site = cuda_site(tmp_path / "cgfile", torch="2.11.0+cu130")
    cli, cgfile = tmp_path / "cli.lock.json", tmp_path / "cgfile.lock.json"
    tc.write_lock(str(cli), tc.lock_document(run_probe(cli_site, gxx)))
    tc.write_lock(str(cgfile), tc.lock_document(run_probe(cgfile_site, gxx)))

    def must_not_probe() -> dict:
        raise AssertionError("probed although a lock applies")

    toolchains, source = tc.resolve(str(cli), str(cgfile), must_not_probe)
    assert source == f"lock:{cli}" and tc.torch_version(toolchains["cuda"]) == "2.12.0+cu130"
    toolchains, source = tc.resolve(None, str(cgfile), must_not_probe)
    assert source == f"lock:{cgfile}" and tc.torch_version(toolchains["cpu"]) == "2.11.0+cu130"
    here = tmp_path / "here"
    make_dist(here, "torch", "2.13.0+cpu")
    toolchains, source = tc.resolve(None, None, lambda: run_probe(here, gxx))
    assert source == "probe" and tc.torch_version(toolchains["cpu"]) == "2.13.0+cpu"
    assert toolchains["cpu"]["fold"] == tc.fold(toolchains["cpu"]["components"])
    cache = tmp_path / "ws" / ".cgbuild" / "cache" / "toolchain.json"
    probed, source = tc.resolve(None, None, cxx=str(gxx), cache=cache, paths=[str(here)])
    assert source == "probe" and cache.exists()
    assert probed["cpu"]["fold"] == toolchains["cpu"]["fold"]


def _lock_with(tmp_path: Path, gxx: Path, edit) -> Path:
    site = tmp_path / "site"
    if not site.exists():
        make_dist(site, "torch", "2.13.0+cpu")
    doc = tc.lock_document(run_probe(site, gxx))
    raw = edit(doc)  # bytes: the whole file; anything else: `doc` was edited in place
    path = tmp_path / "bad.lock.json"
    path.write_bytes(raw if isinstance(raw, bytes) else json.dumps(doc).encode())
    return path


def _float_version(doc: dict) -> None:
    doc["platforms"]["cpu"]["components"]["torch"]["version"] = 2.13


def _edit_fold(doc: dict) -> None:
    """Move the ISA level to one this host does not have, so the recorded fold no longer matches."""
    isa = doc["platforms"]["cpu"]["components"]["isa"]
    isa["level"] = "x86-64-v2" if isa["level"] != "x86-64-v2" else "x86-64-v3"


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: b'{"schema": "cgbuild.toolchain-lock/1", "platforms": {', "$"),
        (lambda d: d.update(schema="cgbuild.toolchain-lock/0"), "schema"),
        (lambda d: d.update(platforms={}), "platforms"),
        (lambda d: d.update(extra=1), "extra"),
        (lambda d: d["platforms"].pop("cuda"), "platforms.cuda"),
        (lambda d: d["platforms"]["cpu"]["components"].pop("torch"), "platforms.cpu.components.torch"),
        (
            lambda d: d["platforms"]["cpu"]["components"].update(torch={"absent": True}),
            "platforms.cpu.components.torch",
        ),
        (
            lambda d: d["platforms"]["cpu"]["components"]["torch"].pop("digest"),
            "platforms.cpu.components.torch.digest",
        ),
        (_float_version, "platforms.cpu.components.torch"),
        (_edit_fold, "platforms.cpu.fold"),
        (lambda d: d["platforms"].update(cpu=[]), "platforms.cpu"),
        (lambda d: b'{"schema": "\xff"}', "$"),
        (lambda d: b"[" * 100_000 + b"]" * 100_000, "$"),
        (lambda d: d["platforms"]["cpu"]["components"].update(deep=json.loads("[" * 80 + "]" * 80)), "$"),
        (lambda d: b'{"schema": NaN}', "$"),
        (lambda d: d["platforms"]["cpu"]["components"].update(triton=[]), "platforms.cpu.components.triton"),
        (lambda d: d["platforms"]["cpu"].update(components=[]), "platforms.cpu.components"),
    ],
)
def test_malformed_lock_names_file_and_field(tmp_path: Path, gxx: Path, edit, field: str) -> None:
    path = _lock_with(tmp_path, gxx, edit)
    with pytest.raises(tc.ToolchainError) as err:
        tc.read_lock(str(path))
    assert (err.value.path, err.value.field) == (str(path), field)
    assert str(path) in str(err.value) and field in str(err.value)


def test_torch_version_of_a_torchless_toolchain_is_none() -> None:
    assert tc.torch_version({"components": {"torch": {"absent": True}}}) is None


# --- cache --------------------------------------------------------------------------------------


def test_probe_cache_hits_and_invalidates(tmp_path: Path, gxx: Path) -> None:
    site = cuda_site(tmp_path / "site")
    cache = tmp_path / "ws" / ".cgbuild" / "cache" / "toolchain.json"
    calls = gxx.parent / "calls"
    cold = run_probe(site, gxx, cache_path=str(cache))
    assert cache.exists() and calls.read_text().count("run") == 1
    compiler._cxx_component.cache_clear()  # what a new process starts with
    t0 = time.perf_counter()
    warm = run_probe(site, gxx, cache_path=str(cache))
    warm_s = time.perf_counter() - t0
    assert warm == cold and calls.read_text().count("run") == 1
    assert warm_s < 0.05, f"warm probe took {warm_s * 1000:.1f} ms"

    remove_dist(site, "triton")  # an upgrade replaces the dist-info folder
    make_dist(site, "triton", "3.7.0")
    bumped = run_probe(site, gxx, cache_path=str(cache))
    assert bumped["cuda"]["components"]["triton"]["version"] == "3.7.0"
    assert calls.read_text().count("run") == 2  # a miss re-reads everything, the compiler too

    cache.write_text("{not json")  # a damaged cache costs one cold probe, never an error
    assert run_probe(site, gxx, cache_path=str(cache)) == bumped


def test_engine_never_imports_torch(tmp_path: Path) -> None:
    code = (
        "import sys, cgbuild.identity.toolchain as t; t.probe(cache_path=sys.argv[1]); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "cache.json")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


# --- summaries ----------------------------------------------------------------------------------


def test_component_changes_read_like_a_changelog(tmp_path: Path, gxx: Path) -> None:
    old = run_probe(cuda_site(tmp_path / "old"), gxx)["cuda"]["components"]
    new = json.loads(json.dumps(old))
    new["triton"]["version"], new["triton"]["digest"] = "3.7.0", "1" * 64
    new["torch"]["digest"] = "2" * 64
    new["cxx"] = {"family": "gcc", "version": "13.3.0", "banner": "g++ (Ubuntu 13.3.0) 13.3.0", "digest": "3"}
    new["settings"]["inductor"]["cpp.threads"] = 16
    del new["nvidia-cublas-cu13"]
    changes = toolchain_changes.component_changes(old, new)
    lines = [toolchain_changes.format_change(c) for c in changes]
    assert [c[0] for c in changes] == ["cxx", "nvidia-cublas-cu13", "settings", "torch", "triton"]
    assert "triton 3.6.0 → 3.7.0" in lines
    assert "cxx gcc 12.2.0 → 13.3.0" in lines
    assert "torch 2.11.0+cu130 (files changed)" in lines
    assert "nvidia-cublas-cu13 13.0.2 → none" in lines
    assert "settings inductor.cpp.threads=8 → inductor.cpp.threads=16" in lines
    assert toolchain_changes.component_changes(old, old) == []
    env = json.loads(json.dumps(old))
    env["settings"]["env"]["scrub"] = [*env["settings"]["env"]["scrub"][1:], "CUDA_ROOT"]
    (change,) = toolchain_changes.component_changes(old, env)
    assert change == ("settings", "env.scrub", "env.scrub +CUDA_ROOT -ATEN_CPU_CAPABILITY")
