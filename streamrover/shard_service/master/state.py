"""The shard table: the core's own state (datasets, shards and their queues, workers), loaded from and written
through to the journal, and every shard state change (:data:`TRANSITIONS`).

The parts the core composes keep their own state: the cut book (``cuts.py``: cuts, the committed and durable
cursors), stream planning (``streams.py``, ``upstream.py``), staged commits (``staged.py``), the key-value
store (``kv.py``). They change shards only through this table's public methods.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterable

from streamrover.cursor import DataCursor, IntervalSet, PartitionKey
from streamrover.shard_service.api import (
    DEFAULT_LEASE_TTL,
    FailedPreconditionError,
    NotFoundError,
    ShardState,
    shard_id_for,
)
from streamrover.shard_service.master import lease_order
from streamrover.shard_service.master.bookkeeping import DatasetRecord, ShardRecord, WorkerRecord
from streamrover.shard_service.master.journal import Journal
from streamrover.shard_service.master.lease_order import TimeMarks
from streamrover.shard_service.master.planner import PlannedShard, plan_epoch
from streamrover.shard_service.master.tallies import AckRates, BoundedSet
from streamrover.sources.api import SourceKind
from streamrover.sources.staged import is_staged

# shard ids discarded by restores that an ack is told about precisely ("revoked by a restore"); older
# ones get the generic refusal. Memory only (a restarted master remembers none): refusals either way.
MAX_RESTORE_REVOKED = 65_536
LEASE_SEQ_BLOCK = 1024  # lease attempt numbers reserved in the journal at a time (state.next_attempt)


class IllegalTransitionError(RuntimeError):
    """A shard state change the transition table does not allow: a bug in the core, never a client's fault."""


#: Every shard state change the core makes, with its guard (what must hold of the shard record when it is made).
#: A shard is born TODO (planned) and leaves the core by being dropped: compacted once inside the committed
#: cursor (ACKED), discarded by a restore or a dataset's removal (any state). Nothing else changes its state.
TRANSITIONS: dict[tuple[ShardState, ShardState], tuple[str, Callable[[ShardRecord], bool]]] = {
    (ShardState.TODO, ShardState.LEASED): ("leased to a worker", lambda s: True),
    (ShardState.LEASED, ShardState.TODO): ("lease returned: expired, worker left or died", lambda s: True),
    (ShardState.LEASED, ShardState.ACKED): ("acked to its end", lambda s: s.acked_to == s.end),
}


