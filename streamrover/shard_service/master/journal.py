"""The shard service's durable journal: SQLite in WAL mode.

The journal holds the service's state as tables (datasets, shards, workers,
committed cursor, cuts, counters), not as an ever-growing log: every RPC that
changes state writes its rows and commits one transaction before it answers,
and compaction is deleting rows — shards inside the committed cursor, old cuts,
dead workers — so the file stays proportional to the live state.

Durability: with ``synchronous=NORMAL`` (the default) a commit reaches the
operating system before the RPC answers, which survives the master process
being killed at any point (SIGKILL); an operating-system crash or power loss
may lose the last transactions. ``durability="fsync"`` (``synchronous=FULL``)
survives those too, at the cost of an fsync per state change.

Group commit (``group_commit = True``, set by the master's :class:`~.group_commit.CommitLock`):
a transaction that ends while others are about to start is not committed on its own. It stays
in the open SQLite transaction (as a savepoint, so that a failing one rolls back only its own
writes), and the group's last transaction commits them all with one COMMIT (one write to the
WAL; one fsync with ``durability="fsync"``). ``written`` counts the transactions ended,
``durable`` those committed: an answer built from the state after transaction ``n`` may leave
only once ``durable >= n`` (the lock waits for that).
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import replace
from pathlib import Path
from types import TracebackType

from streamrover.shard_service.api import DatasetSpec, PartitionPlan, ShardState
from streamrover.shard_service.master.bookkeeping import DatasetRecord, ShardRecord, WorkerRecord
from streamrover.shard_service.master.journal_tables import JournalTables
from streamrover.sources.api import SourceKind
from streamrover.sources.positions import RecordRuns

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS datasets (
    name TEXT PRIMARY KEY, spec TEXT NOT NULL, kind TEXT NOT NULL, partitions TEXT NOT NULL,
    schema TEXT NOT NULL, epochs_planned INTEGER NOT NULL, dead_letters INTEGER NOT NULL, failed TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS partition_ends (
    dataset TEXT NOT NULL, pindex INTEGER NOT NULL, "end" INTEGER NOT NULL, PRIMARY KEY (dataset, pindex))
    WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS shards (
    id TEXT PRIMARY KEY, dataset TEXT NOT NULL, epoch INTEGER NOT NULL, pindex INTEGER NOT NULL,
    start INTEGER NOT NULL, "end" INTEGER NOT NULL, state TEXT NOT NULL, attempt INTEGER NOT NULL,
    worker TEXT, acked_to INTEGER NOT NULL, acks TEXT NOT NULL, acked_by TEXT NOT NULL, priority REAL NOT NULL,
    time REAL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS workers (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, last_request_id INTEGER NOT NULL, last_lease_ids TEXT NOT NULL)
    WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS cursor (
    dataset TEXT NOT NULL, epoch INTEGER NOT NULL, partition TEXT NOT NULL, intervals TEXT NOT NULL,
    PRIMARY KEY (dataset, epoch, partition));
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value BLOB NOT NULL, version INTEGER NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS kv_writer (key TEXT PRIMARY KEY, writer TEXT NOT NULL, version INTEGER NOT NULL)
    WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS cuts (
    id INTEGER PRIMARY KEY, step INTEGER, cursor TEXT NOT NULL, state TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    dataset TEXT NOT NULL, pindex INTEGER NOT NULL, start INTEGER NOT NULL, "end" INTEGER NOT NULL,
    PRIMARY KEY (dataset, pindex, start)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS staged (
    dataset TEXT NOT NULL, producer TEXT NOT NULL, part TEXT NOT NULL, epoch INTEGER NOT NULL,
    records INTEGER NOT NULL, files TEXT NOT NULL, PRIMARY KEY (dataset, producer, part, epoch)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS staged_previous (
    dataset TEXT NOT NULL, producer TEXT NOT NULL, part TEXT NOT NULL, epoch INTEGER NOT NULL,
    previous INTEGER NOT NULL, PRIMARY KEY (dataset, producer, part, epoch)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS staged_gaps (
    dataset TEXT NOT NULL, producer TEXT NOT NULL, part TEXT NOT NULL, epoch INTEGER NOT NULL,
    next_epoch INTEGER NOT NULL, opened_at REAL NOT NULL, skipped INTEGER NOT NULL,
    PRIMARY KEY (dataset, producer, part, epoch)) WITHOUT ROWID;
"""

