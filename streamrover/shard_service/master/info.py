"""The DatasetInfo message the master answers (describe, list, register, resume, status)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from streamrover.shard_service import convert
from streamrover.shard_service.master.bookkeeping import DatasetRecord
from streamrover.shard_service.master.core import ShardCore
from streamrover.shard_service.master.gaps import gaps_to_pb
from streamrover.shard_service.v1 import shard_service_pb2 as pb
from streamrover.sources.api import SourceKind

#: partitions per dataset in status and the dataset list when not asked otherwise (the most lagging first)
DEFAULT_STATUS_PARTITIONS = 20


def partition_limit(asked: int) -> int:
    """A status or list request's ``partition_limit`` as :func:`dataset_info` takes it (0 there: all)."""
    return DEFAULT_STATUS_PARTITIONS if asked == 0 else max(asked, 0)


def dataset_info(core: ShardCore, ds: DatasetRecord, limit: int = 0) -> pb.DatasetInfo:
    """A dataset's info as the RPCs answer it: spec, partitions with lag, counts, failures, gaps.

    ``limit`` > 0: only the ``limit`` partitions with the most lag (ties by index), so that status of a topic of
    10,000 partitions answers 20 rows; the totals (lag, ``partition_count``) are of every partition either way.
    """
    counts = core.counts(ds)
    kind = pb.DATASET_KIND_BATCH if ds.kind.value == "batch" else pb.DATASET_KIND_STREAM
    plans = list(ds.partitions)
    lags = core.lag(ds) if ds.kind is SourceKind.STREAM else None
    lag = sum(part_lag for _, _, part_lag in lags) if lags is not None else 0
    shown: Sequence[int] = range(len(plans))
    if 0 < limit < len(plans):
        most = heapq.nsmallest(limit, shown, key=lambda i: (-lags[i][2] if lags is not None else 0, i))
        shown = most if lags is not None else range(limit)
    partitions = []
    for i in shown:
        msg = convert.partition_to_pb(plans[i])
        if lags is not None:
            msg.available_end, msg.committed_end, msg.lag = lags[i]
        partitions.append(msg)
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
        partition_count=len(plans),
    )


__all__ = ["DEFAULT_STATUS_PARTITIONS", "dataset_info", "partition_limit"]
