"""The tiny MLP's real mints (AOTInductor on the CPU), made once per session and shared by every
test module that adopts, forges or serves from them, with the requests and jobs that make them.

Compiles are the expensive part (tens of seconds each on a 2-core box), so `minted(factory, name)`
is memoised here for the whole session: the first module to ask for class A (a static class with a
trace-baked literal) or B (a dynamic-batch class, for routing) pays for its compile.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import torch

ENTRY = textwrap.dedent(
    '''
    """A tiny MLP with a trace-baked literal (a non-persistent buffer)."""
    import torch
    from torch import nn


    class Tiny(nn.Module):
        def __init__(self, features: int, hidden: int = 32, out: int = 4) -> None:
            super().__init__()
            self.fc1 = nn.Linear(features, hidden)
            self.fc2 = nn.Linear(hidden, out)
            self.register_buffer("scale", torch.linspace(0.5, 1.5, hidden), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(torch.nn.functional.gelu(self.fc1(x)) * self.scale)


    def build(spec):
        model = Tiny(spec["width"])
        dyn = spec["config"].get("dynamic_batch")
        if dyn:
            x = torch.randn(max(spec["batch"], 2), spec["height"], spec["width"])
            return model, (x,), {}, {"x": {0: torch.export.Dim("batch", min=dyn[0], max=dyn[1])}}
        return model, (torch.randn(spec["batch"], spec["height"], spec["width"]),), {}
    '''
)
CLASSES: dict[str, dict[str, Any]] = {
    "A": {"graph_class": "8x64-b1", "height": 8, "batch": 1, "config": {}},
    "B": {"graph_class": "4x64-b2-16", "height": 4, "batch": 2, "config": {"dynamic_batch": [2, 16]}},
}
_MINTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
ANNOUNCED: dict[str, list[str]] = {}
"""Request id → the phases its worker announced, in order."""


def session_dirs(factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(entry root, sandbox) shared by every mint of the session; the sandbox path is fixed."""
    base = factory.getbasetemp()
    root, sandbox = base / "entry", base / "sandbox"
    if not root.exists():
        root.mkdir()
        (root / "tiny_entry.py").write_text(ENTRY)
    return root, sandbox


def job_for(root: Path, name: str, device: str = "cpu") -> dict[str, Any]:
    c = CLASSES[name]
    spec = {
        "family": "tiny",
        "module": "mlp",
        "graph_class": c["graph_class"],
        "height": c["height"],
        "width": 64,
        "text_len": None,
        "batch": c["batch"],
        "dtype": "float32",
        "device": device,
    }
    return {
        "id": name,
        "entry": "tiny_entry:build",
        "root": str(root),
        "config": c["config"],
        "spec": spec,
        "quant": "plain.fp32",
    }


def request_for(job: dict[str, Any], out: Path, sandbox: Path, **extra: Any) -> dict[str, Any]:
    """A request as the engine builds it: digest from a fake-mode trace, toolchain from a probe."""
    from cgbuild_rules.trace import export_job

    from cgbuild.identity import keys, toolchain

    _, facts = export_job(job, "fake")
    block = toolchain.probe()["cpu"]
    fold = toolchain.fold(block["components"])
    axes = {
        "graph": keys.graph_axis(facts["graph_digest"], torch=facts["torch"], nodes=facts["nodes"]),
        "sm": keys.sm_axis("cpu"),
        "toolchain": keys.toolchain_axis("cpu", fold, "probe"),
        "layout": keys.Axis({"stamp": "tiny.mlp@1+plain.fp32@1"}, {"stamp": "tiny.mlp@1+plain.fp32@1"}),
    }
    return {
        "schema": "cgbuild.mint-request/1",
        "id": job["id"],
        "key": keys.key_of(axes),
        "labels": [],
        "job": job,
        "sm": "cpu",
        "graph_digest": facts["graph_digest"],
        "toolchain": {"platform": "cpu", "fold": fold, "components": block["components"]},
        "axes": {name: axis.readable for name, axis in axes.items()},
        "facets": [{"graph_class": job["spec"]["graph_class"]}],
        "stamp": "tiny.mlp@1+plain.fp32@1",
        "out": str(out),
        "sandbox": str(sandbox),
        **extra,
    }


def run_worker(request: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "cgbuild_rules.mint"],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    # progress lines ({"id", "progress"}) come first; exactly one result line ends the output
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{") and '"progress"' not in ln]
    assert len(lines) == 1, (
        f"exactly one result line expected; stdout={proc.stdout!r} stderr={proc.stderr[-2000:]}"
    )
    said = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{") and '"progress"' in ln]
    ANNOUNCED[str(request.get("id"))] = [str(m["progress"]) for m in said]
    return json.loads(lines[0])


def minted(factory: pytest.TempPathFactory, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(request, result) of the session's one real mint of class `name`."""
    if name not in _MINTS:
        root, sandbox = session_dirs(factory)
        req = request_for(job_for(root, name), factory.mktemp(f"out{name}"), sandbox)
        result = run_worker(req)
        assert result["ok"], result
        _MINTS[name] = (req, result)
    return _MINTS[name]


@pytest.fixture(scope="session")
def art_a(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sealed artifact of the session's one mint of class A."""
    return Path(minted(tmp_path_factory, "A")[1]["artifact"])


def tiny_class(factory: pytest.TempPathFactory) -> type[torch.nn.Module]:
    """The entry's `Tiny` class, imported from the session's entry root."""
    root, _ = session_dirs(factory)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import tiny_entry

    return tiny_entry.Tiny


def tiny(factory: pytest.TempPathFactory, seed: int = 1, **kw: Any) -> torch.nn.Module:
    """A live `Tiny(64)` of class A's shapes, in eval mode, with seeded weights of its own."""
    import torch

    cls = tiny_class(factory)
    torch.manual_seed(seed)
    return cls(64, **kw).eval()


def served_eager(art: Path, m: torch.nn.Module, code: str) -> Any:
    """Adopting `art` onto `m` (a `tiny`) is refused with `code`, the call is served eager (no
    raise), and strict adoption raises AdoptRefused; returns the refusal."""
    import torch
    from cgbuild_rules.adopt import AdoptRefused, adopt

    served = adopt(art, m)
    (refusal,) = served.refusals.values()
    assert refusal.code == code, refusal
    assert served.armed == []
    x = torch.randn(1, 8, 64)
    with torch.no_grad():
        torch.testing.assert_close(served(x), m(x))
    assert served.counters == {f"eager:{code}": 1}
    with pytest.raises(AdoptRefused, match=code):
        adopt(art, m, strict=True)
    return refusal
