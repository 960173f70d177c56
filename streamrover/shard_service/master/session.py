"""The master's side of a worker session: one bidirectional stream per worker for its per-shard calls.

A worker's leases, acks, ack batches and heartbeats travel as messages on one long-lived
``WorkerSession`` stream instead of one unary RPC each, so a shard costs no call set-up
(no new HTTP/2 stream, no interceptor, no handler dispatch through the thread pool). Each
message is answered, in order, by the very code that answers the unary call of the same
name, under the same lock: the same fencing, the same journal commit before the answer, and
a refusal carries the gRPC status name the unary call would have failed with
(``error_code``), which the client raises as the same error type.

A lease is never long-polled on the stream (that would hold up the acks behind it): when
nothing can be leased now it is answered WAIT at once and a client that wants to wait uses
the unary ``LeaseShards``. When a journal write fails the stream ends UNAVAILABLE, as every
unary call does, and the master stops.

A session holds one server thread for its life (blocked in its request iterator between
messages). The master's pool has a thread for each of ``max_sessions`` sessions on top of the
threads it keeps for the unary calls (``MasterServer(max_workers=...)``), so a thousand workers
each hold a stream and the unary calls still find a thread; past ``max_sessions`` a session is
refused RESOURCE_EXHAUSTED and that client uses the unary calls. ``worker_sessions``
(:attr:`WorkerSessions.open`) is in ``/metrics``.

Why a thread per stream (issue 32; ``python -m benchmarks scale --models-only``, a bare echo stream, 2,000
messages/s offered, 2 cores): the server CPU per message was 120 us at 16 streams and 120 us at 1,000 (170 us on
a machine at load 15); ``grpc.aio`` with the answer made on the event loop was 0.6-0.9x that, and ``grpc.aio``
with the answer made in a pool of 2 threads 1.2-1.3x. The master's answer cannot be made on the loop: it
blocks on the core's lock and on the journal's group commit, and on one loop every message would commit alone
and wait behind every other; so the choice was between threads and aio with a pool, and threads cost less per
message and keep every line of the exactly-once path as it is. Their weakness is the tail: p99 320 ms at 1,000
streams against 30-55 ms for either aio (the GIL's hand-offs among a thousand threads).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc

from streamrover.cursor import CursorError
from streamrover.shard_service import convert
from streamrover.shard_service.api import DEFAULT_MAX_SESSIONS, ShardServiceError
from streamrover.shard_service.master.journal import JournalWriteError
from streamrover.shard_service.master.merging import sized_by_records
from streamrover.shard_service.v1 import shard_service_pb2 as pb
from streamrover.sources.api import SourceError, SourceNotFoundError, SourceUnavailableError

if TYPE_CHECKING:
    from streamrover.shard_service.master.core import ShardCore
    from streamrover.shard_service.master.server import ShardServicer



def status_of(exc: Exception) -> tuple[grpc.StatusCode, str] | None:
    """The precise gRPC status of one of the service's typed errors (None: not one of them)."""
    if isinstance(exc, JournalWriteError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, ShardServiceError):
        return getattr(grpc.StatusCode, exc.code), str(exc)
    if isinstance(exc, SourceNotFoundError):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, SourceUnavailableError):  # a broker down or slow: clients retry UNAVAILABLE with backoff
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, SourceError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, CursorError):  # a malformed cursor in a request (a reversed interval...)
        return grpc.StatusCode.INVALID_ARGUMENT, f"malformed cursor: {exc}"
    return None


def lease_limits(core: ShardCore, request: pb.LeaseRequest) -> tuple[int, int]:
    """A lease request's ``max_shards`` and ``merge_records``, its limits in records applied (.merging)."""
    if request.max_records <= 0 and request.merge_shards <= 0:
        return request.max_shards, request.merge_records
    core.worker(request.worker_id)  # an unknown worker is refused before an unknown dataset, as lease() does
    return sized_by_records(
        core.dataset(request.dataset), request.max_shards, request.merge_records, request.max_records,
        request.merge_shards,
    )  # fmt: skip


