"""The DatasetInfo message the master answers (describe, list, register, resume, status)."""

from __future__ import annotations

from streamrover.shard_service import convert
from streamrover.shard_service.master.bookkeeping import DatasetRecord
from streamrover.shard_service.master.core import ShardCore
from streamrover.shard_service.master.gaps import gaps_to_pb
from streamrover.shard_service.v1 import shard_service_pb2 as pb
from streamrover.sources.api import SourceKind


def dataset_info(core: ShardCore, ds: DatasetRecord) -> pb.DatasetInfo:
    """A dataset's info as the RPCs answer it: spec, partitions with lag, counts, failures, gaps."""
    counts = core.counts(ds)
    kind = pb.DATASET_KIND_BATCH if ds.kind.value == "batch" else pb.DATASET_KIND_STREAM
    partitions = [convert.partition_to_pb(p) for p in ds.partitions]
    lag = 0
    if ds.kind is SourceKind.STREAM:
        for msg, (avail, committed_end, part_lag) in zip(partitions, core.lag(ds)):
            msg.available_end, msg.committed_end, msg.lag = avail, committed_end, part_lag
            lag += part_lag
    streams = core.streams
    error = ds.failed or streams.source_errors.get(ds.name, ("", 0.0))[0] or streams.upstream.note(ds)
    return pb.DatasetInfo(
        spec=convert.spec_to_pb(ds.spec),
        kind=kind,
        partitions=partitions,
        lag=lag,
        error=error,
        failed=bool(ds.failed),
        dead_letters=ds.dead_letters,
        total_records=ds.planned_records(),
        epochs_planned=ds.epochs_planned,
        shards=pb.ShardCounts(
            todo=counts.todo, leased=counts.leased, acked=counts.acked, committed=counts.committed
        ),
        finished=counts.finished,
        schema_json=ds.schema_json,
        records_acked=counts.records_acked,
        records_committed=counts.records_committed,
        lost_records=core.streams.upstream.lost_records(ds),
        commit_gaps=gaps_to_pb(core.staged.gaps.of(ds.name), core.clock()),
        time_skew_ms=core.stream_time.skew_ms(core, ds.name),
    )


__all__ = ["dataset_info"]
