"""Canonical JSON: the one encoding identities are hashed through, and its guard."""

from __future__ import annotations

import re

import pytest

from cgbuild.core.canon import NotCanonical, canonical_json, digest, digest_unguarded, hexfloats
from cgbuild.identity.keys import Axis, key_of


def test_rendering_is_sorted_compact_ascii() -> None:
    assert canonical_json({"b": [1, True, None], "a": "é"}) == '{"a":"\\u00e9","b":[1,true,null]}'


def test_json_types_are_kept() -> None:
    assert digest({"x": False}) != digest({"x": "False"})
    assert digest({"x": 1}) != digest({"x": "1"})


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ({"a": [1, {"b": 1.5}]}, "$.a[1].b: float"),
        ({"x": {1: 2}}, "$.x: non-string key"),
        ({"y": [object()]}, "$.y[0]: object"),
        (2.5, "$: float"),
    ],
)
def test_identity_blocks_refuse_what_has_no_stable_rendering(value: object, where: str) -> None:
    with pytest.raises(NotCanonical, match=re.escape(where)):
        canonical_json(value)


def test_unguarded_digest_matches_guarded_rendering() -> None:
    value = {"spec": {"h": 8, "w": 64, "t": None}, "quant": "plain.fp32"}
    assert digest_unguarded(value) == digest(value)


def test_hexfloats_makes_config_hashable() -> None:
    assert digest(hexfloats({"mlp_ratio": 3.0, "dims": [0.5]})) == digest(
        {"mlp_ratio": "0x1.8000000000000p+1", "dims": ["0x1.0000000000000p-1"]}
    )


def test_key_needs_exactly_the_four_axes() -> None:
    axes = {name: Axis({"v": name}, {}) for name in ("graph", "sm", "toolchain", "layout")}
    key_of(axes)
    with pytest.raises(ValueError):
        key_of({**axes, "lane": Axis({"v": "x"}, {})})
    with pytest.raises(ValueError):
        key_of({k: v for k, v in axes.items() if k != "layout"})


def test_key_is_the_digest_of_the_canonical_axes_block() -> None:
    from cgbuild.identity.keys import AXES, KEY_SCHEME

    axes = {name: Axis({"v": name, "n": 1}, {}) for name in AXES}
    assert key_of(axes) == digest({"scheme": KEY_SCHEME, **{n: axes[n].identity for n in AXES}})
    with pytest.raises(NotCanonical):
        key_of({**axes, "graph": Axis({"digest": 1.5}, {})})
