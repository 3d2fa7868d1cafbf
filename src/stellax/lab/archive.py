"""The lab archive: a SQLite database of every candidate a search proposed.

Tables:

* ``runs``: one row per search (``id``, ``op``, ``proposer``, ``params``
  JSON, ``created``);
* ``candidates``: ``id``, ``run_id``, ``generation``, ``parent_id``,
  ``proposer``, ``source_hash`` (sha256), ``source``, ``status``
  (``pending`` until its evaluation finished, then ``evaluated``),
  ``report`` (the JSON report), ``score``, ``passed``, ``speedup``,
  ``first_failure`` (tier name), ``note``, ``created``, ``finished``;
* ``attempts``: proposals that did not yield a candidate (a malformed LLM
  reply, a refused request), with the raw detail.

Every write is one transaction, the journal is a write-ahead log with full
syncs, so a process killed with ``kill -9`` leaves either the row or
nothing; a ``pending`` row (its evaluation was cut off) is evaluated again on
resume. The default location is ``stellax-lab.sqlite`` in
``STELLAX_CACHE_DIR`` when set, else in the working directory.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Any, Iterator

from .errors import LabError
from .report import rank_key

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY, op TEXT NOT NULL, proposer TEXT NOT NULL, params TEXT NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS candidates (
    id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL REFERENCES runs(id), generation INTEGER NOT NULL,
    parent_id INTEGER REFERENCES candidates(id), proposer TEXT NOT NULL, source_hash TEXT NOT NULL,
    source TEXT NOT NULL, status TEXT NOT NULL, report TEXT, score REAL, passed INTEGER, speedup REAL,
    first_failure TEXT, note TEXT, created REAL NOT NULL, finished REAL);
CREATE INDEX IF NOT EXISTS candidates_run ON candidates(run_id, status);
CREATE TABLE IF NOT EXISTS attempts (
    id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, kind TEXT NOT NULL, detail TEXT NOT NULL,
    created REAL NOT NULL);
"""

FILENAME = "stellax-lab.sqlite"


def default_path() -> Path:
    """``$STELLAX_CACHE_DIR/stellax-lab.sqlite``, else ``./stellax-lab.sqlite``."""
    root = os.environ.get("STELLAX_CACHE_DIR")
    return (Path(root) if root else Path.cwd()) / FILENAME