# the columns a lease, an ack and a lease request change (an UPDATE, not a delete and re-insert of the whole row)
_LEASED = "UPDATE shards SET state = ?, attempt = ?, worker = ? WHERE id = ?"
_ACKED = "UPDATE shards SET state = ?, worker = ?, acked_to = ?, acks = ?, acked_by = ? WHERE id = ?"
_REQUEST = "UPDATE workers SET last_request_id = ?, last_lease_ids = ? WHERE id = ?"


def _pairs(pairs: list[tuple[int | None, int]]) -> str:
    """A shard's acks or acked_by as JSON (integers, and null for no step), written without the json module."""
    return "[" + ",".join([f"[{'null' if a is None else f'{a:d}'},{b:d}]" for a, b in pairs]) + "]"


class JournalError(Exception):
    """The journal cannot be opened or written (wrong version, disk full...)."""


class JournalWriteError(JournalError):
    """A write failed (disk full, I/O error): memory may now be ahead of the journal, so the master must stop.

    Once one is raised the journal refuses every further transaction: nothing may be answered from
    state that is not durable. A restarted master replays the journal, which holds exactly the
    transactions that committed.
    """


class _Transaction:
    """The context manager :meth:`Journal.transaction` returns (one per journal: transactions nest by depth)."""

    __slots__ = ("_journal",)

    def __init__(self, journal: Journal) -> None:
        self._journal = journal

    def __enter__(self) -> None:
        self._journal._begin()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._journal._end(exc)


