"""Planning shards of stream datasets from polled end positions.

A stream partition's shards are cut as records arrive: a full shard once
``records_per_shard`` positions are available past the planned end, and a
partial one once records have waited ``sr.max_delay_ms`` (so a slow stream is
still trained promptly). No more shards are planned while ``sr.max_pending_shards``
wait unleased (backpressure). Partitions that appear while the job runs are
added with the position they start at.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import replace
from itertools import pairwise

from streamrover.cursor import DataCursor, PartitionKey
from streamrover.shard_service.api import PartitionPlan, ShardState
from streamrover.shard_service.master.bookkeeping import DatasetRecord
from streamrover.shard_service.master.cuts import CutBook
from streamrover.shard_service.master.planner import PlannedShard
from streamrover.shard_service.master.state import CoreState
from streamrover.shard_service.master.upstream import Upstream
from streamrover.sources.api import Partition, SourceKind
from streamrover.sources.options import StreamPlanning, planning_options
from streamrover.sources.positions import RecordRuns

#: the fewest positions a partial shard is cut into for idle workers (split_partial)
MIN_SPLIT = 500


def stream_planning(ds: DatasetRecord) -> StreamPlanning:
    """The dataset's planning options (``sr.max_delay_ms``...), typed; raises OptionError when they are bad."""
    return planning_options(ds.spec.options)


def full_shards(
    end: int, avail: int, size: int, segments: Iterable[tuple[int, int]] | None, limit: int
) -> tuple[list[tuple[int, int]], int]:
    """Up to ``limit`` shards from ``end``, each spanning ``size`` positions that can hold records.

    ``segments`` are the runs of positions a sparse source says hold records (None:
    every position does). Gaps between runs hold nothing and are folded into the
    shard that follows them, so a gap never becomes a stream of empty shards.
    Returns the shards and where the next shard starts.
    """
    if segments is None:
        runs = [(end, avail)]
    else:
        runs = [(max(a, end), min(b, avail)) for a, b in sorted(segments) if b > end and a < avail]
    shards: list[tuple[int, int]] = []
    start, need = end, size
    for a, b in runs:
        while a < b and len(shards) < limit:
            if b - a < need:
                need -= b - a
                break
            cut = a + need
            shards.append((start, cut))
            start, a, need = cut, cut, size
    return shards, start