class CoreState:
    """The shard table: records of datasets, shards and workers, the indexes over them, and the journal counters."""

    def __init__(self, journal: Journal, lease_ttl: float = DEFAULT_LEASE_TTL, clock: Callable[[], float] = time.time):
        self.journal = journal
        self.lease_ttl = lease_ttl
        self.clock = clock
        self.datasets: dict[str, DatasetRecord] = {}
        self.shards: dict[str, ShardRecord] = {}
        self.by_dataset: dict[str, set[str]] = {}
        self.queues: dict[str, list[tuple[float, str]]] = {}
        self.state_counts: dict[str, Counter[ShardState]] = {}
        self.leased: set[str] = set()
        self.stream_time = lease_order.StreamTime(self.shards)  # the oldest shard not yet acked, per stream
        # lease affinity (core.lease): leased shards per (dataset, epoch, partition index), shards
        # waiting by (dataset, epoch, partition index, start), and per worker and dataset where the
        # last shard it was granted ends, (epoch, partition index, end). Memory only.
        self.reading: Counter[tuple[str, int, int]] = Counter()
        self.todo_at: dict[tuple[str, int, int, int], str] = {}
        self.tails: dict[tuple[str, str], tuple[int, int, int]] = {}
        self.unfolded: set[str] = set()  # shards with acks not yet in the committed cursor
        self.workers: dict[str, WorkerRecord] = {}
        self.restore_revoked = BoundedSet(lambda: MAX_RESTORE_REVOKED)
        self.ack_log = AckRates()
        self.events: Counter[str] = Counter()  # since start, memory only (metrics): leases_granted, joins, workers_lost
        self.started = clock()
        # lease attempts: the last one issued, and the highest the journal has reserved (LEASE_SEQ_BLOCK at a
        # time, so a lease does not write the counter): a restart goes on after the reservation
        self._lease_seq = int(journal.get_meta("lease_seq") or 0)
        self._lease_reserved = self._lease_seq
        self._front = float(journal.get_meta("front_priority") or 0.0)
        self._back = float(journal.get_meta("back_priority") or 0.0)
        self._load()

    # ------------------------------------------------------------------ loading
    def _load(self) -> None:
        now = self.clock()
        for ds in self.journal.load_datasets():
            self.datasets[ds.name] = ds
            self._new_dataset_indexes(ds.name)
        for w in self.journal.load_workers():
            w.last_seen = now
            self.workers[w.id] = w
        shards = self.journal.load_shards()
        staged = [s for s in shards if s.time is None and is_staged(self.datasets[s.dataset].spec.uri)]
        for i, s in enumerate(sorted(staged, key=lambda s: s.priority)):  # from a journal before stream times: no
            s.time = s.priority = now * 1000.0 + i / 1000.0  # poller reads a staged dataset's (a stream's are read)
        for s in shards:
            self._index(s)
            if s.state is ShardState.LEASED:
                s.deadline = now + self.lease_ttl
                worker = self.workers.get(s.worker or "")
                if worker is None:  # worker row gone with the lease still recorded: return the shard
                    self._set_state(s, ShardState.TODO)
                    s.worker = None
                    self._push(s)
                else:
                    worker.leases.add(s.id)

    def _index(self, s: ShardRecord) -> None:
        self.shards[s.id] = s
        self.by_dataset[s.dataset].add(s.id)
        self.state_counts[s.dataset][s.state] += 1
        self.stream_time.track(s)
        if s.state is ShardState.TODO and not self.held(s):
            heapq.heappush(self.queues[s.dataset], (s.priority, s.id))
        elif s.state is ShardState.LEASED:
            self.leased.add(s.id)
        self._track(s, s.state, +1)
        if s.acks:
            self.unfolded.add(s.id)

    def _set_state(self, s: ShardRecord, state: ShardState) -> None:
        """Every shard state change goes through here, so the per-dataset counts stay exact.

        Only the changes in :data:`TRANSITIONS` are made, and only when their guard holds;
        anything else raises :class:`IllegalTransitionError` before anything changes.
        """
        rule = TRANSITIONS.get((s.state, state))
        if rule is None or not rule[1](s):
            what = "no such transition" if rule is None else f"its guard failed ({rule[0]})"
            raise IllegalTransitionError(
                f"shard {s.id!r}: {s.state.value} -> {state.value}: {what} "
                f"(acked to {s.acked_to} of [{s.start}, {s.end}))"
            )
        counts = self.state_counts[s.dataset]
        counts[s.state] -= 1
        counts[state] += 1
        self._track(s, s.state, -1)
        self._track(s, state, +1)
        s.state = state
        if state is ShardState.LEASED:
            self.leased.add(s.id)
        else:
            self.leased.discard(s.id)

    def todo(self, name: str) -> int:
        """How many shards of dataset ``name`` wait to be leased (0 for an unknown name)."""
        counts = self.state_counts.get(name)
        return counts[ShardState.TODO] if counts is not None else 0

    def add_shard(self, s: ShardRecord) -> None:
        """Add a shard's record to memory and its indexes (the caller journals it)."""
        self._index(s)

    def drop_shard(self, sid: str) -> ShardRecord:
        """Remove a shard from memory (the caller deletes its journal row)."""
        s = self.shards.pop(sid)
        self.by_dataset[s.dataset].discard(sid)
        self.unfolded.discard(sid)
        self.leased.discard(sid)
        self.state_counts[s.dataset][s.state] -= 1
        self._track(s, s.state, -1)
        return s

    def _track(self, s: ShardRecord, state: ShardState, delta: int) -> None:
        """Keep the affinity indexes (``reading``, ``todo_at``) as ``s`` enters (+1) or leaves (-1) ``state``."""
        if state is ShardState.LEASED:
            key = (s.dataset, s.epoch, s.pindex)
            self.reading[key] += delta
            if self.reading[key] <= 0:
                del self.reading[key]
        elif state is ShardState.TODO:
            at = (s.dataset, s.epoch, s.pindex, s.start)
            if delta > 0:
                self.todo_at[at] = s.id
            elif self.todo_at.get(at) == s.id:
                del self.todo_at[at]

    def _new_dataset_indexes(self, name: str) -> None:
        self.by_dataset[name] = set()
        self.queues[name] = []
        self.state_counts[name] = Counter()

    def _push(self, s: ShardRecord, front: bool = False) -> None:
        if front:
            self._front -= 1
            s.priority = self._front
        heapq.heappush(self.queues[s.dataset], (s.priority, s.id))

    def next_attempt(self) -> int:
        """A new lease attempt number: above every one issued before, by this process or one before it.

        Journalled as a reservation of :data:`LEASE_SEQ_BLOCK` numbers (by :meth:`save_counters`, in the
        transaction of the lease that needed it), so most leases write no counter; a restarted master
        starts after the reservation, leaving the rest of the block unused.
        """
        self._lease_seq += 1
        if self._lease_seq > self._lease_reserved:
            self._lease_reserved = self._lease_seq + LEASE_SEQ_BLOCK - 1
        return self._lease_seq

    def save_counters(self) -> None:
        """Journal the table's counters (lease attempts, queue priorities); call with a transaction open."""
        j = self.journal
        j.put_meta("lease_seq", str(self._lease_reserved))  # skipped while unchanged
        j.put_meta("front_priority", repr(self._front))
        j.put_meta("back_priority", repr(self._back))

    def add_dataset(self, ds: DatasetRecord) -> None:
        """Add a new dataset's record (its shards are planned after)."""
        self.datasets[ds.name] = ds
        self._new_dataset_indexes(ds.name)

    def dataset(self, name: str) -> DatasetRecord:
        """The record of dataset ``name``; :class:`NotFoundError` naming the registered ones otherwise."""
        ds = self.datasets.get(name)
        if ds is None:
            known = ", ".join(sorted(self.datasets)) or "none"
            raise NotFoundError(f"dataset {name!r} is not registered (registered: {known})")
        return ds

    def add_planned(
        self,
        ds: DatasetRecord,
        planned: Iterable[PlannedShard],
        times: TimeMarks | None = None,
        hold: bool = False,
        head: bool = False,
    ) -> None:
        """Add planned shards to ``ds`` (TODO, at the back of its queue) and journal them.

        A stream's shards are queued by stream time (:mod:`.lease_order`): the time ``times`` gives their start, else
        when they are planned (in the order given); ``hold``: their times are read from the source first
        (:meth:`untimed`, :meth:`set_times`), they are not leased before; ``head``: shards at the stream's head of
        a source that tells record times, planned in time order: they follow the newest time known, at once.
        """
        stream = ds.kind is SourceKind.STREAM
        now = self.clock() * 1000.0
        newest = self.stream_time.newest(ds.name) if head else None
        for i, p in enumerate(planned):
            self._back += 1
            sid = shard_id_for(ds.name, p.epoch, p.partition.index, p.start, p.end)
            s = ShardRecord(sid, ds.name, p.epoch, p.partition.index, p.start, p.end, priority=self._back)
            if stream and not hold:  # planned in this order: a microsecond apart
                at = lease_order.time_at(times, p.partition.index, p.start) if times else None
                if at is None and newest is not None:
                    at = newest + (i + 1) / 1000.0
                    self.stream_time.provisional(s)
                s.time = s.priority = now + i / 1000.0 if at is None else at
            self._index(s)
            self.journal.put_shard(s)

    def held(self, s: ShardRecord) -> bool:
        """Whether ``s`` waits for its stream time to be read (not leased before)."""
        return s.time is None and self.datasets[s.dataset].kind is SourceKind.STREAM

    def untimed(self, name: str) -> list[ShardRecord]:
        """The shards of stream dataset ``name`` whose time the poller is to read from the source."""
        return [s for s in self.shards_of(name) if s.time is None and s.state is ShardState.TODO]

    def set_times(self, name: str, times: dict[str, float | None]) -> None:
        """Give held shards of ``name`` their stream times (ms; None: not known, then when the master planned them)
        and queue them, and leased head shards theirs (:meth:`.StreamTime.to_retime`); journalled. Shards gone or
        timed meanwhile are skipped."""
        now = self.clock() * 1000.0
        with self.journal.transaction():
            for i, (sid, t) in enumerate(times.items()):
                s = self.shards.get(sid)
                if s is not None and s.time is not None and s.dataset == name:
                    if self.stream_time.retime(s, None if t is None else float(t)):
                        self.journal.put_shard(s)
                if s is None or s.time is not None or s.dataset != name:
                    continue
                s.time = s.priority = now + i / 1000.0 if t is None else float(t)
                self.stream_time.track(s)
                if s.state is ShardState.TODO:
                    heapq.heappush(self.queues[name], (s.priority, s.id))
                self.journal.put_shard(s)

    def key_of(self, s: ShardRecord) -> PartitionKey:
        """The cursor key of a shard's records: (dataset, epoch, partition id)."""
        return PartitionKey(s.dataset, s.epoch, self.datasets[s.dataset].partitions[s.pindex].id)

    def shards_of(self, name: str, ordered: bool = False) -> list[ShardRecord]:
        """The shards of dataset ``name`` (in shard id order when ``ordered``)."""
        sids = self.by_dataset[name]
        return [self.shards[sid] for sid in (sorted(sids) if ordered else sids)]

    def check_usable(self, ds: DatasetRecord) -> None:
        """Raise :class:`FailedPreconditionError` with the reason when the dataset failed."""
        if ds.failed:
            raise FailedPreconditionError(f"dataset {ds.name!r} failed: {ds.failed}")

    def plan_next_epoch(self, ds: DatasetRecord) -> None:
        """Plan the next epoch of a batch dataset (its shards join the back of the queue)."""
        epoch = ds.epochs_planned
        ds.epochs_planned += 1
        spec = ds.spec
        self.add_planned(ds, plan_epoch(ds.partitions, epoch, ds.shard_size, spec.shuffle, spec.seed))
        self.journal.put_dataset(ds)

    # ------------------------------------------------------------------ the queue
    def pop_todo(self, ds: DatasetRecord, w: WorkerRecord | None = None) -> ShardRecord | None:
        """The next shard to lease to ``w`` (None: none now): :func:`.lease_order.pop_todo`."""
        return lease_order.pop_todo(self, ds, w)

    def share(self, ds: DatasetRecord, w: WorkerRecord, wanted: int) -> int:
        """How many of ``wanted`` leases ``w`` gets: at least one, at most its share of the shards left.

        Its share: ceil((todo + leased) / readers) less the shards of ``ds`` it holds, all in planned shards,
        where readers are the live workers granted a lease of ``ds`` (and ``w``), and with other readers at
        most ceil(todo / readers) per call (guided self-scheduling: the grants shrink as the end nears, so the
        lease-ahead queues drain together; a slow reader asks for little anyway, .pacing; half of that per call
        made a two-worker pass of 10,000-record shards 4-8 % slower, ~60 leases instead of ~50, issue 14).
        It binds only near the end (a batch dataset's last epoch planned, a stream's planned head).
        """
        states = self.state_counts[ds.name]
        todo = states[ShardState.TODO]
        if wanted <= 1 or wanted * len(self.workers) <= todo:  # no share is smaller (readers <= workers)
            return wanted
        if ds.kind is SourceKind.BATCH and ds.epochs_planned < ds.spec.epochs:
            return wanted  # more epochs to plan: not the end
        readers = 1 + sum(1 for wid, name in self.tails if name == ds.name and wid != w.id)
        held, leased = self._leased_planned(ds, w)
        share = -(-(todo + leased) // readers) - held
        if readers > 1:
            share = min(share, -(-todo // readers))
        return max(1, min(wanted, share))

    def _leased_planned(self, ds: DatasetRecord, w: WorkerRecord) -> tuple[int, int]:
        """The planned shards of ``ds`` leased to ``w``, and to all: a merged shard (.merging) counts its members
        (counted as one, a reader holding merged leases looked short of its share and took on as another ran dry)."""
        name = ds.name
        if ds.kind is not SourceKind.BATCH or ds.spec.shuffle:  # nothing merges: a shard record is a planned shard
            return sum(1 for sid in w.leases if self.shards[sid].dataset == name), self.state_counts[name][
                ShardState.LEASED
            ]

        def planned(sid: str) -> int:
            s = self.shards[sid]
            return 0 if s.dataset != name else ds.planned_in(s.pindex, s.start, s.end)

        return sum(map(planned, w.leases)), sum(planned(sid) for x in self.workers.values() for sid in x.leases)

    # ------------------------------------------------------------------ acks and the committed cursor
    def add_acks(self, cursor: DataCursor, step: int | None = None) -> None:
        """Add to ``cursor`` every ack not yet folded into the committed cursor with ``step <= step`` (all: None)."""
        for sid in self.unfolded:
            s = self.shards[sid]
            pos = s.start
            for ack_step, ack_pos in s.acks:
                if step is not None and ack_step is not None and ack_step > step:
                    break
                pos = ack_pos
            if pos > s.start:
                cursor.add(self.key_of(s), s.start, pos)

    def fold(self, committed: DataCursor) -> None:
        """Fold a newly committed cursor into the shards: acks inside it are dropped, ACKED shards inside it too."""
        for sid in sorted(self.unfolded):
            s = self.shards[sid]
            covered = committed.get(self.key_of(s))
            s.acks = [(st, pos) for st, pos in s.acks if not covered.covers(s.start, pos)]
            if s.state is ShardState.ACKED and covered.covers(s.start, s.end):
                self.drop_shard(sid)
                self.journal.delete_shard(sid)
                continue
            if not s.acks:
                self.unfolded.discard(sid)
            self.journal.put_shard(s)

    # ------------------------------------------------------------------ restore and removal
    def revoke_leases(self) -> int:
        """Revoke every lease (a restore): workers learn at their next heartbeat. Returns how many."""
        revoked = 0
        for sid in sorted(self.leased):
            s = self.shards[sid]
            w = self.workers.get(s.worker or "")
            if w is not None:
                w.leases.discard(sid)
                w.revoked.add((sid, s.attempt))
            revoked += 1
        self.leased.clear()
        return revoked

    def replan(self, ds: DatasetRecord, cursor: DataCursor, lost: DataCursor, shuffle: bool = True) -> int:
        """Discard ``ds``'s shards and plan anew what ``cursor`` and ``lost`` lack (in order unless ``shuffle``)."""
        marks = lease_order.times_of(self.shards_of(ds.name))  # the re-planned shards keep their stream time
        self.stream_time.forget(ds.name)
        for sid in sorted(self.by_dataset[ds.name]):
            self.restore_revoked.add(sid)
            self.drop_shard(sid)
        self._new_dataset_indexes(ds.name)
        self.journal.delete_shards_of(ds.name)
        done = {(k.epoch, k.partition): ivs.copy() for k, ivs in cursor.items()}
        for k, ivs in lost.only(ds.name).lost_items():  # deleted upstream: never planned again
            done.setdefault((k.epoch, k.partition), IntervalSet()).update(ivs)
        if ds.kind is SourceKind.BATCH:
            ds.epochs_planned = max([k.epoch + 1 for k in cursor.keys()] + [1])
        planned = list(
            itertools.chain.from_iterable(
                plan_epoch(ds.partitions, e, ds.shard_size, ds.spec.shuffle and shuffle, ds.spec.seed, done, ds.runs)
                for e in range(ds.epochs_planned)
            )
        )
        self.add_planned(ds, planned, marks)
        self.journal.put_dataset(ds)
        self.restore_revoked -= self.by_dataset[ds.name]
        return sum(p.records for p in planned)

    def drop_dataset(self, name: str) -> tuple[int, list[str]]:
        """Revoke the leases of dataset ``name`` and delete its shards, row and runs from the journal (in the
        caller's transaction). Returns (leases revoked, shard ids dropped); :meth:`forget_dataset` follows."""
        sids = sorted(self.by_dataset[name])
        revoked = 0
        for sid in sids:
            s = self.shards[sid]
            if s.state is ShardState.LEASED:
                w = self.workers.get(s.worker or "")
                if w is not None:
                    w.leases.discard(sid)
                    w.revoked.add((sid, s.attempt))
                revoked += 1
            self.drop_shard(sid)
        self.journal.delete_shards_of(name)
        self.journal.delete_dataset(name)
        self.journal.delete_runs_of(name)
        return revoked, sids

    def forget_dataset(self, name: str) -> None:
        """Forget dataset ``name``'s record and indexes once its rows are deleted (:meth:`drop_dataset`)."""
        del self.datasets[name]
        for index in (self.by_dataset, self.queues, self.state_counts):
            index.pop(name, None)
        self.stream_time.forget(name)
        for key in [k for k in self.tails if k[1] == name]:
            del self.tails[key]
