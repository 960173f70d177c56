"""The job master's gRPC servicer: one lock around the core, long-poll leases, the lease reaper, fail-stop.

The process around it (journal, auth, listening socket, state-dir lock) is in :mod:`.master`.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from streamrover.cursor import CursorError
from streamrover.shard_service import convert
from streamrover.shard_service.api import (
    InvalidArgumentError,
    LeaseGrant,
    LeaseStatus,
    PermissionDeniedError,
    Role,
    ShardServiceError,
)
from streamrover.shard_service.master.auth import Tokens, role_in
from streamrover.shard_service.master.bookkeeping import DatasetRecord
from streamrover.shard_service.master.core import AckItem, ShardCore
from streamrover.shard_service.master.cursor_rpc import cut_commit, cut_prepare, get_cursor, restore
from streamrover.shard_service.master.group_commit import CommitLock
from streamrover.shard_service.master.info import dataset_info, partition_limit
from streamrover.shard_service.master.journal import JournalWriteError
from streamrover.shard_service.master.kv_rpc import kv_delete_range, kv_get, kv_set
from streamrover.shard_service.master.poller import StreamPoller
from streamrover.shard_service.master.reported import ReportedMetrics
from streamrover.shard_service.master.session import DEFAULT_MAX_SESSIONS, WorkerSessions, lease_limits, status_of
from streamrover.shard_service.master.staged_rpc import commit_staged
from streamrover.shard_service.master.stragglers import StragglerWatch, paces_pb
from streamrover.shard_service.master.unreadable import report_unreadable
from streamrover.shard_service.v1 import shard_service_pb2 as pb
from streamrover.shard_service.v1 import shard_service_pb2_grpc as pb_grpc
from streamrover.sources.api import (
    SourceError,
    SourceKind,
    open_source,
    validate_dataset_name,
)
from streamrover.sources.staged import StagedSource, is_staged

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_LEASE_WAIT = 30.0


def _rpc(method: Callable[..., T]) -> Callable[..., T]:
    """Turn the service's typed errors into precise gRPC statuses."""

    @functools.wraps(method)
    def wrapper(self: ShardServicer, request: Any, context: grpc.ServicerContext) -> T:
        error: tuple[grpc.StatusCode, str] | None = None
        try:
            result = method(self, request, context)
        except (JournalWriteError, ShardServiceError, SourceError, CursorError) as exc:
            error = status_of(exc)
        failed = self.core.journal.failed  # set under the lock: a call that ran after it saw memory ahead of it
        if failed:
            self.fail_stop(failed)
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the master is stopping: {failed}")
        if error is not None:
            context.abort(*error)
        return result

    return wrapper


