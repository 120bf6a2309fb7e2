"""A torch that cannot clamp host code (no `cpp.march`, e.g. 2.11) keys the host's ISA level."""

from __future__ import annotations

from pathlib import Path

from cgbuild.identity import compiler, policy


def fake_torch(root: Path, config_text: str) -> str:
    info = root / "torch-2.11.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Name: torch\nVersion: 2.11.0\n")
    (info / "RECORD").write_text("")
    (root / "torch" / "_inductor").mkdir(parents=True)
    (root / "torch" / "_inductor" / "config.py").write_text(config_text)
    return str(root)


def test_march_setting_is_detected_from_the_config_file(tmp_path: Path) -> None:
    with_march = fake_torch(tmp_path / "a", "class cpp:\n    march: str | None = None\n")
    without = fake_torch(tmp_path / "b", "class cpp:\n    simdlen: int | None = None\n")
    assert compiler.torch_clamps_march([with_march]) is True
    assert compiler.torch_clamps_march([without]) is False


def test_unclampable_torch_keys_the_host_level_apart_from_the_clamp() -> None:
    clamped = compiler.isa_component("x86_64")
    keyed = compiler.isa_component("x86_64", clamps=False, host_level="x86-64-v4")
    assert keyed == {"arch": "x86_64", "level": "x86-64-v4", "keyed": "host"}
    assert keyed != clamped
    assert "cpp.march" not in policy.inductor_configs("x86_64", clamps=False)
    assert policy.settings_block("x86_64", clamps=False) != policy.settings_block("x86_64")


def test_host_keyed_code_mints_and_adopts_only_on_that_level() -> None:
    keyed = {"arch": "x86_64", "level": "x86-64-v4", "keyed": "host"}
    assert compiler.isa_refusal(keyed, host_level="x86-64-v4", machine="x86_64") is None
    assert "differs from the keyed level" in str(
        compiler.isa_refusal(keyed, host_level="x86-64-v3", machine="x86_64")
    )
    clamped = {"arch": "x86_64", "level": "x86-64-v3"}
    assert compiler.isa_refusal(clamped, host_level="x86-64-v4", machine="x86_64") is None
