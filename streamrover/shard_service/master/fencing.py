"""The rules that fence acks and validate cursors, apart from the state they judge.

An ack ``(worker, shard, attempt, position)`` is applied only when that worker
holds the shard's current lease under that attempt. A repeat of an ack the same
attempt already made is answered OK with no effect (a retry whose first answer
was lost). Anything else is refused with a message naming the shard, the
attempts and what happened to the lease.
"""

from __future__ import annotations

from collections.abc import Container, Mapping

from streamrover.cursor import DataCursor, PartitionKey
from streamrover.shard_service.api import (
    AckResult,
    InvalidArgumentError,
    PartitionPlan,
    ShardState,
    StaleLeaseError,
    parse_shard_id,
)
from streamrover.shard_service.master.bookkeeping import COMPACTED, DatasetRecord, ShardRecord
from streamrover.sources.api import SourceKind


def judge(s: ShardRecord, worker_id: str, attempt: int, position: int, revoked: Container[str]) -> AckResult | None:
    """None when the ack must be applied; an :class:`AckResult` for a harmless repeat; raises when refused."""
    if not s.start <= position <= s.end:
        raise InvalidArgumentError(
            f"ack of shard {s.id!r} at position {position} is outside the shard's range [{s.start}, {s.end})"
        )
    if position <= s.acked_by.get(attempt, s.start - 1):
        return AckResult(shard_done=s.state is ShardState.ACKED, duplicate=True)
    current = s.state is ShardState.LEASED and s.attempt == attempt
    if current and s.worker == worker_id:
        if position < s.acked_to:
            raise InvalidArgumentError(
                f"ack of shard {s.id!r} attempt {attempt} at position {position} is before the position "
                f"{s.acked_to} the lease resumed from"
            )
        if position == s.acked_to:
            return AckResult(shard_done=False, duplicate=True)
        return None
    if current:
        raise StaleLeaseError(
            f"ack of shard {s.id!r} attempt {attempt} refused: that lease is held by worker {s.worker!r}, "
            f"not {worker_id!r}"
        )
    if attempt > s.attempt:
        raise StaleLeaseError(
            f"ack of shard {s.id!r} refused: attempt {attempt} was never issued (the latest is {s.attempt})"
        )
    if s.id in revoked and attempt < s.attempt:
        what = f"was revoked by a restore; the shard has since been leased again as attempt {s.attempt}"
    elif attempt < s.attempt:
        what = f"expired; the shard has since been leased again as attempt {s.attempt}"
        if s.state is ShardState.LEASED:
            what += f" (held by worker {s.worker!r})"
        elif s.state is ShardState.ACKED:
            what += " and finished"
    elif s.state is ShardState.TODO:
        what = "expired or was revoked; the shard is back in the queue"
    else:
        what = "ended when the shard was finished"
    raise StaleLeaseError(f"ack of shard {s.id!r} attempt {attempt} refused: the lease {what}")


def committed_range(shard_id: str, datasets: Mapping[str, DatasetRecord]) -> tuple[PartitionKey, int, int] | None:
    """The cursor key and range a (possibly compacted) shard id names, or None if it names nothing known."""
    coords = parse_shard_id(shard_id)
    if coords is None:
        return None
    dataset, epoch, pindex, start, end = coords
    ds = datasets.get(dataset)
    if ds is None or not 0 <= pindex < len(ds.partitions):
        return None
    if pindex < ds.plans.base:  # a compacted file (compaction.py): inside the committed cursor
        return PartitionKey(dataset, epoch, COMPACTED), 0, 0
    return PartitionKey(dataset, epoch, ds.partitions[pindex].id), start, end


def not_contained(inner: DataCursor, outer: DataCursor) -> str:
    """A description of one interval of ``inner`` that ``outer`` lacks, or '' when ``outer`` contains ``inner``."""
    for key, ivs in inner.items():
        have = outer.get(key)
        for s, e in ivs:
            if not have.covers(s, e):
                return f"{key} [{s}, {e})"
    return ""


def check_restorable(cursor: DataCursor, datasets: Mapping[str, DatasetRecord]) -> None:
    """Refuse a cursor that names datasets, epochs, partitions or positions this service does not have."""
    for key, ivs in cursor.items():
        ds = datasets.get(key.dataset)
        if ds is None:
            raise InvalidArgumentError(
                f"cannot restore: the cursor names dataset {key.dataset!r}, which is not registered"
            )
        part = ds.partition_by_id().get(key.partition)
        if part is None and key.partition == COMPACTED and ds.compacted_records:  # compaction.py
            part = PartitionPlan(-1, COMPACTED, 0, ds.compacted_records)
        if part is None:
            raise InvalidArgumentError(
                f"cannot restore: the cursor names partition {key.partition!r}, which dataset {key.dataset!r} lacks"
            )
        if key.epoch < 0 or key.epoch >= max(ds.spec.epochs, 1) or (ds.kind is SourceKind.STREAM and key.epoch):
            raise InvalidArgumentError(f"cannot restore: {key} is outside the dataset's epochs")
        for s, e in ivs:
            if s < part.start or e > part.end:
                raise InvalidArgumentError(
                    f"cannot restore: {key} [{s}, {e}) lies outside the partition's planned positions "
                    f"[{part.start}, {part.end})"
                )
