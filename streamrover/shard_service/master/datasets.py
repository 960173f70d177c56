"""Registering and removing datasets: the core's operations that span its parts (the shard table, the cut
book, stream planning, staged commits), each given the parts it changes."""

from __future__ import annotations

from streamrover.cursor import DataCursor, PartitionKey
from streamrover.shard_service.api import (
    AlreadyExistsError,
    DatasetSpec,
    InvalidArgumentError,
    PartitionPlan,
    ShardState,
)
from streamrover.shard_service.master.bookkeeping import COMPACTED, DatasetCounts, DatasetRecord
from streamrover.shard_service.master.cuts import CutBook
from streamrover.shard_service.master.planner import grid_cells_covered
from streamrover.shard_service.master.staged import StagedCommits
from streamrover.shard_service.master.state import CoreState
from streamrover.shard_service.master.streams import StreamPlanner
from streamrover.sources.api import Partition, SourceKind


def register(
    table: CoreState,
    streams: StreamPlanner,
    spec: DatasetSpec,
    kind: SourceKind,
    partitions: list[Partition],
    schema_json: str,
    timed: bool = False,
) -> tuple[DatasetRecord, bool]:
    """Register a dataset; returns (its record, whether it was created). ``timed``: the source tells its records'
    times, which the poller reads before the first shards are leased (:meth:`StreamPlanner.extend_stream`).

    Idempotent for the same spec; :class:`AlreadyExistsError` for the same name with another spec,
    :class:`InvalidArgumentError` for epochs or shuffle on a stream. A batch dataset's first epoch is
    planned; a stream's planned extent starts empty and the first poll (``partitions``) plans what is there.
    """
    spec = spec.normalized()
    existing = table.datasets.get(spec.name)
    if existing is not None:
        if existing.spec == spec:
            return existing, False
        raise AlreadyExistsError(
            f"dataset {spec.name!r} is already registered with a different spec "
            f"({existing.spec.uri!r}); choose another name"
        )
    chained = any(p.hold is not None for p in partitions)  # history, then live: epochs and shuffle of the history
    if kind is SourceKind.STREAM and (spec.epochs > 1 or spec.shuffle) and not chained:
        raise InvalidArgumentError(
            f"dataset {spec.name!r} is a stream: epochs and shuffle apply to batch data and to a stream's history "
            "(sr.history) only"
        )
    if kind is SourceKind.BATCH:
        plans = [PartitionPlan(i, p.id, p.start, p.end) for i, p in enumerate(partitions)]
    else:  # a stream's planned extent starts empty; the first poll plans what is there
        plans = [PartitionPlan(i, p.id, p.start, p.start) for i, p in enumerate(partitions)]
    ds = DatasetRecord(spec, kind, plans, schema_json, epochs_planned=0)
    table.add_dataset(ds)
    with table.journal.transaction():
        table.journal.delete_runs_of(ds.name)  # left by a removed dataset of that name, if any
        if kind is SourceKind.BATCH:
            table.plan_next_epoch(ds)
        else:
            ds.epochs_planned = 1
        table.journal.put_dataset(ds)
        table.save_counters()
    if kind is SourceKind.STREAM:
        streams.extend_stream(ds.name, partitions, timed=timed)
    return ds, True


def remove(
    table: CoreState, cut_book: CutBook, streams: StreamPlanner, staged: StagedCommits, name: str
) -> tuple[int, int]:
    """Forget dataset ``name``: revoke its leases, delete its shards, cursor entries and row in one transaction.

    Returns (leases revoked, shards removed). Workers learn of the revoked leases at their next
    heartbeat; acks of the removed shards are refused from now on (their attempts are never issued
    again: a dataset registered later under the same name gets new attempt numbers).
    """
    table.dataset(name)
    with table.journal.transaction():
        revoked, sids = table.drop_dataset(name)
        table.journal.delete_staged_of(name)
        cut_book.forget_dataset(name)
        table.save_counters()
    table.forget_dataset(name)
    streams.forget_dataset(name)
    staged.forget_dataset(name)
    table.restore_revoked.difference_update(sids)
    return revoked, len(sids)


def counts(
    table: CoreState, ds: DatasetRecord, committed: DataCursor, acked: DataCursor, finished: bool
) -> DatasetCounts:
    """Shard and record counts of ``ds`` for status, given the committed and acked cursors (not for hot paths)."""
    states = table.state_counts[ds.name]
    committed_cells = 0
    committed_records = 0
    for part in ds.partitions:
        for epoch in range(ds.epochs_planned):
            covered = committed.get(PartitionKey(ds.name, epoch, part.id))
            committed_cells += grid_cells_covered(part, ds.shard_size, covered, ds.runs.get(part.index))
            committed_records += ds.records_in_set(part.index, covered)
    compacted = PartitionKey(ds.name, 0, COMPACTED)  # a staged dataset's compacted files (compaction.py)
    committed_records += committed.get(compacted).size()
    committed_cells += -(-committed.get(compacted).size() // ds.shard_size) if ds.compacted_records else 0
    index = {p.id: p.index for p in ds.partitions}
    acked_records = acked.get(compacted).size() + sum(
        ds.records_in_set(index[key.partition], covered)
        for key, covered in acked.only(ds.name).items()
        if key.partition in index
    )
    return DatasetCounts(
        todo=states[ShardState.TODO],
        leased=states[ShardState.LEASED],
        acked=states[ShardState.ACKED],
        committed=committed_cells,
        records_acked=acked_records,
        records_committed=committed_records,
        finished=finished,
    )