class Journal(JournalTables):
    """Write-through storage of the core's records. Not thread-safe: the core serialises access."""

    def __init__(self, path: str | Path, durability: str = "normal", exclusive: bool = False) -> None:
        """Open (or create) the journal at ``path``; ``exclusive``: this connection alone may read or write the
        file while it is open (SQLite's EXCLUSIVE locking mode: no file lock taken and released per transaction,
        the WAL index in this process's memory), which the master uses, as it owns its state directory anyway."""
        if durability not in ("normal", "fsync"):
            raise JournalError(f"durability must be 'normal' or 'fsync', got {durability!r}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        if exclusive:  # before the first WAL access, so that no shared-memory WAL index is made
            self._db.execute("PRAGMA locking_mode=EXCLUSIVE")
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={'FULL' if durability == 'fsync' else 'NORMAL'}")
        self._db.executescript(_SCHEMA)
        if "time" not in {row[1] for row in self._db.execute("PRAGMA table_info(shards)")}:  # a journal from before
            self._db.execute("ALTER TABLE shards ADD COLUMN time REAL")  # shards' stream times (issue 28)
        self._lock = threading.Lock()
        self._depth = 0
        self._in_group = False  # the open transaction is a savepoint in the open group
        self._transaction = _Transaction(self)
        self.group_commit = False  # True: an ended transaction waits in the open group for commit()
        self._group_open = False  # an SQLite transaction holds ended, not yet committed transactions
        self.written = 0  # transactions ended (committed, or waiting in the open group)
        self.durable = 0  # transactions committed
        self.commits = 0  # COMMITs made (with group commit, fewer than transactions)
        self._undone = 0  # transactions rolled back: a dataset's partitions are written whole after one (put_dataset)
        self._meta: dict[str, str] = {}  # meta values as written (a lease rewrites five counters, mostly unchanged)
        self.failed = ""  # why a write failed (then every later transaction is refused)
        version = self.get_meta("schema_version")
        if version is None:
            self.put_meta("schema_version", str(SCHEMA_VERSION))
        elif int(version) != SCHEMA_VERSION:
            raise JournalError(f"journal {self.path} has schema version {version}; this build reads {SCHEMA_VERSION}")

    def close(self) -> None:
        """Close the database (an open group of transactions is committed first, unless a write failed)."""
        if self._group_open and not self.failed:
            self.commit()
        self._db.close()

    def transaction(self) -> _Transaction:
        """One atomic unit: everything written inside is committed together, or not at all.

        With ``group_commit`` it is committed by :meth:`commit` (with the transactions around it),
        not when it ends: nothing built from its state may be answered before ``durable`` reaches it.
        """
        return self._transaction

    def _begin(self) -> None:
        """Enter a transaction (:class:`_Transaction`): the outermost begins it (a savepoint in an open group)."""
        if self._depth:
            self._depth += 1
            return
        if self.failed:
            raise JournalWriteError(self.failed)
        self._in_group = self._group_open  # earlier transactions wait in the open one: this one is a savepoint in it
        try:
            self._db.execute("SAVEPOINT tx" if self._in_group else "BEGIN IMMEDIATE")
        except (sqlite3.Error, OSError) as exc:  # a write failed (an OSError from below SQLite, e.g. a VFS, too)
            self._fail(exc)
        self._depth = 1

    def _end(self, raised: BaseException | None) -> None:
        """Leave a transaction: the outermost ends it (rolled back when the body ``raised``; a failed write fails
        the journal)."""
        if self._depth > 1:
            self._depth -= 1
            return
        try:
            if raised is not None:
                self._undo(self._in_group)
                if isinstance(raised, (sqlite3.Error, OSError)):  # a write inside failed
                    self._fail(raised)
            elif self._in_group:
                self._db.execute("RELEASE tx")
                self.written += 1
            elif self.group_commit:
                self._group_open = True
                self.written += 1
            else:
                self._db.execute("COMMIT")
                self.commits += 1
                self.durable = self.written + 1
                self.written += 1
        except (sqlite3.Error, OSError) as exc:
            self._fail(exc)
        finally:
            self._depth = 0

    def commit(self) -> None:
        """Commit the open group (group commit): every transaction ended so far becomes durable at once."""
        if not self._group_open:
            return
        self._group_open = False
        try:
            self._db.execute("COMMIT")
        except (sqlite3.Error, OSError) as exc:
            self._fail(exc)
        self.commits += 1
        self.durable = self.written

    def _fail(self, exc: BaseException) -> None:
        """A write failed: roll back what is not committed (the whole open group), refuse every later write."""
        self._group_open = False
        self._rollback()
        self.failed = f"journal {self.path} write failed: {exc}"
        raise JournalWriteError(self.failed) from exc

    def _undo(self, in_group: bool) -> None:
        """A transaction raised: roll back its own writes (only the savepoint when earlier ones share the group)."""
        self._undone += 1
        if not in_group:
            self._group_open = False
            self._rollback()
            return
        self._meta.clear()
        try:
            self._db.execute("ROLLBACK TO tx")
            self._db.execute("RELEASE tx")
        except sqlite3.Error as exc:  # SQLite rolled the whole transaction back by itself: the group is lost
            self._group_open = False
            self._rollback()
            self.failed = f"journal {self.path} lost the transactions waiting for their commit: {exc}"

    def _rollback(self) -> None:
        self._undone += 1
        self._meta.clear()  # what the rolled back transaction wrote is gone
        if self._db.in_transaction:  # SQLite rolls back by itself after some errors (disk full)
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error:
                pass  # the write already failed; the caller reports that

    # -- meta ----------------------------------------------------------------
    def get_meta(self, key: str) -> str | None:
        """The value of meta key ``key``, or None."""
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def put_meta(self, key: str, value: str) -> None:
        """Write ``key`` (skipped when it holds ``value`` already)."""
        if self._meta.get(key) == value:
            return
        self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))
        self._meta[key] = value

    # -- datasets ------------------------------------------------------------
    def put_dataset(self, ds: DatasetRecord) -> None:
        """Write a dataset's row (and the record runs of its sparse partitions that changed). Its partition list is
        written whole only when its shape changed (partitions added or compacted, a floor) or after a rollback;
        else only the ends set since (``PartitionPlans.changed``) go to ``partition_ends`` (issue 32)."""
        plans = ds.plans
        floors = {i: runs.floor for i, runs in ds.runs.items() if runs.floor is not None}
        shape = (self._undone, plans.base, list.__len__(plans), tuple(sorted(floors.items())))
        for pindex, runs in sorted(ds.runs.items()):  # sparse partitions: the runs changed since the last write
            changed = runs.take_changed()
            if changed is not None:
                lo, rows = changed
                where = "dataset = ? AND pindex = ? AND start >= ?"
                self._db.execute(f"DELETE FROM runs WHERE {where}", (ds.name, pindex, lo))
                self._db.executemany(
                    "INSERT INTO runs VALUES (?, ?, ?, ?)", [(ds.name, pindex, a, b) for a, b in rows]
                )
        fields = (ds.spec.to_json(), ds.kind.value, ds.schema_json, ds.epochs_planned, ds.dead_letters, ds.failed)
        if plans.written == shape:
            if plans.changed:
                self._db.executemany(
                    'INSERT OR REPLACE INTO partition_ends VALUES (?, ?, ?)',
                    [(ds.name, i, plans[i].end) for i in sorted(plans.changed)],
                )
                plans.changed.clear()
            self._db.execute(
                "UPDATE datasets SET spec = ?, kind = ?, schema = ?, epochs_planned = ?, dead_letters = ?, "
                "failed = ? WHERE name = ?",
                (*fields, ds.name),
            )
            return
        parts = json.dumps([[p.index, p.id, p.start, p.end, *([floors[p.index]] if p.index in floors else [])]
                            for p in plans])  # fmt: skip
        self._db.execute("DELETE FROM partition_ends WHERE dataset = ?", (ds.name,))
        spec, kind, schema, epochs, dead, failed = fields
        self._db.execute(
            "INSERT OR REPLACE INTO datasets VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (ds.name, spec, kind, parts, schema, epochs, dead, failed),
        )
        plans.written, plans.changed = shape, set()

    def load_datasets(self) -> list[DatasetRecord]:
        """Every dataset's record, by name."""
        out = []
        rows = self._db.execute("SELECT * FROM datasets ORDER BY name")
        for _name, spec, kind, parts, schema, epochs, dead, failed in rows:
            rows = json.loads(parts)  # [index, id, start, end] and the runs' floor of a compacted sparse partition
            partitions = [PartitionPlan(int(i), str(pid), int(s), int(e)) for i, pid, s, e, *_ in rows]
            record = DatasetRecord(DatasetSpec.from_json(spec), SourceKind(kind), partitions, schema, int(epochs))
            record.runs = self._load_runs(record.name)
            for i, *_, floor in (row for row in rows if len(row) > 4):
                record.runs.setdefault(int(i), RecordRuns()).floor = int(floor)
            record.dead_letters, record.failed = int(dead), str(failed)
            compacted = self.get_meta(f"compacted:{record.name}")  # a staged dataset's compacted files (staged.py)
            if compacted is not None:
                files, record.compacted_records = (int(v) for v in compacted.split(":"))
                record.plans.base = files
            ends = self._db.execute('SELECT pindex, "end" FROM partition_ends WHERE dataset = ?', (record.name,))
            for pindex, end in (row for row in ends if row[0] >= record.plans.base):  # written since the list
                record.plans[int(pindex)] = replace(record.plans[int(pindex)], end=int(end))
            record.plans.changed = set()
            out.append(record)
        return out

    def _load_runs(self, dataset: str) -> dict[int, RecordRuns]:
        by_partition: dict[int, list[tuple[int, int]]] = {}
        query = 'SELECT pindex, start, "end" FROM runs WHERE dataset = ? ORDER BY pindex, start'
        rows = self._db.execute(query, (dataset,))
        for pindex, a, b in rows:
            by_partition.setdefault(int(pindex), []).append((int(a), int(b)))
        out = {}
        for pindex, runs in by_partition.items():
            out[pindex] = RecordRuns(runs)
            out[pindex].changed_from = None  # as journalled
        return out

    def delete_runs_of(self, dataset: str) -> None:
        """Forget a dataset's runs (a new dataset of that name starts without)."""
        self._db.execute("DELETE FROM runs WHERE dataset = ?", (dataset,))

    def delete_dataset(self, name: str) -> None:
        """Delete dataset ``name``'s row (and what of its files is compacted)."""
        self._db.execute("DELETE FROM datasets WHERE name = ?", (name,))
        self._db.execute("DELETE FROM partition_ends WHERE dataset = ?", (name,))
        self._db.execute("DELETE FROM meta WHERE key = ?", (f"compacted:{name}",))
        self._meta.pop(f"compacted:{name}", None)

    def put_compacted(self, ds: DatasetRecord) -> None:
        """Write how many of a staged dataset's files are compacted and their records (its row holds the rest)."""
        self.put_meta(f"compacted:{ds.name}", f"{ds.plans.base}:{ds.compacted_records}")

    # -- shards --------------------------------------------------------------
    def put_shard(self, s: ShardRecord) -> None:
        """Write a shard's row."""
        self._db.execute(
            "INSERT OR REPLACE INTO shards VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                s.id,
                s.dataset,
                s.epoch,
                s.pindex,
                s.start,
                s.end,
                s.state.value,
                s.attempt,
                s.worker,
                s.acked_to,
                _pairs(s.acks),
                _pairs(sorted(s.acked_by.items())),
                s.priority,
                s.time,
            ),
        )

    def put_shard_leased(self, s: ShardRecord) -> None:
        """Write what a lease changes in a shard's row (state, attempt, worker; the whole row when it has none)."""
        if self._db.execute(_LEASED, (s.state.value, s.attempt, s.worker, s.id)).rowcount != 1:
            self.put_shard(s)

    def put_shard_acked(self, s: ShardRecord) -> None:
        """Write what an ack changes in a shard's row (state, worker, acked_to, acks, acked_by; the whole row when
        it has none)."""
        row = (s.state.value, s.worker, s.acked_to, _pairs(s.acks), _pairs(sorted(s.acked_by.items())), s.id)
        if self._db.execute(_ACKED, row).rowcount != 1:
            self.put_shard(s)

    def delete_shard(self, shard_id: str) -> None:
        """Delete a shard's row."""
        self._db.execute("DELETE FROM shards WHERE id = ?", (shard_id,))

    def delete_shards_of(self, dataset: str) -> None:
        """Delete the rows of every shard of ``dataset``."""
        self._db.execute("DELETE FROM shards WHERE dataset = ?", (dataset,))

    def load_shards(self) -> list[ShardRecord]:
        """Every shard's record."""
        out = []
        for row in self._db.execute("SELECT * FROM shards"):
            sid, ds, epoch, pindex, start, end, state, attempt, worker, acked_to, acks, acked_by, prio, time = row
            out.append(
                ShardRecord(
                    id=sid,
                    dataset=ds,
                    epoch=epoch,
                    pindex=pindex,
                    start=start,
                    end=end,
                    state=ShardState(state),
                    attempt=attempt,
                    worker=worker,
                    acked_to=acked_to,
                    acks=[(a[0], a[1]) for a in json.loads(acks)],
                    acked_by={int(k): int(v) for k, v in json.loads(acked_by)},
                    priority=prio,
                    time=time,
                )
            )
        return out

    # -- workers -------------------------------------------------------------
    def put_worker(self, w: WorkerRecord) -> None:
        """Write a worker's row (its last lease request, for retries)."""
        self._db.execute(
            "INSERT OR REPLACE INTO workers VALUES (?, ?, ?, ?)",
            (w.id, w.name, w.last_request_id, json.dumps(w.last_lease_ids)),
        )

    def put_worker_request(self, w: WorkerRecord) -> None:
        """Write a worker's last lease request (its id and lease ids; the whole row when it has none)."""
        if self._db.execute(_REQUEST, (w.last_request_id, json.dumps(w.last_lease_ids), w.id)).rowcount != 1:
            self.put_worker(w)

    def delete_worker(self, worker_id: str) -> None:
        """Delete a worker's row."""
        self._db.execute("DELETE FROM workers WHERE id = ?", (worker_id,))

    def load_workers(self) -> list[WorkerRecord]:
        """Every worker's record (liveness is not journalled)."""
        return [
            WorkerRecord(id=i, name=n, last_request_id=r, last_lease_ids=json.loads(ids))
            for i, n, r, ids in self._db.execute("SELECT * FROM workers")
        ]
