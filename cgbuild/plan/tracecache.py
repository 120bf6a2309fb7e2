"""Trace facts cached by the digest of their (over-keyed) inputs.

A trace costs seconds and an import of torch; its facts (graph digest, call contract, topology)
cost a row. SQLite gives atomic, crash-safe writes and fast lookups for 10,000 targets without a
file per trace. A missed trace input would cost a wrong key, so the inputs are generous: family
sources, entry, config, module, graph class, device, dtype, quant rule, Python major.minor, every
installed distribution with its version, the tracing torch and the rule version. The quant rule
enters with its facts' digest: changing a rule's facts changes its transform, so the graph too.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path
from typing import Any

from cgbuild.core import statefile
from cgbuild.core.canon import digest_unguarded
from cgbuild.identity.quantrule import QUANT_RULES

TRACE_RULE_VERSION = 2
"""Bumped when the rule computes other facts from the same inputs (2: the traced strides of
non-contiguous inputs entered the graph digest), so no cached trace answers for the new rule."""


def trace_inputs(
    *, family_inputs: str, module: str, spec: dict[str, Any], quant: str, torch: str, environment: str
) -> str:
    """Digest of everything a trace could depend on (over-keyed on purpose)."""
    return digest_unguarded(
        {
            "scheme": "cgbuild.trace-inputs/1",
            "rule": TRACE_RULE_VERSION,
            "family": family_inputs,
            "module": module,
            "spec": spec,
            # the rule's facts too: the torch transform implements them, so new facts re-trace
            "quant": [quant, QUANT_RULES[quant].digest if quant in QUANT_RULES else None],
            "torch": torch,
            "python": f"{sys.version_info.major}.{sys.version_info.minor}",
            "environment": environment,
        }
    )


class TraceCache:
    """inputs digest → facts; safe for several processes (SQLite WAL).

    A file that is not a trace cache (torn by a crash outside SQLite's guarantees, another
    tool's database, garbage) is set aside and an empty cache takes its place: traces are
    re-run, nothing is lost that the workspace cannot rebuild. A row whose facts are not a JSON
    object is dropped the same way, one row at a time.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = self._open()
        except sqlite3.DatabaseError as exc:
            statefile.set_aside(path, f"trace cache unreadable ({exc})", companions=_COMPANIONS)
            self._db = self._open()

    def _open(self) -> sqlite3.Connection:
        # Results arrive on the threads that read the children; callers serialize writes.
        db = sqlite3.connect(self._path, timeout=30, check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("CREATE TABLE IF NOT EXISTS traces (inputs TEXT PRIMARY KEY, facts TEXT NOT NULL)")
            columns = [row[1] for row in db.execute("PRAGMA table_info(traces)")]
            if columns != ["inputs", "facts"]:
                raise sqlite3.DatabaseError(f"a 'traces' table of columns {columns}")
            db.execute("SELECT inputs, facts FROM traces LIMIT 1").fetchall()
        except sqlite3.DatabaseError:
            db.close()
            raise
        return db

    def _recover(self, exc: sqlite3.DatabaseError) -> None:
        """A read or write failed mid-file (a torn page): set the file aside, start empty."""
        self._db.close()
        statefile.set_aside(self._path, f"trace cache damaged ({exc})", companions=_COMPANIONS)
        self._db = self._open()

    def get_many(self, inputs: list[str]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        bad: list[str] = []
        unique = list(dict.fromkeys(inputs))
        try:
            for i in range(0, len(unique), 500):
                chunk = unique[i : i + 500]
                marks = ",".join("?" * len(chunk))
                for k, facts in self._db.execute(
                    f"SELECT inputs, facts FROM traces WHERE inputs IN ({marks})", chunk
                ):
                    value = _facts(facts)
                    if value is None:
                        bad.append(k)
                    else:
                        out[k] = value
        except sqlite3.DatabaseError as exc:
            self._recover(exc)
            return {}
        if bad:
            print(
                f"cgbuild: warning: {self._path}: {len(bad)} unreadable trace rows dropped", file=sys.stderr
            )
            with self._db:
                self._db.executemany("DELETE FROM traces WHERE inputs = ?", [(k,) for k in bad])
        return out

    def put(self, inputs: str, facts: dict[str, Any]) -> None:
        row = (inputs, json.dumps(facts))
        try:
            with self._db:
                self._db.execute("INSERT OR REPLACE INTO traces VALUES (?, ?)", row)
        except sqlite3.DatabaseError as exc:
            self._recover(exc)
            with self._db:
                self._db.execute("INSERT OR REPLACE INTO traces VALUES (?, ?)", row)

    def close(self) -> None:
        self._db.close()


_COMPANIONS = ("-wal", "-shm")


def _facts(text: Any) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except (TypeError, ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None
