"""Conversions between the protobuf messages and the Python types of the service."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from streamrover.cursor import DataCursor, IntervalSet, PartitionKey
from streamrover.shard_service.api import DatasetSpec, LeaseGrant, LeaseStatus, PartitionPlan
from streamrover.shard_service.v1 import shard_service_pb2 as pb
from streamrover.sources.api import SourceKind


def _partition_cursors(items: list[tuple[PartitionKey, IntervalSet]]) -> list[pb.PartitionCursor]:
    return [
        pb.PartitionCursor(
            dataset=k.dataset,
            epoch=k.epoch,
            partition=k.partition,
            intervals=[pb.Interval(start=s, end=e) for s, e in ivs],
        )
        for k, ivs in items
    ]


def _interval_sets(msgs: Iterable[pb.PartitionCursor]) -> dict[PartitionKey, IntervalSet]:
    entries: dict[PartitionKey, IntervalSet] = {}
    for pc in msgs:
        key = PartitionKey(pc.dataset, pc.epoch, pc.partition)
        ivs = entries.setdefault(key, IntervalSet())
        for iv in pc.intervals:
            ivs.add(iv.start, iv.end)
    return entries


class DatasetFacts(Protocol):
    """What :func:`spec_info` reads of a dataset (the master's ``DatasetRecord`` has it): a protocol, so that
    this module, shared by the master and the client, depends on neither side."""

    spec: DatasetSpec
    kind: SourceKind
    schema_json: str


def spec_info(ds: DatasetFacts) -> pb.DatasetInfo:
    """What a worker needs to open a dataset's source: its spec, kind and schema (no partitions, no counts)."""
    kind = pb.DATASET_KIND_BATCH if ds.kind is SourceKind.BATCH else pb.DATASET_KIND_STREAM
    return pb.DatasetInfo(spec=spec_to_pb(ds.spec), kind=kind, schema_json=ds.schema_json)


def cursor_to_pb(cursor: DataCursor) -> pb.Cursor:
    """The cursor as its protobuf message (its lost part included)."""
    return pb.Cursor(partitions=_partition_cursors(cursor.items()), lost=_partition_cursors(cursor.lost_items()))


def cursor_from_pb(msg: pb.Cursor) -> DataCursor:
    """The cursor a protobuf message holds."""
    return DataCursor(_interval_sets(msg.partitions), _interval_sets(msg.lost))


def spec_to_pb(spec: DatasetSpec) -> pb.DatasetSpec:
    """The dataset spec as its protobuf message."""
    return pb.DatasetSpec(
        name=spec.name,
        uri=spec.uri,
        format=spec.format,
        options=dict(spec.options),
        records_per_shard=spec.records_per_shard,
        epochs=spec.epochs,
        shuffle=spec.shuffle,
        seed=spec.seed,
    )


def spec_from_pb(msg: pb.DatasetSpec) -> DatasetSpec:
    """The dataset spec a protobuf message holds (0 epochs reads as 1)."""
    return DatasetSpec(
        name=msg.name,
        uri=msg.uri,
        format=msg.format,
        options=dict(msg.options),
        records_per_shard=msg.records_per_shard,
        epochs=msg.epochs or 1,
        shuffle=msg.shuffle,
        seed=msg.seed,
    )


def partition_to_pb(p: PartitionPlan) -> pb.PartitionInfo:
    """A planned partition as its protobuf message."""
    return pb.PartitionInfo(index=p.index, id=p.id, start=p.start, end=p.end)


def partition_from_pb(msg: pb.PartitionInfo) -> PartitionPlan:
    """The planned partition a protobuf message holds."""
    return PartitionPlan(msg.index, msg.id, msg.start, msg.end)


def lease_to_pb(g: LeaseGrant) -> pb.Lease:
    """A lease grant as its protobuf message."""
    return pb.Lease(
        shard_id=g.shard_id,
        attempt=g.attempt,
        dataset=g.dataset,
        epoch=g.epoch,
        partition=partition_to_pb(g.partition),
        start=g.start,
        end=g.end,
        resume=g.resume,
        deadline_unix=g.deadline,
        shards=g.shards,
    )


def add_leases(leases: Any, grants: Iterable[LeaseGrant]) -> None:
    """Append lease grants to a repeated ``Lease`` field in place (as :func:`lease_to_pb` each, without a copy)."""
    for g in grants:
        p = g.partition
        leases.add(
            shard_id=g.shard_id,
            attempt=g.attempt,
            dataset=g.dataset,
            epoch=g.epoch,
            partition=pb.PartitionInfo(index=p.index, id=p.id, start=p.start, end=p.end),
            start=g.start,
            end=g.end,
            resume=g.resume,
            deadline_unix=g.deadline,
            shards=g.shards,
        )


_PARTITIONS: dict[tuple[int, str, int, int], PartitionPlan] = {}  # the few a worker's leases name, made once
_PARTITIONS_KEPT = 4096


def lease_from_pb(msg: pb.Lease) -> LeaseGrant:
    """The lease grant a protobuf message holds."""
    p = msg.partition
    key = (p.index, p.id, p.start, p.end)
    partition = _PARTITIONS.get(key)
    if partition is None:
        if len(_PARTITIONS) >= _PARTITIONS_KEPT:
            _PARTITIONS.clear()
        partition = _PARTITIONS[key] = PartitionPlan(*key)
    return LeaseGrant(
        shard_id=msg.shard_id,
        attempt=msg.attempt,
        dataset=msg.dataset,
        epoch=msg.epoch,
        partition=partition,
        start=msg.start,
        end=msg.end,
        resume=msg.resume,
        deadline=msg.deadline_unix,
        shards=max(msg.shards, 1),
    )


_LEASE_STATUS_TO_PB = {
    LeaseStatus.OK: pb.LEASE_STATUS_OK,
    LeaseStatus.WAIT: pb.LEASE_STATUS_WAIT,
    LeaseStatus.END: pb.LEASE_STATUS_END,
}
_LEASE_STATUS_FROM_PB: dict[int, LeaseStatus] = {int(v): k for k, v in _LEASE_STATUS_TO_PB.items()}


def lease_status_to_pb(status: LeaseStatus) -> pb.LeaseStatus.ValueType:
    """The wire value of a lease status."""
    return _LEASE_STATUS_TO_PB[status]


def lease_status_from_pb(value: int) -> LeaseStatus:
    """The lease status a wire value stands for; an unknown value (a newer master) reads as WAIT: ask again."""
    return _LEASE_STATUS_FROM_PB.get(value, LeaseStatus.WAIT)