def split_partial(end: int, avail: int, idle: int, least: int, room: int) -> list[tuple[int, int]]:
    """A partial shard ``[end, avail)``, cut into up to ``idle`` equal pieces so that a small backlog reaches every
    worker (issue 28), none under ``least`` positions and no more than ``room`` (bounded: tiny shards do not flood
    the master)."""
    pieces = max(1, min(idle, room, (avail - end) // max(least, 1)))
    cuts = [end + (avail - end) * k // pieces for k in range(pieces + 1)]
    return list(pairwise(cuts))


def _round_robin(cells: dict[int, list[tuple[int, int]]], room: int) -> dict[int, int]:
    """How many of each partition's ``cells`` to take, at most ``room`` in all, a round across partitions at a time."""
    taken = dict.fromkeys(cells, 0)
    k = 0
    while room > 0 and any(len(c) > k for c in cells.values()):
        for index, c in cells.items():
            if room > 0 and len(c) > k:
                taken[index] += 1
                room -= 1
        k += 1
    return taken


class StreamPlanner:
    """Stream planning, a part of the core (``ShardCore.streams``): shards planned from polls, a dataset failed
    and resumed, lag, what to commit upstream, and (``upstream``) what polls say about deleted data.

    Its own state: the ends of the last polls, since when records wait unplanned, the last source errors
    (memory only), and the upstream part's. It plans through the shard table (``add_planned``) and reads the
    committed and durable cursors from the cut book.
    """

    def __init__(self, table: CoreState, cut_book: CutBook) -> None:
        self.table = table
        self.cut_book = cut_book
        self.available: dict[tuple[str, int], int] = {}  # (dataset, partition index) -> end at last poll
        self.pending_since: dict[tuple[str, int], float] = {}  # since when unplanned records wait
        self.source_errors: dict[str, tuple[str, float]] = {}  # dataset -> (last source error, since)
        # (dataset, partition index) -> its hold and stage (Partition.hold, .stage: sources/history.py)
        self.holds: dict[tuple[str, int], tuple[int, int]] = {}
        self.held: set[str] = set()  # datasets with holds (chained: every poll looks at every partition)
        # What a poll must look at (issue 32: a 10,000-partition topic where 100 moved costs 100 partitions' work):
        self.seen: dict[str, dict[str, tuple[int, int | None]]] = {}  # dataset -> partition id -> (end, earliest)
        self.behind: dict[str, set[str]] = {}  # dataset -> partitions left with records not planned (or a partial)
        self._looked: tuple[str, list[Partition], list[Partition] | None] | None = None  # the last changed() answer
        self.upstream = Upstream(table, cut_book, self.available)

    def changed(self, name: str, polled: list[Partition]) -> list[Partition] | None:
        """The partitions of a poll that planning must look at: those whose end or earliest position moved since
        the last poll, those it left with records not planned (``behind``: backpressure, a partial shard waiting
        for ``sr.max_delay_ms``), sparse ones, and those whose deleted records are not settled yet
        (``Upstream.unsettled``). None: every partition (the dataset's first poll, one after a restore or
        resume, a chained dataset). Every other partition's planned end is its available end already."""
        if self._looked is not None and self._looked[0] == name and self._looked[1] is polled:
            return self._looked[2]  # the poller asked before its check: the same poll
        seen = self.seen.get(name)
        if seen is None or name in self.held:
            looked = None
        else:
            again = self.behind.get(name, set()) | self.upstream.unsettled.get(name, set())
            looked = [p for p in polled if seen.get(p.id) != (p.end, p.earliest) or p.id in again or p.segments]
        self._looked = (name, polled, looked)
        return looked

    def rescan(self, name: str) -> None:
        """Make the next poll of ``name`` look at every partition (its plan changed other than by a poll)."""
        self.seen.pop(name, None)
        self.behind.pop(name, None)

    def extend_stream(self, name: str, polled: list[Partition], force: bool = False, timed: bool = False) -> int:
        """Plan new shards from a poll of the source's partitions and ends. Returns how many were planned.

        Backpressure (``sr.max_pending_shards``) takes the partitions' new shards a round at a time (the first of
        each, then the second...), so a backlog is planned across partitions, as it is leased (stream-time
        order, :mod:`.lease_order`). ``timed``: the source tells its records' times. Then the shards of a poll
        that found a backlog (more than a shard's worth waiting in a partition), or the dataset's first shards,
        are held until the poller has read their times (:meth:`CoreState.set_times`); at the stream's head,
        where planning order is time order, shards are leased at once and follow the newest time known.
        """
        ds = self.table.dataset(name)
        if ds.kind is not SourceKind.STREAM or ds.failed:
            return 0
        now = self.table.clock()
        size = ds.shard_size
        planning = stream_planning(ds)
        max_delay, max_pending = planning.max_delay_ms / 1000.0, planning.max_pending_shards
        known = ds.partition_by_id()
        looked = self.changed(name, polled)
        self._looked = None
        everything = looked is None
        looked = polled if looked is None else looked
        changed = False
        for p in looked:
            if p.id not in known:
                plan = PartitionPlan(len(ds.partitions), p.id, p.start, p.start)
                ds.partitions.append(plan)
                known[p.id] = plan
                changed = True
            self.available[(name, known[p.id].index)] = p.end
            if p.hold is not None:
                self.holds[(name, known[p.id].index)] = (p.hold, p.stage)
                self.held.add(name)
            if p.segments is not None:  # a sparse partition: where its records are (sources/positions.py)
                seen = ds.runs.setdefault(known[p.id].index, RecordRuns())
                before = len(seen)
                # A new run (a ledger rollover) is journalled now; a run that grew rides with the next write
                # (the source reports its newest run at every poll, after a master restart too).
                if seen.add(p.segments) and len(seen) != before:
                    changed = True
        changed = self._compact_runs(ds) or changed
        # the partitions looked at, in index order (a partition not looked at has nothing unplanned: changed())
        plans = list(ds.partitions) if everything else sorted((ds.partitions[known[p.id].index] for p in looked),
                                                        key=lambda plan: plan.index)  # fmt: skip
        pending = self.table.state_counts[name][ShardState.TODO]
        stage = self.stage(ds)
        history: list[PlannedShard] = []  # the current stage's shards: planned whole, shuffled if asked
        avails: dict[int, tuple[int, bool]] = {}  # partition index -> (where its records end for planning, staged)
        for plan in plans:
            avail = self.available.get((name, plan.index), plan.end)
            hold, at = self.holds.get((name, plan.index), (0, -1))
            staged = stage is not None and at >= stage
            if staged and stage is not None:  # the history first: a later stage or the live part waits
                avail = plan.end if at > stage else max(min(avail, hold), plan.end)
            avails[plan.index] = (avail, staged)
        waiting = max((avails[plan.index][0] - plan.end for plan in plans), default=0)
        hold_times = timed and (waiting > size or self.table.stream_time.newest(name) is None)
        cells: dict[int, list[tuple[int, int]]] = {}  # per live partition: the full shards it has room for
        for plan in plans:
            avail, staged = avails[plan.index]
            runs = ds.runs.get(plan.index)
            segments = None if runs is None else runs.between(plan.end, avail)
            if staged:  # a known history: planned whole, now
                full, end = full_shards(plan.end, avail, size, segments, 1 << 62)
                history.extend(PlannedShard(0, plan, a, b, ds.records_in(plan.index, a, b)) for a, b in full)
                pending += len(full)
                if avail > end:
                    history.append(PlannedShard(0, plan, end, avail, ds.records_in(plan.index, end, avail)))
                    pending += 1
                if avail != plan.end:
                    ds.partitions[plan.index] = replace(plan, end=avail)
                    changed = True
                self.pending_since.pop((name, plan.index), None)
                continue
            cells[plan.index] = full_shards(plan.end, avail, size, segments, max_pending - pending)[0]
        taken = _round_robin(cells, max_pending - pending)
        planned: list[PlannedShard] = []
        for k in range(max(taken.values(), default=0)):  # the k-th new shard of every partition, then the next
            for plan in plans:
                if k < taken.get(plan.index, 0):
                    a, b = cells[plan.index][k]
                    planned.append(PlannedShard(0, plan, a, b, ds.records_in(plan.index, a, b)))
        pending += len(planned)
        for plan in plans:
            if plan.index not in cells:
                continue
            key = (name, plan.index)
            avail = avails[plan.index][0]
            n = taken[plan.index]
            end = cells[plan.index][n - 1][1] if n else plan.end
            if avail > end:
                since = self.pending_since.setdefault(key, now)
                whole = n == len(cells[plan.index])  # a partial shard only once every full one is planned
                if whole and pending < max_pending and (force or now - since >= max_delay):
                    idle = len(self.table.workers) - pending  # workers the shards waiting would leave without work
                    for a, b in split_partial(end, avail, idle, min(MIN_SPLIT, size), max_pending - pending):
                        planned.append(PlannedShard(0, plan, a, b, ds.records_in(plan.index, a, b)))
                        pending += 1
                    end = avail
                    self.pending_since.pop(key, None)
            else:
                self.pending_since.pop(key, None)
            if end != plan.end:
                ds.partitions[plan.index] = replace(plan, end=end)
                changed = True
        if ds.spec.shuffle:
            random.Random(f"{ds.spec.seed}:{stage}").shuffle(history)
        planned = history + planned
        self.seen.setdefault(name, {}).update((p.id, (p.end, p.earliest)) for p in looked)
        behind = self.behind.setdefault(name, set())
        for plan in plans:
            now_end = ds.partitions[plan.index].end
            if self.available.get((name, plan.index), now_end) > now_end or (name, plan.index) in self.pending_since:
                behind.add(plan.id)
            else:
                behind.discard(plan.id)
        if planned or changed:
            with self.table.journal.transaction():
                fresh = [replace(p, partition=ds.partitions[p.partition.index]) for p in planned]
                self.table.add_planned(ds, fresh, hold=hold_times, head=timed and not hold_times)
                self.table.journal.put_dataset(ds)
                self.table.save_counters()
        return len(planned)

    def stage(self, ds: DatasetRecord, cursor: DataCursor | None = None) -> int | None:
        """A chained dataset's current stage: the first whose positions are not all acked (None: all are, or no
        stages). Stage ``s`` holds each partition's positions below its hold if the partition is of stage ``s``
        and those at or past it if it is of ``s - 1`` (``Partition.hold``, ``.stage``: sources/history.py).

        ``cursor``: judge by it (a restore's) instead of what is acked. The committed cursor is looked at first,
        the acks only while it does not cover the holds, so a dataset past its history costs one interval lookup
        per partition.
        """
        if ds.name not in self.held:
            return None
        holds = [
            (plan, *self.holds[(ds.name, plan.index)]) for plan in ds.partitions if (ds.name, plan.index) in self.holds
        ]
        if not holds:
            return None

        def first(done: DataCursor) -> int | None:
            waiting = [
                at
                for plan, hold, at in holds
                if not done.get(PartitionKey(ds.name, 0, plan.id)).covers(plan.start, hold)
            ]
            return min(waiting, default=None)

        if cursor is not None:
            return first(cursor)
        if first(self.cut_book.committed) is None:
            return None
        acked = self.cut_book.committed.copy()
        self.table.add_acks(acked)
        return first(acked)

    def rewind_to_holds(self, ds: DatasetRecord, cursor: DataCursor) -> tuple[DatasetRecord, bool]:
        """Before a restore re-plans ``ds``: if ``cursor`` lacks part of a chained dataset's history, the planned
        extents of its current stage go back to the holds and those of later stages to their start (never below
        what ``cursor`` holds), so the later stages and the live part wait for the history again instead of being
        re-planned beside it. Returns ``ds`` and whether to re-plan it shuffled: a batch's epochs, a chained
        stream's history (``spec.shuffle``), never a stream's live part."""
        self.rescan(ds.name)
        stage = self.stage(ds, cursor)
        if stage is None:
            return ds, ds.spec.shuffle and ds.kind is SourceKind.BATCH
        for plan in list(ds.partitions):
            got = self.holds.get((ds.name, plan.index))
            if got is None or got[1] < stage:
                continue
            done = cursor.get(PartitionKey(ds.name, 0, plan.id))
            kept = max([plan.start, got[0] if got[1] == stage else plan.start, *(b for _, b in done)])
            if plan.end > kept:
                ds.partitions[plan.index] = replace(plan, end=kept)
        return ds, ds.spec.shuffle

    def _compact_runs(self, ds: DatasetRecord) -> bool:
        """Fold the runs of sparse partitions below what is committed upstream (one run per ledger is unbounded).

        Below that position nothing is planned, read or restored again (a restore never goes behind the
        broker's commit) and no count looks there but the whole prefix's, which folding keeps exact;
        positions accounted as lost keep their runs. Returns whether any partition's runs changed.
        """
        if not any(len(runs) > 2 for runs in ds.runs.values()):
            return False
        upto = self.committed_positions(ds)
        lost = self.upstream.lost.only(ds.name).lost_items()
        lost_from = {k.partition: ivs.to_list()[0][0] for k, ivs in lost if ivs}
        changed = False
        for plan in ds.partitions:
            runs = ds.runs.get(plan.index)
            if runs is not None and len(runs) > 2:
                changed = runs.compact(min(upto[plan.id], lost_from.get(plan.id, upto[plan.id]))) or changed
        return changed

    def fail_dataset(self, name: str, reason: str) -> None:
        """The dataset cannot go on (its topic was deleted...): refuse leases with ``reason`` from now on."""
        ds = self.table.dataset(name)
        self.rescan(name)
        ds.failed = reason
        with self.table.journal.transaction():
            self.table.journal.put_dataset(ds)

    def resume_dataset(self, name: str, skip_lost: bool = False) -> bool:
        """Clear a dataset's failure (its cause was fixed): leases are granted again. False if it had not failed.

        ``skip_lost``: records deleted upstream so far are accounted as lost, as ``sr.on_data_loss=skip`` does.
        """
        ds = self.table.dataset(name)
        if not ds.failed:
            return False
        self.rescan(name)
        self.upstream.end_warnings.pop(name, None)
        if skip_lost:
            self.upstream.skip_lost_once.add(name)
        ds.failed = ""
        with self.table.journal.transaction():
            self.table.journal.put_dataset(ds)
        self.source_errors.pop(name, None)
        return True

    def lag(self, ds: DatasetRecord) -> list[tuple[int, int, int]]:
        """Per partition: (available end, committed end, lag): the records available and not yet applied (acked or
        committed), so the lag follows training, not the checkpoints (issue 28: it was a sawtooth from the last
        committed cut). Counted from the end of the applied run from the partition's start."""
        acked = self.cut_book.committed.copy()
        self.table.add_acks(acked)
        out = []
        for plan in ds.partitions:
            committed_end = self.upstream.done_positions(ds, plan).prefix_end(plan.start)
            applied = acked.get(PartitionKey(ds.name, 0, plan.id))
            applied.update(self.upstream.lost.get_lost(PartitionKey(ds.name, 0, plan.id)))
            applied_end = max(applied.prefix_end(plan.start), committed_end)
            avail = self.available.get((ds.name, plan.index), plan.end)
            out.append((avail, committed_end, ds.records_in(plan.index, applied_end, avail)))
        return out

    def committed_positions(self, ds: DatasetRecord) -> dict[str, int]:
        """Per partition id: the end of the committed run from the partition's start (what to commit upstream),
        never beyond the *previous* durable checkpoint's cursor: upstream commits lag durable storage by one
        checkpoint, for every broker. When cut K commits, the broker is committed up to checkpoint K-1's cursor
        (which retention keeps), so a fallback from a corrupt K to K-1 never needs records the broker may have
        deleted (Pulsar's commit is a cumulative ack that cannot be undone). A restore from shared memory does
        not move the limit; a restore from storage sets it to the loaded cursor (just read whole). The broker
        reaches a run's final cursor once two durable checkpoints hold it (a second checkpoint taken after the
        last record's, with nothing new acked in between).

        Positions accounted as lost count as done: they were deleted upstream and are never read.
        """
        out: dict[str, int] = {}
        for plan in ds.partitions:
            key = PartitionKey(ds.name, 0, plan.id)
            lost = self.upstream.lost.get_lost(key)
            ends = []
            for cursor in (self.cut_book.committed, self.cut_book.durable, self.cut_book.upstream):
                done = cursor.get(key)
                done.update(lost)
                ends.append(done.prefix_end(plan.start))
            out[plan.id] = min(ends)
        return out

    def forget_dataset(self, name: str) -> None:
        """Forget what the polls of dataset ``name`` said (it was removed)."""
        for keyed in (self.available, self.pending_since, self.holds):
            for pkey in [k for k in keyed if k[0] == name]:
                del keyed[pkey]
        self.source_errors.pop(name, None)
        self.rescan(name)
        self.held.discard(name)
        self.upstream.unsettled.pop(name, None)
