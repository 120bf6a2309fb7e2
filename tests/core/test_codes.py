"""One registry of codes (`cgbuild.core.codes`), one page (docs/codes.md), held to each other.

Codes are built as `Code` members: every type that carries one (`Reason`, `MintFailed`, the store's
and the trust layer's errors, adopt's `Refusal`) is typed `Code`, and the type checker holds the
producers to it. The source scan guards what the checker cannot see: no kebab-case string in
cgbuild/ or rules/ spells a registered code (it is written `Code.X`), and every other is a named
non-code, so a new code cannot appear as a bare string.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from cgbuild.core.codes import RETRYABLE, Code

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "codes.md"

# Kebab-case strings that are not codes: quant rule and ISA names, encodings, tool names, test
# hooks, tolerances, artifact kinds, facts' values.
NOT_CODES = {
    "1e-2", "1e-4", "1e-9", "5e-2", "8e-2", "aot-inductor", "fail-after-part", "kill-after-part",
    "fp8-gemm", "fp8-rowwise", "int8-rowwise", "scaled-mm", "nvidia-smi", "per-output-row",
    "pytorch-triton", "rel-rms",
    "re-mint", "trace-rule", "utf-8", "x86-64-v1", "x86-64-v2", "x86-64-v3", "x86-64-v4",
}  # fmt: skip


def _page_codes() -> dict[str, str]:
    rows = re.findall(r"^\| `([a-z0-9-]+)` \| (.+) \|$", PAGE.read_text(), flags=re.M)
    return dict(rows)


def _source_strings() -> dict[str, str]:
    found: dict[str, str] = {}
    for path in [*ROOT.glob("cgbuild/**/*.py"), *ROOT.glob("rules/**/*.py")]:
        if path == ROOT / "cgbuild" / "core" / "codes.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            value = node.value if isinstance(node, ast.Constant) else None
            if isinstance(value, str) and re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)+", value):
                found.setdefault(value, str(path.relative_to(ROOT)))
    return found


def test_every_registered_code_is_on_the_page_and_back() -> None:
    page = _page_codes()
    assert sorted(set(Code) - set(page)) == []
    assert sorted(set(page) - set(Code)) == []
    assert all(meaning.strip() for meaning in page.values())


def test_no_code_is_a_bare_string_in_the_source() -> None:
    found = _source_strings()
    assert {s: where for s, where in found.items() if s in set(Code)} == {}  # written Code.X
    assert {s: where for s, where in found.items() if s not in NOT_CODES} == {}  # or registered


def test_the_scan_reads_the_real_source() -> None:
    """It sees the non-codes in use (a scan that read nothing would pass the test above)."""
    assert {"fp8-rowwise", "aot-inductor", "rel-rms"} <= set(_source_strings())


def test_codes_are_their_strings_and_retryable_is_a_subset() -> None:
    assert Code.MISSING_FROM_STORE == "missing-from-store"
    assert set(Code) >= RETRYABLE
    assert len({c.value for c in Code}) == len(Code)


def test_retryable_is_read_from_the_code_never_written_by_hand() -> None:
    """docs/architecture.md: a failure's `retryable` is `code in RETRYABLE`. A literal True or
    False beside a code lets the two disagree (io-error and the fleet's codes once did)."""
    hand = re.compile(r"""["']?retryable["']?\s*[:=]\s*(True|False)""")
    written = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in [*ROOT.glob("cgbuild/**/*.py"), *ROOT.glob("rules/**/*.py")]
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if hand.search(line)
    ]
    assert written == []
    assert {Code.IO_ERROR, Code.REMOTE_UNAVAILABLE, Code.UPLOAD_FAILED, Code.FLEET_NODE_LOST} <= RETRYABLE
