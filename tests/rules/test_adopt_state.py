"""The adopted artifact's states and transitions (`cgbuild_rules.adopt.state`), one by one, on the
session's real artifact of class A (`minted`) loaded for a live tiny MLP: each legal transition
leaves the state it names, and each illegal one raises.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from cgbuild_rules.adopt import Refusal, load_artifact
from cgbuild_rules.adopt.state import (
    Armed,
    Artifact,
    Held,
    Identity,
    IllegalTransition,
    Replaced,
    Unloaded,
    annotate,
    fail_call,
    hand_over,
    rearm,
    rebound,
    replace,
    restore,
)
from support.minted import tiny

from cgbuild.core.codes import Code

pytestmark = pytest.mark.slow


def _armed(art_a: Path, factory: pytest.TempPathFactory) -> tuple[Artifact, torch.nn.Module]:
    m = tiny(factory)
    art = load_artifact(art_a, m)
    assert isinstance(art.state, Armed), art.refusal
    return art, m


def _retyped(m: torch.nn.Module) -> torch.Tensor:
    """Give `fc1` a float64 weight (a dtype the artifact refuses); returns the float32 one."""
    weight = m.fc1.weight
    m.fc1.weight = torch.nn.Parameter(weight.detach().double())
    return weight


def test_a_loaded_artifact_is_armed_and_frozen_but_for_its_transitions(
    art_a: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    art, _ = _armed(art_a, tmp_path_factory)
    assert art.armed and art.refusal is None and art.loaded is not None and art.watch is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        art.identity.label = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        art.state.watch = None  # type: ignore[misc,union-attr]
    with pytest.raises(AttributeError):
        art.state = Unloaded(Refusal(Code.NO_ARTIFACT, "set from outside"))  # type: ignore[misc]
    with pytest.raises(AttributeError):
        art.identity = Identity("", "other", None)  # type: ignore[misc]


def test_rearm_binds_anew_or_holds_for_what_the_module_holds(
    art_a: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    art, m = _armed(art_a, tmp_path_factory)
    before = art.state
    m.fc2.weight = torch.nn.Parameter(torch.randn_like(m.fc2.weight))  # same layout: binds anew
    again = rearm(art, m)
    assert isinstance(again, Armed) and art.state is again and again.watch is not before.watch
    assert again.loaded is before.loaded and again.watch.moved() is None

    weight = _retyped(m)
    moved = again.watch.moved()
    assert moved is not None
    held = rearm(art, m, moved)
    assert isinstance(held, Held) and art.state is held and not art.armed
    assert (
        held.refusal.code == Code.MODULE_CHANGED and "not re-bound: weights-mismatch" in held.refusal.detail
    )
    assert held.watch.root is m and held.watch.moved() is None  # watched as refused
    assert held.loaded is before.loaded  # the package stays loaded

    quiet = rearm(art, m)  # nothing named as moved: the refusal as found
    assert isinstance(quiet, Held) and quiet.refusal.code == Code.WEIGHTS_MISMATCH

    m.fc1.weight = torch.nn.Parameter(weight)
    assert isinstance(rearm(art, m), Armed)  # Held → Armed once the module matches again


def test_a_failed_call_unloads_for_good(art_a: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    art, m = _armed(art_a, tmp_path_factory)
    failed = fail_call(art, RuntimeError("kernel launch failed"))
    assert art.state is failed and art.loaded is None
    assert failed.refusal == Refusal(Code.COMPILED_ERROR, "RuntimeError: kernel launch failed")
    assert rebound(art, m) is art and art.state is failed  # no state of the module brings it back
    with pytest.raises(IllegalTransition):
        fail_call(art, RuntimeError("again"))
    with pytest.raises(IllegalTransition):
        rearm(art, m)


def test_an_artifact_refused_for_what_the_module_held_is_loaded_anew(
    art_a: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    m = tiny(tmp_path_factory)
    traced_with = m.scale.clone()
    m.scale.add_(1.0)  # the literal the program was traced with, held otherwise: refused at bind
    art = load_artifact(art_a, m)
    assert isinstance(art.state, Unloaded) and art.state.refusal.code == Code.LITERAL_MISMATCH
    assert rebound(art, m) is not art  # loaded anew: still refused while the module holds it
    m.scale.copy_(traced_with)
    fresh = rebound(art, m)
    assert fresh is not art and isinstance(fresh.state, Armed) and fresh.identity.key == art.identity.key

    stand_in = Artifact(Identity("", "mlp", None), Unloaded(Refusal(Code.LAYOUT_MISMATCH, "no layout fits")))
    assert rebound(stand_in, m) is stand_in  # nothing to load it from


def test_rebound_rearms_an_armed_or_held_artifact_in_place(
    art_a: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    art, m = _armed(art_a, tmp_path_factory)
    weight = _retyped(m)
    assert rebound(art, m) is art and isinstance(art.state, Held)
    m.fc1.weight = torch.nn.Parameter(weight)
    assert rebound(art, m) is art and isinstance(art.state, Armed)


def test_a_replaced_module_holds_the_prior_state_until_restored(
    art_a: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    art, m = _armed(art_a, tmp_path_factory)
    armed = art.state
    first = replace(art, "pipe.mlp is now a Linear")
    assert isinstance(first, Replaced) and first.prior is armed and art.refusal == first.refusal
    assert first.refusal.code == Code.MODULE_REPLACED
    second = replace(art, "pipe.mlp is now a Conv1d")
    assert second.prior is armed and "Conv1d" in second.refusal.detail  # the state before the first
    assert rebound(art, m) is art and art.state is second  # not bound while another class is there
    assert restore(art) is armed and art.state is armed
    with pytest.raises(IllegalTransition):
        restore(art)


def test_hand_over_moves_the_state_and_unloads_the_replaced_modules_artifact(
    art_a: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    art, _ = _armed(art_a, tmp_path_factory)
    armed = art.state
    moved = hand_over(art, "pipe.mlp was replaced")
    assert moved is not art and moved.state is armed and moved.identity is art.identity
    assert art.state == Unloaded(Refusal(Code.MODULE_REPLACED, "pipe.mlp was replaced"))


def test_annotate_leads_a_refusal_and_has_none_to_lead_when_armed(
    art_a: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    art, m = _armed(art_a, tmp_path_factory)
    with pytest.raises(IllegalTransition):
        annotate(art, "after: ")
    _retyped(m)
    held = rearm(art, m)
    said = annotate(art, "pipe.mlp was replaced: ")
    assert isinstance(said, Held) and said.loaded is held.loaded and said.watch is held.watch
    assert said.refusal == Refusal(Code.WEIGHTS_MISMATCH, f"pipe.mlp was replaced: {held.refusal.detail}")
