"""Adopt: host checks before loading, binding without copies, routing, eager with a named reason.

Uses the session's real artifacts (`minted`, support/minted.py), so adopting costs no compile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from cgbuild_rules.adopt import AdoptRefused, adopt, adopt_manifest, fit, serve_checkpoint
from support.artifacts import edited
from support.minted import minted, served_eager, session_dirs, tiny

from cgbuild.protocol.contract import CallContract
from cgbuild.store.local import Store
from cgbuild.store.seal import read_metadata, unseal

pytestmark = pytest.mark.slow


def test_a_lane_pinned_on_an_artifact_without_lanes_is_refused(
    art_a: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A pin the artifact cannot honour is an error, not a no-op: it carries no lane axes."""
    with pytest.raises(ValueError, match="carries no lanes"):
        adopt(art_a, tiny(tmp_path_factory), lane="cudnn")


def test_adopted_module_serves_compiled_and_binds_without_copying(
    art_a: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    m = tiny(tmp_path_factory)
    served = adopt(art_a, m)
    assert served.refusals == {} and len(served.armed) == 1
    x = torch.randn(1, 8, 64)
    with torch.no_grad():
        got, want = served(x), m(x)
        assert served.counters == {"compiled": 1}
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        m.fc1.weight.mul_(2.0)  # in place: the package reads the live storage
        torch.testing.assert_close(served(x), m(x), rtol=1e-5, atol=1e-6)
        m.fc2.weight = torch.nn.Parameter(torch.randn_like(m.fc2.weight))  # replaced: needs rebind
        served.rebind()
        torch.testing.assert_close(served(x), m(x), rtol=1e-5, atol=1e-6)
    assert served.counters == {"compiled": 3}
    served.install()
    with torch.no_grad():
        m(x)
    assert served.counters["compiled"] == 4
    served.release()
    assert "forward" not in m.__dict__


def test_calls_outside_the_contract_serve_eager_with_a_reason(
    art_a: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    m = tiny(tmp_path_factory)
    served = adopt(art_a, m)
    with torch.no_grad():
        out = served(torch.randn(2, 8, 64))
    assert out.shape == (2, 8, 4)
    assert served.counters == {"eager:out-of-envelope": 1}
    assert served.last_reason is not None and "x dim 0: 2, artifact takes 1" in served.last_reason.detail
    contract = CallContract.from_json(read_metadata(art_a)["graph"]["contract"])
    assert fit(contract, (torch.randn(1, 8, 64, dtype=torch.float64),), {})[0].code == "dtype"
    assert fit(contract, (torch.randn(1, 8, 64),), {"extra": 1})[0].code == "call-structure"
    assert fit(contract, ([torch.randn(1, 8, 64)],), {})[0] is None  # a one-leaf list flattens alike
    assert fit(contract, ("text",), {})[0].code == "not-a-tensor"


@pytest.mark.parametrize(
    ("edit", "code", "needle"),
    [
        (lambda m: m.update(torch="2.0.0+cpu"), "torch-version", "2.0.0+cpu"),
        (lambda m: m.update(sm="sm_90"), "wrong-sm", "sm_90"),
        (lambda m: m["host"]["isa"].update(arch="aarch64"), "host-isa", "aarch64"),
        (lambda m: m["host"]["isa"].update(level="x86-64-v9"), "host-isa", "x86-64-v9"),
        (lambda m: m["host"]["cxx"].update(family="msvc"), "compiler-family", "msvc"),
        (lambda m: m["host"]["runtime"].update(GLIBC="9.99"), "host-runtime", "GLIBC_9.99"),
    ],
)
def test_host_facts_are_checked_before_loading(
    art_a: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, edit: Any, code: str, needle: str
) -> None:
    bad = edited(art_a, tmp_path / "bad.tar.gz", edit)
    refusal = served_eager(bad, tiny(tmp_path_factory), code)
    assert needle in refusal.detail


def test_live_weights_are_checked_by_fqn(art_a: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    (wrong_shape,) = adopt(art_a, tiny(tmp_path_factory, hidden=16)).refusals.values()
    assert wrong_shape.code == "weights-mismatch" and "fc1.bias: shape [16]" in wrong_shape.detail
    m = tiny(tmp_path_factory)
    m.fc1.weight = torch.nn.Parameter(m.fc1.weight.detach().t().contiguous().t())  # same values, column-major
    strided = adopt(art_a, m)
    assert (
        "fc1.weight: stride [1, 32], artifact takes [64, 1]" in next(iter(strided.refusals.values())).detail
    )
    m = tiny(tmp_path_factory)
    m.fc2.weight = torch.nn.Parameter(m.fc2.weight.detach().double())
    assert next(iter(adopt(art_a, m).refusals.values())).detail.startswith("fc2.weight: dtype float64")
    m = tiny(tmp_path_factory)
    m.head = m.fc2
    del m.fc2
    missing = next(iter(adopt(art_a, m).refusals.values()))
    assert missing.code == "weights-missing" and "fc2" in missing.detail


def test_a_table_naming_more_than_the_package_binds_adopts(
    art_a: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Artifacts sealed before the table was cut to the package's own list name every tensor the
    export lifted (the stored H200 archives among them): adopt binds what the package names."""
    ghost = {"fqn": "encoder.weight", "dtype": "float32", "shape": [3], "stride": [1]}
    older = edited(art_a, tmp_path / "older.tar.gz", lambda meta: meta["constants"]["state"].append(ghost))
    m = tiny(tmp_path_factory)  # holds no encoder.weight
    m.register_buffer("extra", torch.zeros(3))  # and tensors no artifact names
    served = adopt(older, m, strict=True)
    with torch.no_grad():
        x = torch.randn(1, 8, 64)
        torch.testing.assert_close(served(x), m(x), rtol=1e-5, atol=1e-6)
    assert served.counters == {"compiled": 1}


def test_adopt_from_the_store_verifies_and_never_fails_a_call(
    art_a: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    store = Store(tmp_path / "store")
    key = read_metadata(art_a)["key"]
    assert store.admit(key, art_a).status == "admitted"
    m = tiny(tmp_path_factory)
    assert adopt(key, m, store=store).armed
    assert next(iter(adopt("ff" * 32, m, store=store).refusals.values())).code == "missing"
    obj = store.object_path(store.read_ref(key).object)  # type: ignore[union-attr]
    os.chmod(obj, 0o644)
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0xFF
    obj.write_bytes(bytes(data))
    served = adopt(key, m, store=store)
    assert next(iter(served.refusals.values())).code == "corrupt" and store.ref_state(key) == "quarantined"
    with torch.no_grad():
        assert served(torch.randn(1, 8, 64)).shape == (1, 8, 4)
    assert served.counters == {"eager:corrupt": 1}


def test_manifest_routes_each_call_to_the_class_that_fits(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    store = Store(tmp_path / "store")
    classes = {}
    for name in ("A", "B"):
        _, result = minted(tmp_path_factory, name)
        store.admit(result["key"], result["artifact"])
        classes[read_metadata(result["artifact"])["facets"][0]["graph_class"]] = result["key"]
    manifest = {
        "schema": "cgbuild.serving-manifest/1",
        "modules": {"mlp": classes, "absent": {"x": "00" * 32}},
    }
    m = tiny(tmp_path_factory)
    served = adopt_manifest(manifest, {"mlp": m}, store=store)["mlp"]
    assert [a.label for a in served.armed] == ["8x64-b1", "4x64-b2-16"]  # static before dynamic
    with torch.no_grad():
        for shape in ((1, 8, 64), (5, 4, 64), (16, 4, 64)):
            x = torch.randn(*shape)
            torch.testing.assert_close(served(x), m(x), rtol=1e-5, atol=1e-6)
        assert served.counters == {"compiled": 3}
        served(torch.randn(1, 3, 64))
        assert served.last_reason is not None and served.last_reason.code == "out-of-envelope"
        served(torch.randn(17, 4, 64))
    assert served.counters["eager:out-of-envelope"] == 2
    assert "closest 4x64-b2-16: x dim 0: 17 outside" in served.last_reason.detail  # 1 past its range


_FIRST_OUTPUT = textwrap.dedent(
    """
    import json, sys, time
    t0 = time.perf_counter()
    import torch
    t1 = time.perf_counter()
    from cgbuild_rules.adopt import adopt
    t2 = time.perf_counter()
    sys.path.insert(0, sys.argv[2])
    import tiny_entry
    m = tiny_entry.Tiny(64).eval()
    t3 = time.perf_counter()
    served = adopt(sys.argv[1], m)
    t4 = time.perf_counter()
    with torch.no_grad():
        served(torch.randn(1, 8, 64))
    t5 = time.perf_counter()
    assert served.counters == {"compiled": 1}, served.counters
    print(json.dumps({"import_torch": t1 - t0, "import_adopt": t2 - t1, "adopt": t4 - t3,
                      "first_call": t5 - t4, "adopt_to_first_output": t5 - t3}))
    """
)
_LOAD = textwrap.dedent(
    """
    import json, sys, time
    import torch
    t = time.perf_counter()
    if sys.argv[2] == "aoti_load_package":
        torch._inductor.aoti_load_package(sys.argv[1])
    else:
        from cgbuild_rules.loader import Package
        Package(sys.argv[1])
    print(json.dumps({sys.argv[2]: time.perf_counter() - t}))
    """
)


def _child(code: str, *args: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_adopt_to_first_output_in_a_fresh_process(
    art_a: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root, _ = session_dirs(tmp_path_factory)
    timings = _child(_FIRST_OUTPUT, str(art_a), str(root))
    pt2 = unseal(art_a, tmp_path / "u")["model.pt2"]
    loads = {**_child(_LOAD, str(pt2), "aoti_load_package"), **_child(_LOAD, str(pt2), "cxx_loader")}
    print("\nadopt timings (s):", json.dumps({k: round(v, 4) for k, v in {**timings, **loads}.items()}))
    assert timings["adopt_to_first_output"] < 2.0
    assert loads["cxx_loader"] < loads["aoti_load_package"]


def test_package_refuses_to_run_before_binding(art_a: Path, tmp_path: Path) -> None:
    from cgbuild_rules.loader import NotBound, Package

    package = Package(unseal(art_a, tmp_path)["model.pt2"])
    with pytest.raises(NotBound):  # calling it now would segfault the process
        package(torch.randn(1, 8, 64))


def test_store_key_and_constant_table_witnesses(
    art_a: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    m = tiny(tmp_path_factory)
    store = Store(tmp_path / "store")
    store.admit("cd" * 32, art_a)  # stored under a key its metadata does not name
    (wrong_key,) = adopt("cd" * 32, m, store=store).refusals.values()
    assert wrong_key.code == "key-mismatch"
    forgetful = edited(art_a, tmp_path / "f.tar.gz", lambda meta: meta["constants"].update(literal=[]))
    (table,) = adopt(forgetful, m).refusals.values()
    assert table.code == "constant-table-mismatch" and "scale" in table.detail


def test_a_failing_compiled_call_is_served_eager_and_disarms(
    art_a: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    m = tiny(tmp_path_factory)
    served = adopt(art_a, m)
    loaded = served.armed[0].loaded
    assert loaded is not None
    package = loaded.package

    def broken(flat: Any) -> Any:
        raise RuntimeError("kernel launch failed")

    package.run_flat = broken  # type: ignore[method-assign]
    x = torch.randn(1, 8, 64)
    with torch.no_grad():
        torch.testing.assert_close(served(x), m(x))
        served(x)
    assert served.armed == [] and served.counters == {"eager:compiled-error": 2}


def test_serve_from_a_checkpoint_without_the_models_code(
    art_a: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The artifact bound to a checkpoint's tensors alone: compiled, no copies, a weight swap
    through rebind, and no eager path to fall back to (a refused call raises by name)."""
    from cgbuild_rules.weights import read_checkpoint, write_checkpoint

    m = tiny(tmp_path_factory, seed=3)
    path = write_checkpoint(m, tmp_path_factory.mktemp("ckpt") / "w.safetensors")
    tensors = read_checkpoint(path, "cpu")
    served = serve_checkpoint(art_a, tensors)
    x = torch.randn(1, 8, 64)
    with torch.no_grad():
        torch.testing.assert_close(served(x), m(x), rtol=1e-5, atol=1e-6)
        swapped = {k: v * 0.5 for k, v in tensors.items()}  # new weights of the same layout
        served.module.load_state_dict(swapped, assign=True)
        served.rebind()
        m.load_state_dict(swapped)
        torch.testing.assert_close(served(x), m(x), rtol=1e-5, atol=1e-6)
        with pytest.raises(AdoptRefused, match="out-of-envelope"):
            served(torch.randn(1, 9, 64))  # outside the contract, and no eager to serve it
    assert served.counters == {"compiled": 2}
    with pytest.raises(AdoptRefused, match="weights-missing"):
        serve_checkpoint(art_a, {k: v for k, v in tensors.items() if k != "fc1.weight"})
    with pytest.raises(AdoptRefused, match="weights-mismatch"):
        serve_checkpoint(art_a, {**tensors, "fc1.weight": tensors["fc1.weight"].double()})
