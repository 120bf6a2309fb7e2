"""A serving worker's module from a checkpoint: read to the device, assigned (no copy, no init),
literals computed; the same outputs as the module the entry builds with its own weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cgbuild_rules import trace, weights
from hypothesis import given, settings
from hypothesis import strategies as st

from cgbuild.config import cgfile
from cgbuild.config.targets import expand
from cgbuild.protocol.trace import job_for

ROOT = Path(__file__).resolve().parents[2]


def _job(example: str, label: str) -> dict:
    cg = cgfile.load(ROOT / "examples" / example / "Cgfile")
    target = next(t for t in expand(cg) if t.label == label)
    return job_for(cg, target).with_id(label).to_json()


@pytest.mark.parametrize(
    ("example", "label"),
    [
        ("toy", "//toy/conv/32x32-b2@fp32:cpu"),
        ("flux2_klein", "//flux2-klein-tiny/transformer/64x64-t8-b1@fp32:cpu"),
    ],
)
def test_module_from_checkpoint_matches_the_entrys_own(tmp_path: Path, example: str, label: str) -> None:
    job = _job(example, label)
    real = trace.build(trace.parse_job(job), "real")
    path = weights.write_checkpoint(real.module, tmp_path / "w.safetensors")
    tensors = weights.read_checkpoint(path, "cpu")
    module = weights.module_from_checkpoint(job, tensors, "cpu")
    state = module.state_dict()
    # assigned, not copied: the module holds the checkpoint's own tensors
    assert all(state[name].data_ptr() == t.data_ptr() for name, t in tensors.items())
    with torch.no_grad():
        want, got = real.module(*real.args, **real.kwargs), module(*real.args, **real.kwargs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_checkpoint_missing_a_tensor_is_refused_by_name(tmp_path: Path) -> None:
    job = _job("toy", "//toy/mlp/8x64-b1@fp32:cpu")
    real = trace.build(trace.parse_job(job), "real")
    tensors = {k: v for k, v in real.module.state_dict().items() if not k.endswith("bias")}
    with pytest.raises(ValueError, match=r"lacks tensors the module needs: .*bias"):
        weights.module_from_checkpoint(job, tensors, "cpu")
    extra = {**real.module.state_dict(), "stray.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"stray\.weight"):
        weights.module_from_checkpoint(job, extra, "cpu")


def _mixed(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """Tensors of every size class, odd byte lengths first so later offsets are unaligned."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.flag": torch.tensor([True, False, True]),
        "b.weight": torch.randn(37, 11, generator=g).to(torch.bfloat16),
        "c.scale": torch.randn(5, generator=g),
        "d.ids": torch.arange(7, dtype=torch.int64),
        "e.empty": torch.zeros(0, 4),
        "f.scalar": torch.tensor(3.5),
        "g.big": torch.randn(300, 129, generator=g),
    }
    path = tmp_path / "mixed.safetensors"
    save_file(tensors, str(path))
    return path, tensors


@pytest.mark.parametrize(("readers", "stage"), [(1, 1 << 20), (3, 4096), (8, 256)])
def test_read_onto_gives_every_tensor_exactly_whatever_the_split(
    tmp_path: Path, readers: int, stage: int
) -> None:
    """The GPU reader's logic on the CPU: spans over threads, stages crossing tensor ends, views
    of one allocation at header offsets, and a copy for an offset a device kernel could not take."""
    path, want = _mixed(tmp_path)
    got = weights.read_onto(path, "cpu", readers=readers, stage_bytes=stage)
    assert set(got) == set(want)
    base = got["g.big"].untyped_storage().data_ptr() if got["g.big"].data_ptr() % weights.ALIGN == 0 else None
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0)
        assert got[name].data_ptr() % weights.ALIGN == 0 or got[name].numel() == 0, name
    shared = [n for n, t in got.items() if t.numel() and t.untyped_storage().data_ptr() == base]
    assert len(shared) >= 2  # aligned tensors are views of the one allocation, not copies


def test_read_onto_refuses_what_safetensors_refuses_before_allocating(tmp_path: Path) -> None:
    path, _ = _mixed(tmp_path)
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-100])  # the data region ends before the header's last offset
    with pytest.raises(Exception, match=r"(?i)incomplete|invalid|truncat|metadata"):
        weights.read_onto(cut, "cpu")


def test_read_onto_refuses_a_dtype_it_has_no_torch_type_for(tmp_path: Path) -> None:
    import json
    import struct

    header = json.dumps({"a": {"dtype": "U16", "shape": [2], "data_offsets": [0, 4]}}).encode()
    path = tmp_path / "u16.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    with pytest.raises(ValueError, match="dtype U16 is not one cgbuild reads"):
        weights.read_onto(path, "cpu")


def test_a_file_that_shrinks_under_the_reader_is_refused_not_read_short(tmp_path: Path) -> None:
    """The header was validated against the file; a file cut after that still never yields a
    tensor of stale bytes."""
    path, _ = _mixed(tmp_path)
    blob = torch.empty(path.stat().st_size + 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="ends inside its data region"):
        weights._read_span(path, 0, blob, (0, blob.numel()), 4096)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(data=st.data())
def test_generated_damaged_checkpoints_read_as_safetensors_reads_them(
    tmp_path_factory: pytest.TempPathFactory, data
) -> None:
    """Any byte flipped, inserted or cut: the reader refuses what safetensors' own loader
    refuses (with an error naming the problem) and otherwise gives exactly its tensors."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from cgbuild.core.errors import UserError

    path, _ = _mixed(tmp_path_factory.mktemp("damaged"))
    raw = bytearray(path.read_bytes())
    at = data.draw(st.integers(min_value=0, max_value=len(raw) - 1))
    op = data.draw(st.sampled_from(["flip", "insert", "cut"]))
    if op == "flip":
        raw[at] ^= data.draw(st.integers(min_value=1, max_value=255))
    elif op == "insert":
        raw[at:at] = data.draw(st.binary(min_size=1, max_size=9))
    else:
        del raw[at:]
    path.write_bytes(bytes(raw))
    try:
        want = load_file(str(path))
    except Exception:
        want = None
    try:
        got = weights.read_onto(path, "cpu", readers=2, stage_bytes=4096)
    except (SafetensorError, UserError, ValueError) as refused:
        assert str(refused)
        assert want is None or any(t.dtype not in weights.DTYPES.values() for t in want.values())
        return
    assert want is not None and set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), (
            name
        )
