"""What a stream's poll says about data the plan relies on: records deleted upstream, ends that go back.

The master compares every poll with its plan before planning from it:

- **Deleted upstream.** A source that knows its first retained position (``Partition.earliest``:
  Kafka's log start offset, a RocketMQ queue's min offset) shows retention or ``delete_records``
  removing records. Positions below it that nothing trained (neither acked nor already accounted
  as lost) and that no lease holds are *lost*. By default (``sr.on_data_loss=fail``) the dataset
  fails, naming the partition and positions: trainers get FAILED_PRECONDITION instead of reading a
  shard that is gone and restarting until they run out of restarts. With ``sr.on_data_loss=skip``
  (or once a failed dataset is resumed with ``skip_lost``) the positions are accounted as lost:
  kept in the journal, in status, and in the lost part of every cut's cursor from then on (so in
  each checkpoint's lineage, apart from what was trained: see :mod:`streamrover.cursor`); the
  shards that covered them are re-planned from the earliest position, and lag and the offsets
  committed upstream count them as done. The exactly-once contract then covers the records the
  cursor says were trained; a ledger equals the produced records minus the lost ones.
  Positions that a lease holds are decided when the lease ends (its worker may have read them
  before they were deleted; if its read fails, the lease returns and the next poll decides), and
  a shard with acks not yet in a committed cut is re-planned once they are.
- **An end that goes back** (a topic deleted and created again, an unclean leader election) is
  reported in status: the positions planned past the new end were planned from records that are gone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from streamrover.cursor import DataCursor, IntervalSet, PartitionKey
from streamrover.shard_service.api import InvalidArgumentError, PartitionPlan, ShardState
from streamrover.shard_service.master.bookkeeping import DatasetRecord
from streamrover.shard_service.master.cuts import CutBook
from streamrover.shard_service.master.planner import PlannedShard
from streamrover.shard_service.master.state import CoreState
from streamrover.sources.api import Partition, SourceKind

log = logging.getLogger(__name__)
ON_DATA_LOSS = ("fail", "skip")
LOST_META = "lost_cursor"  # journal meta key: the lost positions of every dataset (a cursor's lost part; state.py)


def _ranges(ivs: list[tuple[int, int]], limit: int = 3) -> str:
    shown = ", ".join(f"[{a}, {b})" for a, b in ivs[:limit])
    return shown + (f" and {len(ivs) - limit} more" if len(ivs) > limit else "")


class Upstream:
    """A part of stream planning (``StreamPlanner.upstream``) with its own state: the positions accounted as
    lost (journalled), the ends gone back and the earliest positions seen (memory only).

    It reads the plan through the shard table (datasets, a dataset's shards) and the committed cursor through
    the cut book; it changes shards only to re-plan those that covered lost positions.
    """

    def __init__(self, table: CoreState, cut_book: CutBook, available: dict[tuple[str, int], int]) -> None:
        self.table = table
        self.cut_book = cut_book
        self.available = available  # the planner's: (dataset, partition index) -> end at last poll
        lost = table.journal.get_meta(LOST_META)
        self.lost = DataCursor.from_json(lost) if lost else DataCursor()  # its lost part: positions skipped as lost
        self.end_warnings: dict[str, str] = {}  # dataset -> the last end that went back (memory only)
        self.earliest_seen: dict[tuple[str, int], tuple[int, int]] = {}  # (dataset, pindex) -> (earliest, cut seq)
        self.skip_lost_once: set[str] = set()  # datasets resumed with skip_lost (memory only)
        self.unsettled: dict[str, set[str]] = {}  # dataset -> partitions whose deleted records wait on leases

    def save_lost(self) -> None:
        """Journal the lost positions (with a transaction open)."""
        self.table.journal.put_meta(LOST_META, self.lost.to_json())

    def restore_lost(self, cursor: DataCursor) -> DataCursor:
        """Add the lost part of a restored ``cursor`` (a checkpoint taken on another master's state); returns
        every lost position (journalled by :meth:`save_lost` in the restore's transaction)."""
        self.lost.update(DataCursor(lost=dict(cursor.lost_items())))
        return self.lost

    def check(self, name: str, polled: list[Partition], acked: Callable[[], DataCursor]) -> str:
        """Compare a poll with the plan (before planning from it); returns why the dataset must fail, or ''.

        ``polled``: the partitions that changed since the last poll (``StreamPlanner.changed``), or all of them.

        ``acked()``: the committed cursor plus every ack (what was trained), asked once at most.
        """
        ds = self.table.dataset(name)
        if ds.kind is not SourceKind.STREAM or ds.failed:
            return ""
        policy = ds.spec.options.get("sr.on_data_loss", "fail")
        if policy not in ON_DATA_LOSS:
            raise InvalidArgumentError(f"dataset {name!r}: sr.on_data_loss must be fail or skip, got {policy!r}")
        skip = policy == "skip" or name in self.skip_lost_once
        known = ds.partition_by_id()
        trained: DataCursor | None = None
        failures: list[str] = []
        pending = False
        for p in polled:
            plan = known.get(p.id)
            if plan is None:
                continue
            self._check_end(ds, plan, p)
            if p.earliest is None or p.earliest <= plan.start:
                continue
            mark = (p.earliest, self.cut_book.seq)
            if self.earliest_seen.get((name, plan.index)) == mark:
                continue
            if trained is None:
                trained = acked()
            key = PartitionKey(name, 0, p.id)
            covered = trained.get(key)
            covered.update(self.lost.get_lost(key))
            holes = covered.missing(plan.start, p.earliest)
            blocked = self._blocked(ds, plan.index, skip)
            lost = [piece for a, b in holes for piece in blocked.missing(a, b)]
            waiting = any(blocked.overlaps(a, b) for a, b in holes)
            pending = pending or waiting
            if lost and not skip:
                failures.append(f"{p.id} positions {_ranges(lost)}")
                continue
            if lost:
                self._skip_lost(ds, plan, p.earliest, lost)
            if not waiting:
                self.earliest_seen[(name, plan.index)] = mark
                self.unsettled.get(name, set()).discard(p.id)
            else:  # looked at again at every poll until settled (StreamPlanner.changed)
                self.unsettled.setdefault(name, set()).add(p.id)
        if failures:
            return (
                f"records were deleted upstream (retention or deletion) before they were trained: "
                f"{'; '.join(failures)}. Keep retention longer than training lags, or accept the loss: "
                f"'streamrover dataset resume {name} --skip-lost' (or register with sr.on_data_loss=skip)"
            )
        if not pending:
            self.skip_lost_once.discard(name)
        return ""

    def _blocked(self, ds: DatasetRecord, pindex: int, skip: bool) -> IntervalSet:
        """Unread positions not to decide on now: of leased shards, and (to skip) of shards with unfolded acks."""
        blocked = IntervalSet()
        for s in self.table.shards_of(ds.name):
            if s.pindex == pindex and (s.state is ShardState.LEASED or (skip and s.acks and s.acked_to < s.end)):
                blocked.add(s.acked_to, s.end)
        return blocked

    def _skip_lost(self, ds: DatasetRecord, plan: PartitionPlan, earliest: int, lost: list[tuple[int, int]]) -> None:
        key = PartitionKey(ds.name, 0, plan.id)
        log.error("dataset %s: skipping %s positions %s, deleted upstream before they were trained",
                  ds.name, plan.id, _ranges(lost))  # fmt: skip
        with self.table.journal.transaction():
            for a, b in lost:
                self.lost.add_lost(key, a, b)
            for s in self.table.shards_of(ds.name, ordered=True):
                if s.pindex != plan.index or s.state is not ShardState.TODO or s.acks or s.acked_to >= earliest:
                    continue
                # what it acked is committed (no unfolded acks); the rest from ``earliest`` is read anew
                self.table.drop_shard(s.id)
                self.table.journal.delete_shard(s.id)
                rest = max(s.acked_to, earliest)
                if rest < s.end:
                    part = ds.partitions[plan.index]
                    records = ds.records_in(plan.index, rest, s.end)
                    marks = None if s.time is None else {s.pindex: [(s.start, s.time)]}  # its time, kept
                    self.table.add_planned(ds, [PlannedShard(0, part, rest, s.end, records)], marks, s.time is None)
            current = ds.partitions[plan.index]
            if current.end < earliest:
                ds.partitions[plan.index] = replace(current, end=earliest)
                self.available[(ds.name, plan.index)] = max(self.available.get((ds.name, plan.index), 0), earliest)
            self.table.journal.put_dataset(ds)
            self.save_lost()
            self.table.save_counters()

    def _check_end(self, ds: DatasetRecord, plan: PartitionPlan, p: Partition) -> None:
        before = max(self.available.get((ds.name, plan.index), plan.end), plan.end)
        if p.end >= before:
            return
        msg = (
            f"the end of {p.id} went back from {before} to {p.end} (the topic deleted and created again, or an "
            f"unclean leader election?): positions up to {before} were planned from records that are gone, and "
            "records that arrive at those positions again are not planned anew"
        )
        if self.end_warnings.get(ds.name) != msg:
            log.error("dataset %s: %s", ds.name, msg)
        self.end_warnings[ds.name] = msg

    def done_positions(self, ds: DatasetRecord, plan: PartitionPlan) -> IntervalSet:
        """A partition's positions that need no reading: committed, or accounted as lost."""
        key = PartitionKey(ds.name, 0, plan.id)
        done = self.cut_book.committed.get(key)
        done.update(self.lost.get_lost(key))
        return done

    def note(self, ds: DatasetRecord) -> str:
        """For status: an end that went back, or the positions skipped as lost ('' if neither)."""
        if ds.name in self.end_warnings:
            return self.end_warnings[ds.name]
        lost = self.lost.only(ds.name).lost_items()
        if not lost:
            return ""
        parts = "; ".join(f"{k.partition} positions {_ranges(ivs.intervals())}" for k, ivs in lost)
        total = self.lost_records(ds)
        return f"skipped {total:,} records deleted upstream before they were trained (sr.on_data_loss=skip): {parts}"

    def lost_records(self, ds: DatasetRecord) -> int:
        """Records accounted as lost (positions for sources that do not say where their records are: Kafka)."""
        index = {p.id: p.index for p in ds.partitions}
        return sum(
            ds.records_in_set(index[k.partition], ivs) for k, ivs in self.lost.only(ds.name).lost_items()
            if k.partition in index
        )