class ShardServicer(pb_grpc.ShardServiceServicer):
    """Serialises every call on one condition variable around the :class:`ShardCore`."""

    def __init__(
        self,
        core: ShardCore,
        on_fatal: Callable[[str], None] | None = None,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        tokens: Tokens | None = None,
        on_stop: Callable[[str], None] | None = None,
        stragglers: StragglerWatch | None = None,
    ) -> None:
        self.core = core
        self.stragglers = stragglers or StragglerWatch()  # node pace from the ranks' reports (stragglers.py)
        self.tokens = tokens  # for the calls a worker may make in part (None: every caller is an admin)
        self._on_stop = on_stop
        self.stopping = False  # a Stop call was answered
        self.security_warning = ""  # set by the process (a master off loopback without TLS)
        self.sessions = WorkerSessions(self, max_sessions)
        self.cond = CommitLock(core.journal)  # one lock around the core; journal commits grouped (.group_commit)
        self.reported = ReportedMetrics()  # what trainers report (loss, AUC...): in memory, not journalled
        self.fatal = ""  # why the service stopped answering (a journal write failed)
        self._on_fatal = on_fatal
        self._fatal_lock = threading.Lock()
        self.lease_waiters: Counter[str] = Counter()  # per dataset: LeaseShards calls waiting for a shard (or END)
        self._closed = False
        self._reaper = threading.Thread(target=self._reap, name="lease-reaper", daemon=True)
        self._reaper.start()
        self.pollers: dict[str, StreamPoller] = {}
        for name, ds in sorted(core.datasets.items()):
            if ds.kind is SourceKind.STREAM and not ds.failed:
                self._start_poller(name)

    def _start_poller(self, name: str) -> None:
        if is_staged(self.core.datasets[name].spec.uri):
            return  # its shards are planned when a sink commits files (CommitStaged), not polled
        poller = StreamPoller(self, name)  # options journalled by an older build fail the dataset in its thread
        self.pollers[name] = poller
        poller.start()

    def fail_stop(self, reason: str) -> None:
        """A journal write failed: answer nothing more (memory may be ahead of the journal) and stop the master."""
        with self._fatal_lock:
            if self.fatal:
                return
            self.fatal = reason
        log.critical(
            "%s: the master stops, as its memory may be ahead of its journal; fix the cause (free the disk) "
            "and start it again: the journal is replayed, and every answered call is in it",
            reason,
        )
        if self._on_fatal is not None:
            threading.Thread(target=self._on_fatal, args=(reason,), name="fail-stop", daemon=True).start()

    def close(self) -> None:
        """Stop the lease reaper and every stream poller (the gRPC server is stopped by its owner)."""
        with self.cond:
            self._closed = True
            self.cond.notify_all()
        self._reaper.join(timeout=5)
        for poller in self.pollers.values():
            poller.stop()

    def _reap(self) -> None:
        """Expire leases and dead workers at their deadlines, and wake waiting lease calls."""
        try:
            with self.cond:
                while not self._closed:
                    deadline = self.core.next_deadline()
                    timeout = None if deadline is None else max(deadline - self.core.clock(), 0.0) + 0.01
                    self.cond.wait(timeout)  # (it commits the open group first: a commit can fail here)
                    if not self._closed and self.core.expire():
                        self.cond.notify_all()
        except JournalWriteError as exc:
            self.fail_stop(str(exc))

    # ----------------------------------------------------------------- datasets
    def _info(self, ds: DatasetRecord, limit: int = 0) -> pb.DatasetInfo:
        return dataset_info(self.core, ds, limit)

    @_rpc
    def RegisterDataset(self, request: pb.RegisterDatasetRequest, context: Any) -> pb.RegisterDatasetResponse:
        """RPC: :meth:`ShardCore.register_dataset`, the source opened outside the lock; a new stream's poller starts."""
        spec = convert.spec_from_pb(request.spec)
        validate_dataset_name(spec.name)
        spec.validate()
        with self.cond:
            existing = self.core.datasets.get(spec.name)
            if existing is not None and existing.spec == spec.normalized():
                return pb.RegisterDatasetResponse(dataset=self._info(existing), created=False)
        if role_in(context, self.tokens) is not Role.ADMIN:
            what = "a new dataset" if existing is None else "a changed spec of dataset"
            raise PermissionDeniedError(
                f"RegisterDataset of {what} {spec.name!r}: the worker role may only register a dataset already "
                "registered with the same spec; adding one needs the admin token"
            )
        source = open_source(spec.uri, spec.format, spec.options, spec.epochs)  # I/O outside the lock
        try:
            partitions = source.partitions()
            schema = source.declared_schema() if isinstance(source, StagedSource) else source.schema()
            schema_json = json.dumps([[f.name, str(f.type)] for f in schema or ()])  # staged: the first file's
        finally:
            source.close()
        with self.cond:
            ds, created = self.core.register_dataset(spec, source.kind, partitions, schema_json, source.record_times)
            if created and ds.kind is SourceKind.STREAM:
                self._start_poller(ds.name)
            self.cond.notify_all()
            return pb.RegisterDatasetResponse(dataset=self._info(ds), created=created)

    @_rpc
    def ResumeDataset(self, request: pb.ResumeDatasetRequest, context: Any) -> pb.ResumeDatasetResponse:
        """RPC: clear a dataset's failure (``skip_lost``: deleted records count as lost); a stream's poller restarts."""
        with self.cond:
            resumed = self.core.streams.resume_dataset(request.name, skip_lost=request.skip_lost)
            if resumed:
                self.core.staged.resume_gaps(request.name, skip=request.skip_lost)
            ds = self.core.dataset(request.name)
            old = self.pollers.get(ds.name) if resumed and ds.kind is SourceKind.STREAM else None
        if old is not None:
            old.stop()  # it ended when it failed the dataset (outside the lock: it takes the lock to end)
        with self.cond:
            if resumed and ds.kind is SourceKind.STREAM and self.pollers.get(ds.name) is old:
                self._start_poller(ds.name)
            self.cond.notify_all()
            return pb.ResumeDatasetResponse(dataset=self._info(ds), resumed=resumed)

    @_rpc
    def DescribeDataset(self, request: pb.DescribeDatasetRequest, context: Any) -> pb.DatasetInfo:
        """RPC: a dataset's info (``spec_only``: its spec, kind and schema, without walking the counts)."""
        with self.cond:
            ds = self.core.dataset(request.name)
            if request.spec_only:  # a worker opening the source: the counts walk every unfolded ack
                return convert.spec_info(ds)
            return self._info(ds, max(request.partition_limit, 0))

    @_rpc
    def RemoveDataset(self, request: pb.RemoveDatasetRequest, context: Any) -> pb.RemoveDatasetResponse:
        """RPC: :meth:`ShardCore.remove_dataset`; its poller stops."""
        with self.cond:
            revoked, removed = self.core.remove_dataset(request.name)
            poller = self.pollers.pop(request.name, None)
            if poller is not None:
                poller.request_stop()  # under the lock: it plans nothing for the removed dataset after this
            self.cond.notify_all()
        if poller is not None:
            poller.stop()
        log.info("dataset %s removed (%d leases revoked, %d shards)", request.name, revoked, removed)
        return pb.RemoveDatasetResponse(leases_revoked=revoked, shards_removed=removed)

    @_rpc
    def ListDatasets(self, request: pb.ListDatasetsRequest, context: Any) -> pb.ListDatasetsResponse:
        """RPC: every dataset's info, by name."""
        with self.cond:
            limit = partition_limit(request.partition_limit)
            return pb.ListDatasetsResponse(datasets=[self._info(d, limit) for _, d in sorted(self.core.datasets.items())
                                                     ])  # fmt: skip

    CommitStaged = _rpc(commit_staged)
    ReportUnreadable = _rpc(report_unreadable)
    KvGet = _rpc(kv_get)  # the key-value RPCs (coordination state such as rendezvous)
    KvSet = _rpc(kv_set)
    KvDeleteRange = _rpc(kv_delete_range)

    # ------------------------------------------------------------------ workers
    @_rpc
    def Join(self, request: pb.JoinRequest, context: Any) -> pb.JoinResponse:
        """RPC: :meth:`ShardCore.join`; answers the lease TTL and the heartbeat interval (a quarter of it)."""
        if not request.name:
            raise InvalidArgumentError("join: a worker name is required (for example host:pid)")
        with self.cond:
            w = self.core.join(request.name, request.worker_id)
            self.cond.notify_all()  # the reaper's next deadline may have moved
            ttl = self.core.lease_ttl
            return pb.JoinResponse(worker_id=w.id, lease_ttl_seconds=ttl, heartbeat_interval_seconds=ttl / 4)

    @_rpc
    def Leave(self, request: pb.LeaveRequest, context: Any) -> pb.LeaveResponse:
        """RPC: :meth:`ShardCore.leave`."""
        with self.cond:
            returned = self.core.leave(request.worker_id)
            self.cond.notify_all()
            return pb.LeaveResponse(leases_returned=returned)

    @_rpc
    def LeaseShards(self, request: pb.LeaseRequest, context: Any) -> pb.LeaseResponse:
        """RPC: :meth:`ShardCore.lease`, waiting up to ``wait_seconds`` (at most ``MAX_LEASE_WAIT``) while it says
        WAIT.
        """
        wait = min(max(request.wait_seconds, 0.0), MAX_LEASE_WAIT)
        with self.cond:
            give_up = self.core.clock() + wait
            max_shards, merge = lease_limits(self.core, request)
            while True:
                outcome = self.core.lease(request.worker_id, request.dataset, max_shards, request.request_id, merge)
                remaining = give_up - self.core.clock()
                if outcome.status is not LeaseStatus.WAIT or remaining <= 0 or not context.is_active():
                    break
                self.lease_waiters[request.dataset] += 1
                try:
                    self.cond.wait(min(remaining, max(outcome.retry_after, 0.01)))
                finally:
                    self.lease_waiters[request.dataset] -= 1
            return pb.LeaseResponse(
                status=convert.lease_status_to_pb(outcome.status),
                leases=[convert.lease_to_pb(g) for g in outcome.leases],
                retry_after_seconds=outcome.retry_after,
                todo=self.core.todo(request.dataset),
                dataset=convert.spec_info(self.core.dataset(request.dataset)) if request.describe else None,
            )

    @_rpc
    def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> pb.HeartbeatResponse:
        """RPC: :meth:`ShardCore.heartbeat`: the new deadline and the leases revoked since the last beat."""
        with self.cond:
            deadline, revoked = self.core.heartbeat(request.worker_id)
            return pb.HeartbeatResponse(
                deadline_unix=deadline,
                revoked_shard_ids=[sid for sid, _ in revoked],
                revoked=[pb.ShardProgress(shard_id=sid, attempt=attempt) for sid, attempt in revoked],
            )

    @_rpc
    def Ack(self, request: pb.AckRequest, context: Any) -> pb.AckResponse:
        """RPC: :meth:`ShardCore.ack`; an ack that finishes its shard with ``lease_more`` brings new leases in its
        answer.
        """
        answer = pb.AckResponse()
        self.ack_into(request, answer)
        return answer

    def ack_into(self, request: pb.AckRequest, answer: pb.AckResponse) -> None:
        """:meth:`Ack`'s work, its answer written into ``answer`` (a session message's, in place)."""
        step = request.step if request.has_step else None
        with self.cond:
            result = self.core.ack(
                request.worker_id, request.shard_id, request.attempt, request.position, step, request.dead_letters
            )
            if result.shard_done:
                self._wake_lease_waiters()
            grants: list[LeaseGrant] = []
            if result.shard_done and request.lease_more > 0:
                dataset = self.core.shards_dataset(request.shard_id)
                if dataset is not None:
                    # Request id -attempt (attempts are unique in the job): a retried ack, whose first answer
                    # was lost with the master, gets the same leases back instead of orphaning them.
                    grants = self.core.lease(
                        request.worker_id, dataset, request.lease_more, -request.attempt, request.merge_records
                    ).leases
        answer.shard_done, answer.duplicate = result.shard_done, result.duplicate  # (leaving waits for the journal)
        convert.add_leases(answer.leases, grants)

    @_rpc
    def AckBatch(self, request: pb.AckBatchRequest, context: Any) -> pb.AckBatchResponse:
        """A worker's queued acks in one round trip: each as a lone Ack, one journal commit, answered per ack."""
        acks = [
            AckItem(a.worker_id, a.shard_id, a.attempt, a.position, a.step if a.has_step else None, a.dead_letters)
            for a in request.acks
        ]
        with self.cond:
            results, outcome = self.core.ack_batch(
                acks, request.worker_id, request.lease_dataset, request.lease_more, request.request_id,
                request.merge_records,
            )
            answers: list[pb.AckOutcome] = []
            for r in results:
                if isinstance(r, ShardServiceError):
                    answers.append(pb.AckOutcome(error_code=r.code, error=str(r)))
                else:
                    answers.append(pb.AckOutcome(shard_done=r.shard_done, duplicate=r.duplicate))
            if any(a.shard_done for a in answers):
                self._wake_lease_waiters()
            leases = [] if outcome is None else [convert.lease_to_pb(g) for g in outcome.leases]
            return pb.AckBatchResponse(results=answers, leases=leases, todo=self.core.todo(request.lease_dataset))

    def WorkerSession(self, requests: Iterator[pb.SessionRequest], context: Any) -> Iterator[pb.SessionResponse]:
        """A worker's leases, acks and heartbeats on one stream, each answered as its unary call (see .session)."""
        return self.sessions.serve(requests, context)

    def _wake_lease_waiters(self) -> None:
        """A shard was finished: a lease call waiting for the last shards may now be answered END.

        Only lease calls need it (called with the lock held): an ack moves no deadline earlier,
        so the reaper sleeps on; waking it on every ack cost CPU for nothing.
        """
        if self.lease_waiters.total():
            self.cond.notify_all()

    # ------------------------------------------------------------------- cursor
    CutPrepare = _rpc(cut_prepare)  # cuts, commits and restores (.cursor_rpc)
    CutCommit = _rpc(cut_commit)
    GetCursor = _rpc(get_cursor)
    Restore = _rpc(restore)

    # ------------------------------------------------------------------- status
    @_rpc
    def Status(self, request: pb.StatusRequest, context: Any) -> pb.StatusResponse:
        """RPC: every dataset's info, the workers, the ack rates and the cut state."""
        with self.cond:
            now = self.core.clock()
            rps, aps = self.core.rates()
            limit = partition_limit(request.partition_limit)
            workers = [
                pb.WorkerStatus(
                    worker_id=w.id,
                    name=w.name,
                    leases=len(w.leases),
                    last_seen_seconds_ago=now - w.last_seen,
                    records_acked=w.records_acked,
                )
                for _, w in sorted(self.core.workers.items())
            ]
            return pb.StatusResponse(
                datasets=[self._info(d, limit) for _, d in sorted(self.core.datasets.items())],
                workers=workers,
                records_per_second=rps,
                acks_per_second=aps,
                last_committed_cut=self.core.cut_book.last_committed_cut,
                uptime_seconds=now - self.core.started,
                cut_commit_error=self.core.cut_book.cut_commit_error,
                persisting_cuts=self.core.cut_book.persisting(),
                security_warning=self.security_warning,
                node_paces=paces_pb(self.stragglers),
            )

    @_rpc
    def Stop(self, request: pb.StopRequest, context: Any) -> pb.StopResponse:
        """RPC (admin only): answer, then stop the master (its process exits as after a signal)."""
        if self._on_stop is None:
            raise InvalidArgumentError("Stop: this master is not run by a process that can stop it")
        self.stopping = True
        threading.Thread(target=self._on_stop, args=(request.reason,), name="stop", daemon=True).start()
        return pb.StopResponse()

    @_rpc
    def ReportMetrics(self, request: pb.ReportMetricsRequest, context: Any) -> pb.ReportMetricsResponse:
        """A trainer's measurements (loss, AUC...): kept in memory for /metrics and the dashboard."""
        self.reported.report(request.reporter, dict(request.values), request.step if request.has_step else None)
        self.stragglers.observe(request.reporter, request.values)
        return pb.ReportMetricsResponse()


__all__ = ["ShardServicer"]
