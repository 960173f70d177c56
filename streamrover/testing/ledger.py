"""A durable ledger of applied records: the proof behind "exactly once".

The ledger is a model whose whole state is "which record ids were applied, and
how often". It lives in SQLite (WAL) so several worker processes can share it
and so it survives any of them being killed. It is updated the way a sink that
keeps its state outside the trainer gets exactly-once: each write carries the
shard position it starts from and moves the ledger's own per-shard position in
the same transaction (compare-and-set). The ledger's positions are its data
cursor; a worker that finds the ledger ahead of its lease (it was killed after
writing, before acking) catches up by acking that position instead of writing
the records again; a worker that finds the position moved under it (its lease
went stale) writes nothing.

:meth:`Ledger.verify` compares the applied ids with the ids that were produced.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_SCHEMA = """
CREATE TABLE IF NOT EXISTS positions (shard_id TEXT PRIMARY KEY, position INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS chunks (
    shard_id TEXT NOT NULL, start INTEGER NOT NULL, "end" INTEGER NOT NULL, worker TEXT NOT NULL,
    count INTEGER NOT NULL, id_sum INTEGER NOT NULL, ids BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS events (kind TEXT NOT NULL, shard_id TEXT NOT NULL, detail TEXT NOT NULL, at REAL NOT NULL);
"""


class LedgerConflict(Exception):
    """The ledger's position for a shard is not where this writer expected: its lease is stale."""


@dataclass(frozen=True)
class LedgerReport:
    """What a ledger holds against the records produced (:meth:`Ledger.verify`)."""
    expected: int
    applied: int  # records applied, counting repeats
    unique: int
    duplicates: int  # applications beyond the first
    missing: int  # expected ids never applied
    unexpected: int  # applied ids that were never produced
    id_sum_ok: bool
    conflicts: int  # refused compare-and-set writes (stale writers)
    catchups: int  # leases that found the ledger ahead of the master (killed between write and ack)

    @property
    def exact(self) -> bool:
        """Every produced record applied exactly once, nothing else applied."""
        return self.duplicates == 0 and self.missing == 0 and self.unexpected == 0 and self.id_sum_ok

    def __str__(self) -> str:
        verdict = "EXACT" if self.exact else "NOT EXACT"
        return (
            f"{verdict}: {self.applied:,} applied for {self.expected:,} produced; {self.unique:,} unique, "
            f"{self.duplicates:,} duplicates, {self.missing:,} missing, {self.unexpected:,} unexpected; "
            f"id sum {'matches' if self.id_sum_ok else 'differs'}; {self.conflicts} stale writes refused, "
            f"{self.catchups} catch-ups after a kill"
        )


class Ledger:
    """A transactional sink for the exactly-once tests: the record ids applied, per shard a position written by
    compare-and-set (SQLite).
    """
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._db = sqlite3.connect(str(self.path), isolation_level=None, timeout=60.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        """Close the ledger's database."""
        self._db.close()

    def position(self, shard_id: str) -> int | None:
        """The ledger's position for ``shard_id`` (where its next write must start), or None before any."""
        row = self._db.execute("SELECT position FROM positions WHERE shard_id = ?", (shard_id,)).fetchone()
        return None if row is None else int(row[0])

    def note(self, kind: str, shard_id: str, detail: str) -> None:
        """Record an event of ``kind`` for ``shard_id`` (counted by :meth:`event_count`)."""
        self._db.execute("INSERT INTO events VALUES (?, ?, ?, ?)", (kind, shard_id, detail, time.time()))

    def apply(self, shard_id: str, start: int, end: int, ids: np.ndarray, worker: str) -> None:
        """Record ``ids`` (the records at positions [start, end)) if the ledger's position is ``start``."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            row = db.execute("SELECT position FROM positions WHERE shard_id = ?", (shard_id,)).fetchone()
            found = None if row is None else int(row[0])
            if found is not None and found != start:
                db.execute(
                    "INSERT INTO events VALUES ('conflict', ?, ?, ?)",
                    (shard_id, f"{worker} expected {start}, found {found}", time.time()),
                )
                db.execute("COMMIT")
                raise LedgerConflict(f"shard {shard_id}: ledger is at {found}, writer {worker} expected {start}")
            db.execute(
                "INSERT INTO chunks VALUES (?, ?, ?, ?, ?, ?, ?)",
                (shard_id, start, end, worker, int(ids.size), int(ids.sum()), ids.tobytes()),
            )
            db.execute("INSERT OR REPLACE INTO positions VALUES (?, ?)", (shard_id, end))
            db.execute("COMMIT")
        except LedgerConflict:
            raise
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def applied_ids(self) -> np.ndarray:
        """Every record id applied, repeats included."""
        blobs = [np.frombuffer(b, dtype=np.int64) for (b,) in self._db.execute("SELECT ids FROM chunks")]
        return np.concatenate(blobs) if blobs else np.zeros(0, dtype=np.int64)

    def positions(self) -> dict[str, int]:
        """The ledger's position of every shard written."""
        return {str(k): int(v) for k, v in self._db.execute("SELECT shard_id, position FROM positions")}

    def event_count(self, kind: str) -> int:
        """How many events of ``kind`` were noted."""
        return int(self._db.execute("SELECT COUNT(*) FROM events WHERE kind = ?", (kind,)).fetchone()[0])

    def verify(self, expected_ids: np.ndarray) -> LedgerReport:
        """Compare the applied ids with ``expected_ids`` (the records produced)."""
        applied = self.applied_ids()
        expected = np.unique(np.asarray(expected_ids, dtype=np.int64))
        uniq, counts = np.unique(applied, return_counts=True)
        return LedgerReport(
            expected=int(expected.size),
            applied=int(applied.size),
            unique=int(uniq.size),
            duplicates=int((counts - 1).sum()),
            missing=int(np.setdiff1d(expected, uniq, assume_unique=True).size),
            unexpected=int(np.setdiff1d(uniq, expected, assume_unique=True).size),
            id_sum_ok=int(applied.sum()) == int(expected.sum()),
            conflicts=self.event_count("conflict"),
            catchups=self.event_count("catchup"),
        )
