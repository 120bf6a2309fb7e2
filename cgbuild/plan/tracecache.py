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

from cgbuild.core.canon import digest_unguarded
from cgbuild.core.fs import set_aside
from cgbuild.identity.layout import QUANT_RULES

TRACE_RULE_VERSION = 1


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
    """inputs digest → facts; safe for several processes (SQLite WAL)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = self._open(path)
        except sqlite3.DatabaseError as e:  # not a database, or torn: a cache is rebuilt
            set_aside(path, f"is no trace cache ({e})")
            for suffix in ("-wal", "-shm"):
                path.with_name(path.name + suffix).unlink(missing_ok=True)
            self._db = self._open(path)

    @staticmethod
    def _open(path: Path) -> sqlite3.Connection:
        # Results arrive on the threads that read the children; callers serialize writes.
        db = sqlite3.connect(path, timeout=30, check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("CREATE TABLE IF NOT EXISTS traces (inputs TEXT PRIMARY KEY, facts TEXT NOT NULL)")
            db.execute("SELECT inputs, facts FROM traces LIMIT 1").fetchall()
        except sqlite3.DatabaseError:
            db.close()
            raise
        return db

    def get_many(self, inputs: list[str]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        unique = list(dict.fromkeys(inputs))
        for i in range(0, len(unique), 500):
            chunk = unique[i : i + 500]
            marks = ",".join("?" * len(chunk))
            for k, facts in self._db.execute(
                f"SELECT inputs, facts FROM traces WHERE inputs IN ({marks})", chunk
            ):
                out[k] = json.loads(facts)
        return out

    def put(self, inputs: str, facts: dict[str, Any]) -> None:
        with self._db:
            self._db.execute("INSERT OR REPLACE INTO traces VALUES (?, ?)", (inputs, json.dumps(facts)))

    def close(self) -> None:
        self._db.close()
