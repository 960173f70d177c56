"""The journal's tables beside the shard state: the committed cursor, cuts, the key-value store, staged commits.

:class:`JournalTables` is a base of :class:`~.journal.Journal` (which opens the connection, owns the
transactions and the shard state's tables); its methods write or read rows on ``self._db`` inside the
caller's transaction, like every other journal write.
"""

from __future__ import annotations

import json
import sqlite3

from streamrover.cursor import DataCursor, IntervalSet, PartitionKey
from streamrover.shard_service.master.bookkeeping import CutRecord, CutState


class JournalTables:
    """Row access to the cursor, cuts, kv and staged tables (the connection is the subclass's)."""

    _db: sqlite3.Connection

    # -- committed cursor ------------------------------------------------------
    def put_cursor(self, cursor: DataCursor) -> None:
        """Replace the committed cursor."""
        self._db.execute("DELETE FROM cursor")
        self._db.executemany(
            "INSERT INTO cursor VALUES (?, ?, ?, ?)",
            [(k.dataset, k.epoch, k.partition, json.dumps(v.to_list())) for k, v in cursor.items()],
        )

    def load_cursor(self) -> DataCursor:
        """The committed cursor."""
        entries = {
            PartitionKey(ds, epoch, part): IntervalSet.from_list(json.loads(ivs))
            for ds, epoch, part, ivs in self._db.execute("SELECT * FROM cursor")
        }
        return DataCursor(entries)

    # -- cuts ----------------------------------------------------------------
    def put_cut(self, cut: CutRecord) -> None:
        """Write a cut's row."""
        self._db.execute(
            "INSERT OR REPLACE INTO cuts VALUES (?, ?, ?, ?)", (cut.id, cut.step, cut.cursor.to_json(), cut.state.value)
        )

    def delete_cut(self, cut_id: int) -> None:
        """Delete a cut's row."""
        self._db.execute("DELETE FROM cuts WHERE id = ?", (cut_id,))

    def load_cuts(self) -> list[CutRecord]:
        """Every remembered cut, by id."""
        return [
            CutRecord(int(i), None if step is None else int(step), DataCursor.from_json(c), CutState(state))
            for i, step, c, state in self._db.execute("SELECT * FROM cuts ORDER BY id")
        ]

    # -- key-value store -------------------------------------------------------
    def kv_get(self, key: str) -> tuple[bytes, int] | None:
        """(value, version) of key ``key`` of the key-value store, or None."""
        row = self._db.execute("SELECT value, version FROM kv WHERE key = ?", (key,)).fetchone()
        return None if row is None else (bytes(row[0]), int(row[1]))

    def kv_put(self, key: str, value: bytes, version: int) -> None:
        """Write key ``key`` at ``version``."""
        self._db.execute("INSERT OR REPLACE INTO kv VALUES (?, ?, ?)", (key, value, version))

    def kv_delete(self, key: str) -> None:
        """Delete key ``key``."""
        self._db.execute("DELETE FROM kv WHERE key = ?", (key,))

    def kv_writer(self, key: str) -> tuple[str, int] | None:
        """(writer, version it wrote; 0 for a delete) of the last write of ``key`` that named its writer."""
        row = self._db.execute("SELECT writer, version FROM kv_writer WHERE key = ?", (key,)).fetchone()
        return None if row is None else (str(row[0]), int(row[1]))

    def kv_put_writer(self, key: str, writer: str, version: int) -> None:
        """Record that ``writer`` wrote ``key`` at ``version`` (0: deleted it); "" forgets the key's writer."""
        if writer:
            self._db.execute("INSERT OR REPLACE INTO kv_writer VALUES (?, ?, ?)", (key, writer, version))
        else:
            self._db.execute("DELETE FROM kv_writer WHERE key = ?", (key,))

    def kv_delete_range(self, key: str, range_end: str) -> tuple[int, int]:
        """Delete the keys in ``[key, range_end)``: (how many, the highest version among them; 0 if none)."""
        found = self._db.execute("SELECT COUNT(*), MAX(version) FROM kv WHERE key >= ? AND key < ?",
                                 (key, range_end)).fetchone()  # fmt: skip
        if found[0]:
            self._db.execute("DELETE FROM kv WHERE key >= ? AND key < ?", (key, range_end))
        self._db.execute("DELETE FROM kv_writer WHERE key >= ? AND key < ?", (key, range_end))
        return int(found[0]), int(found[1] or 0)

    def kv_scan(self, prefix: str) -> list[tuple[str, bytes]]:
        """The keys that start with ``prefix`` and their values, in key order."""
        rows = self._db.execute("SELECT key, value FROM kv WHERE substr(key, 1, ?) = ? ORDER BY key",
                                (len(prefix), prefix))  # fmt: skip
        return [(str(k), bytes(v)) for k, v in rows]

    # -- staged commits (sinks) ------------------------------------------------
    def put_staged(self, dataset: str, producer: str, part: str, epoch: int, records: int, files: list[str],
                   previous: int | None = None) -> None:  # fmt: skip
        """Record a staged commit: its key (dataset, producer, part, epoch), records, files, and the previous epoch
        of (producer, part) its sink named (kept apart, as a record of the chain: the gaps are derived from it)."""
        self._db.execute(
            "INSERT INTO staged VALUES (?, ?, ?, ?, ?, ?)",
            (dataset, producer, part, epoch, records, json.dumps(files)),
        )
        if previous is not None:
            self._db.execute("INSERT INTO staged_previous VALUES (?, ?, ?, ?, ?)",
                             (dataset, producer, part, epoch, previous))  # fmt: skip

    def put_staged_files(self, dataset: str, producer: str, part: str, epoch: int, files: list[str]) -> None:
        """Rewrite a staged commit's files (compaction forgets the uris of compacted files: compaction.py)."""
        self._db.execute("UPDATE staged SET files = ? WHERE dataset = ? AND producer = ? AND part = ? AND epoch = ?",
                         (json.dumps(files), dataset, producer, part, epoch))  # fmt: skip

    def load_staged(self) -> list[tuple[str, str, str, int, int, list[str]]]:
        """Every staged commit, by key."""
        return [
            (str(d), str(p), str(k), int(e), int(r), [str(f) for f in json.loads(files)])
            for d, p, k, e, r, files in self._db.execute("SELECT * FROM staged ORDER BY dataset, producer, part, epoch")
        ]

    def delete_staged_of(self, dataset: str) -> None:
        """Delete the staged commits of ``dataset``, and its commit gaps."""
        self._db.execute("DELETE FROM staged WHERE dataset = ?", (dataset,))
        self._db.execute("DELETE FROM staged_previous WHERE dataset = ?", (dataset,))
        self._db.execute("DELETE FROM staged_gaps WHERE dataset = ?", (dataset,))

    # -- commit gaps of staged datasets (gaps.py) ----------------------------------
    def put_gap(self, dataset: str, producer: str, part: str, epoch: int, next_epoch: int, opened_at: float,
                skipped: bool) -> None:  # fmt: skip
        """Record (or update) the open gap at (dataset, producer, part, epoch)."""
        self._db.execute(
            "INSERT OR REPLACE INTO staged_gaps VALUES (?, ?, ?, ?, ?, ?, ?)",
            (dataset, producer, part, epoch, next_epoch, opened_at, 1 if skipped else 0),
        )

    def delete_gap(self, dataset: str, producer: str, part: str, epoch: int) -> None:
        """The gap at (dataset, producer, part, epoch) closed."""
        self._db.execute("DELETE FROM staged_gaps WHERE dataset = ? AND producer = ? AND part = ? AND epoch = ?",
                         (dataset, producer, part, epoch))  # fmt: skip

    def load_gaps(self) -> list[tuple[str, str, str, int, int, float, bool]]:
        """Every open gap: (dataset, producer, part, epoch, next epoch, opened at, skipped)."""
        return [
            (str(d), str(p), str(k), int(e), int(n), float(t), bool(s))
            for d, p, k, e, n, t, s in self._db.execute("SELECT * FROM staged_gaps ORDER BY dataset, opened_at")
        ]


__all__ = ["JournalTables"]