class WorkerSessions:
    """Serves ``WorkerSession`` streams for a :class:`~streamrover.shard_service.master.server.ShardServicer`."""

    def __init__(self, servicer: ShardServicer, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        self._servicer = servicer
        self.max_sessions = max_sessions
        self._open = 0
        self._lock = threading.Lock()
        cls = type(servicer)
        # each fills its part of the answer; the unary handlers' bodies without their status mapping (a refusal
        # answers one message, not the stream)
        self._calls: dict[str, Callable[[Any, pb.SessionResponse, Any], None]] = {
            "lease": self._lease_now,
            "ack": lambda request, answer, context: servicer.ack_into(request, answer.ack),
            "ack_batch": self._copied(cls.AckBatch, "ack_batch"),
            "heartbeat": self._copied(cls.Heartbeat, "heartbeat"),
        }

    @property
    def open(self) -> int:
        """Sessions being served now."""
        return self._open

    def _copied(self, method: Any, kind: str) -> Callable[[Any, pb.SessionResponse, Any], None]:
        body = method.__wrapped__
        servicer = self._servicer

        def call(request: Any, answer: pb.SessionResponse, context: Any) -> None:
            part = getattr(answer, kind)
            part.CopyFrom(body(servicer, request, context))
            part.SetInParent()  # (an answer of all defaults still names its call)

        return call

    def _lease_now(self, request: pb.LeaseRequest, answer: pb.SessionResponse, context: Any) -> None:
        """``LeaseShards`` with no wait (the stream never long-polls): one lease under the lock, the same checks."""
        servicer = self._servicer
        core = servicer.core
        with servicer.cond:  # leaving it waits until the lease is journalled (group commit)
            max_shards, merge = lease_limits(core, request)
            outcome = core.lease(request.worker_id, request.dataset, max_shards, request.request_id, merge)
            todo = core.todo(request.dataset)
            if request.describe:
                answer.lease.dataset.CopyFrom(convert.spec_info(core.dataset(request.dataset)))
        lease = answer.lease
        lease.todo = todo
        lease.status = convert.lease_status_to_pb(outcome.status)  # (set even when 0: the answer is a lease's)
        lease.retry_after_seconds = outcome.retry_after
        convert.add_leases(lease.leases, outcome.leases)

    def serve(
        self, requests: Iterator[pb.SessionRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.SessionResponse]:
        """Answer every request of one stream, in order, until the worker closes it."""
        with self._lock:
            if self._open >= self.max_sessions:
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the master serves {self.max_sessions} worker sessions already: use the unary calls",
                )
            self._open += 1
        try:
            for request in requests:
                yield self._answer(request, context)
        finally:
            with self._lock:
                self._open -= 1

    def _answer(self, request: pb.SessionRequest, context: grpc.ServicerContext) -> pb.SessionResponse:
        kind = request.WhichOneof("call")
        call = self._calls.get(kind or "")
        if call is None:
            return pb.SessionResponse(
                seq=request.seq, error_code="INVALID_ARGUMENT", error=f"session message {request.seq} carries no call"
            )
        answer = pb.SessionResponse(seq=request.seq)
        try:
            call(getattr(request, kind or ""), answer, context)  # (a lease or an ack sets a field of its answer)
        except (JournalWriteError, ShardServiceError, SourceError, CursorError) as exc:
            code, message = status_of(exc) or (grpc.StatusCode.UNKNOWN, str(exc))
            answer = pb.SessionResponse(seq=request.seq, error_code=code.name, error=message)
        failed = self._servicer.core.journal.failed  # as a unary call: nothing answered from state not durable
        if failed:
            self._servicer.fail_stop(failed)
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the master is stopping: {failed}")
        return answer


__all__ = ["DEFAULT_MAX_SESSIONS", "WorkerSessions", "status_of"]
