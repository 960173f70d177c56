"""The ``ReportUnreadable`` RPC: data a worker cannot read is checked by the master, and its loss made loud.

A worker whose leased shard's data is gone (a staged file deleted before it was trained, a batch file
removed) reports the position it could not read. The master reads the same position itself, outside the
service lock:

- it can read it: the worker's access is broken (a mount, credentials), not the data. FAILED_PRECONDITION
  says so, and nothing changes;
- it cannot: the records from there are lost. By default (``sr.on_data_loss=fail``) the dataset fails,
  naming the partition and positions (leases are refused; status and ``/metrics`` show it). With
  ``sr.on_data_loss=skip`` the partition's untrained positions are accounted as lost (status, ``/metrics``,
  every later cursor's lost part, as for records deleted upstream: :mod:`.upstream`), its leases are
  revoked and its shards dropped.

The servicer binds :func:`report_unreadable` as its ``ReportUnreadable`` method (``server.py``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from streamrover.cursor import PartitionKey
from streamrover.shard_service.api import FailedPreconditionError, NotFoundError, ShardState
from streamrover.shard_service.v1 import shard_service_pb2 as pb
from streamrover.sources.api import Partition, SourceNotFoundError, SourceUnreadableError, open_source

if TYPE_CHECKING:  # pragma: no cover
    from streamrover.shard_service.master.bookkeeping import DatasetRecord
    from streamrover.shard_service.master.core import ShardCore
    from streamrover.shard_service.master.server import ShardServicer

log = logging.getLogger(__name__)


def _readable(ds: DatasetRecord, pindex: int, position: int, end: int) -> str:
    """'' when the master reads position ``position`` of partition ``pindex``; else why it cannot."""
    plan = ds.partitions[pindex]
    spec = ds.spec
    try:
        source = open_source(spec.uri, spec.format, dict(spec.options))
        try:
            for _ in source.read(Partition(plan.id, plan.start, plan.end), position, min(end, position + 1), 1):
                break
        finally:
            source.close()
    except (SourceNotFoundError, SourceUnreadableError) as exc:
        return str(exc)
    return ""


def _skip(core: ShardCore, ds: DatasetRecord, pindex: int) -> int:
    """Account the partition's untrained positions as lost, revoke its leases, drop its unacked shards.

    Shards with acks not yet in a committed cut keep them (they are trained) and are dropped by a later report
    once a cut folded them. Returns the records accounted as lost now.
    """
    plan = ds.partitions[pindex]
    upstream = core.streams.upstream
    key = PartitionKey(ds.name, 0, plan.id)
    covered = core.acked_cursor().get(key)
    holes = covered.missing(plan.start, plan.end)
    with core.journal.transaction():
        for s in core.shards_of(ds.name, ordered=True):
            if s.pindex != pindex:
                continue
            if s.state is ShardState.LEASED:
                core._return_lease(s)  # back to TODO, fenced: the worker's acks of it are refused
            if s.state is ShardState.TODO and not s.acks:
                core.drop_shard(s.id)
                core.journal.delete_shard(s.id)
        for a, b in holes:
            upstream.lost.add_lost(key, a, b)
        upstream.save_lost()
        core.save_counters()
    return sum(ds.records_in(pindex, a, b) for a, b in holes)


def report_unreadable(
    self: ShardServicer, request: pb.ReportUnreadableRequest, context: Any
) -> pb.ReportUnreadableResponse:
    """A worker could not read its shard from ``position``: check it, and fail the dataset or skip the loss."""
    with self.cond:
        self.core.worker(request.worker_id)
        s = self.core.shards.get(request.shard_id)
        if s is None:
            raise NotFoundError(f"shard {request.shard_id!r} is unknown (its dataset was removed, or it was compacted)")
        ds = self.core.dataset(s.dataset)
        if ds.failed:
            return pb.ReportUnreadableResponse(failed=True, reason=ds.failed)
        position = min(max(request.position, s.start), s.end)
        pindex, end, pid = s.pindex, s.end, ds.partitions[s.pindex].id
    gone = _readable(ds, pindex, position, end)  # I/O outside the lock
    if not gone:
        raise FailedPreconditionError(
            f"the master reads {pid!r} at position {position}: the data is there, so this worker's access to it is "
            f"broken (a mount, credentials, a path it resolves differently): {request.error}"
        )
    policy = ds.spec.options.get("sr.on_data_loss", "fail")
    with self.cond:
        if ds.failed:
            return pb.ReportUnreadableResponse(failed=True, reason=ds.failed)
        if policy == "skip":
            lost = _skip(self.core, ds, pindex)
            log.error("dataset %s: %s can no longer be read (%s): skipped %d untrained records (sr.on_data_loss=skip)",
                      ds.name, pid, gone, lost)  # fmt: skip
            self.cond.notify_all()
            return pb.ReportUnreadableResponse(lost_records=lost, reason=gone)
        reason = (
            f"{pid} can no longer be read from position {position}, before its records were trained: {gone}. "
            f"Put the data back and run 'streamrover dataset resume {ds.name}', or register the dataset with "
            "sr.on_data_loss=skip to account such records as lost"
        )
        log.error("dataset %s failed: %s", ds.name, reason)
        self.core.streams.fail_dataset(ds.name, reason)
        self.cond.notify_all()
        return pb.ReportUnreadableResponse(failed=True, reason=reason)