class Archive:
    """A connection to one archive file (see the module docstring)."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else default_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = sqlite3.connect(str(self.path), timeout=30.0, isolation_level=None)
            self.db.row_factory = sqlite3.Row
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.executescript(SCHEMA)
        except sqlite3.DatabaseError as e:
            raise LabError(f"archive {self.path}: not a usable SQLite database ({e})") from None

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> "Archive":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _write(self, sql: str, args: tuple) -> int:
        with self.db:  # one transaction
            cursor = self.db.execute(sql, args)
        return cursor.lastrowid

    # -- runs ----------------------------------------------------------------------
    def run(self, run_id: str) -> dict | None:
        row = self.db.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        return None if row is None else {**dict(row), "params": json.loads(row["params"])}

    def runs(self) -> list[dict]:
        return [{**dict(r), "params": json.loads(r["params"])}
                for r in self.db.execute("SELECT * FROM runs ORDER BY created")]

    def start_run(self, run_id: str, op: str, proposer: str, params: dict) -> dict:
        """The run ``run_id`` (created now, or the existing one when its op and proposer match)."""
        existing = self.run(run_id)
        if existing is not None:
            if existing["op"] != op or existing["proposer"] != proposer:
                raise LabError(f"--run {run_id}: the archive's run is for op {existing['op']} with proposer "
                               f"{existing['proposer']}, not {op} with {proposer}; pick another run name")
            return existing
        self._write("INSERT INTO runs (id, op, proposer, params, created) VALUES (?, ?, ?, ?, ?)",
                    (run_id, op, proposer, json.dumps(params, sort_keys=True), time.time()))
        return self.run(run_id)

    # -- candidates ------------------------------------------------------------------
    def add_candidate(self, run_id: str, source: str, source_hash: str, *, parent_id: int | None, generation: int,
                      proposer: str, note: str = "") -> int:
        return self._write(
            "INSERT INTO candidates (run_id, generation, parent_id, proposer, source_hash, source, status, note, "
            "created) VALUES (?, ?, ?, ?, ?, ?, 'pending', ?, ?)",
            (run_id, generation, parent_id, proposer, source_hash, source, note, time.time()))

    def finish_candidate(self, candidate_id: int, report: dict) -> None:
        bench = report.get("benchmark") or {}
        failure = report.get("first_failure") or {}
        self._write(
            "UPDATE candidates SET status = 'evaluated', report = ?, score = ?, passed = ?, speedup = ?, "
            "first_failure = ?, finished = ? WHERE id = ?",
            (json.dumps(report, default=repr), report.get("score"), int(report.get("status") == "passed"),
             bench.get("speedup"), failure.get("tier"), time.time(), candidate_id))

    def add_attempt(self, run_id: str, kind: str, detail: str) -> int:
        return self._write("INSERT INTO attempts (run_id, kind, detail, created) VALUES (?, ?, ?, ?)",
                           (run_id, kind, detail[:20000], time.time()))

    def attempts(self, run_id: str) -> list[dict]:
        return [dict(r) for r in self.db.execute("SELECT * FROM attempts WHERE run_id = ? ORDER BY id", (run_id,))]

    def candidates(self, run_id: str | None = None, *, status: str | None = None) -> list[dict]:
        sql, args = "SELECT * FROM candidates", []
        where = []
        if run_id is not None:
            where.append("run_id = ?")
            args.append(run_id)
        if status is not None:
            where.append("status = ?")
            args.append(status)
        if where:
            sql += " WHERE " + " AND ".join(where)
        return [_row(r) for r in self.db.execute(sql + " ORDER BY id", args)]

    def candidate(self, candidate_id: int) -> dict:
        row = self.db.execute("SELECT * FROM candidates WHERE id = ?", (candidate_id,)).fetchone()
        if row is None:
            raise LabError(f"candidate {candidate_id}: not in the archive {self.path}")
        return _row(row)

    def evaluated(self, run_id: str) -> list[dict]:
        return self.candidates(run_id, status="evaluated")

    def best(self, run_id: str | None = None) -> dict | None:
        """The best evaluated candidate (passed first, then speedup, then tiers)."""
        done = self.candidates(run_id, status="evaluated")
        return max(done, key=lambda c: (rank_key(c["report"]), -c["id"])) if done else None

    def lineage(self, candidate_id: int) -> list[dict]:
        """The candidate and its ancestors, root first."""
        chain, seen = [], set()
        current: int | None = candidate_id
        while current is not None and current not in seen:
            seen.add(current)
            c = self.candidate(current)
            chain.append(c)
            current = c["parent_id"]
        return chain[::-1]

    def integrity(self) -> str:
        return self.db.execute("PRAGMA integrity_check").fetchone()[0]


def _row(row: sqlite3.Row) -> dict:
    out = dict(row)
    out["report"] = json.loads(out["report"]) if out.get("report") else None
    return out


def iter_generations(candidates: list[dict]) -> Iterator[tuple[int, list[dict]]]:
    """Evaluated candidates grouped by generation, in order."""
    by: dict[int, list[dict]] = {}
    for c in candidates:
        by.setdefault(c["generation"], []).append(c)
    for g in sorted(by):
        yield g, by[g]


def report_field(candidate: dict, *keys: str, default: Any = None) -> Any:
    value: Any = candidate.get("report") or {}
    for k in keys:
        if not isinstance(value, dict):
            return default
        value = value.get(k)
    return default if value is None else value
