"""The worker-side client of the shard service: lease, read, ack, heartbeat, cut.

``ShardClient`` is framework-neutral; trainers wrap it. A typical worker::

    with ShardClient("127.0.0.1:7070", token=token, async_acks=True) as client:
        for shard in client.shards("clicks"):
            for batch in shard.batches():
                apply(batch.records)
                shard.ack(batch.end)      # queued: returns at once
        client.flush()                    # every ack recorded; raises AckFailedError if any was refused

By default ``ack()`` waits for the master's answer. With ``async_acks=True`` (or
``ack(..., wait=False)``) acks leave the read path: ``ack()`` queues the ack and returns;
a sender thread sends the queued acks in order, every ack queued so far in one
``AckBatch`` round trip answered per ack (the batch brings the next leases back with it).
Everything that depends on acks being recorded waits for them first: ``flush()``,
``prepare_cut()``, ``get_cursor()``, ``leave()`` and ``ack(..., wait=True)``. A refused
ack is never dropped: it is raised by the next of those (as :class:`AckFailedError`), by
the next ack of the same lease (as :class:`LeaseLostError`), or returned by
``take_ack_failures()``. Only this client's acks are flushed: when another process takes
the cut (rank 0 for every rank), each acking process must ``flush()`` before it tells
that process to go on (the barrier).
The full semantics are in :mod:`streamrover.shard_service.client_acks`.

Calls survive a master restart: they wait for the channel to be ready and retry
``UNAVAILABLE`` with backoff for up to ``timeout`` seconds. Retried calls are
safe: acks are idempotent per attempt and lease requests carry a request id.
"""

from __future__ import annotations

import math
import os
import random
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar, overload

import grpc

from streamrover.cursor import DataCursor
from streamrover.shard_service import convert
from streamrover.shard_service.api import (
    AckResult,
    AlreadyExistsError,
    DatasetSpec,
    FailedPreconditionError,
    InvalidArgumentError,
    LeaseGrant,
    LeaseStatus,
    NotFoundError,
    ShardServiceError,
    UnauthenticatedError,
    UnavailableError,
)
from streamrover.shard_service.client_acks import AckFailure, AckQueue, QueuedAck
from streamrover.shard_service.leased import LeasedShard
from streamrover.shard_service.v1 import shard_service_pb2 as pb
from streamrover.shard_service.v1 import shard_service_pb2_grpc as pb_grpc
from streamrover.sources.api import Source, open_source

T = TypeVar("T")
_ERRORS: dict[grpc.StatusCode, type[ShardServiceError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
}
_ERRORS_BY_NAME: dict[str, type[ShardServiceError]] = {code.name: error for code, error in _ERRORS.items()}
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
CLOSE_ACK_WAIT = 10.0  # seconds close() waits for queued acks (a master restarting comes back within this)
PREFETCH_SECONDS = 0.02  # shards() keeps about this much of its caller's work leased ahead when shards are small...
MAX_PREFETCH = 128  # ...but no more than this many shards
PREFETCH_RECORDS = 256 * 1024  # until the caller's pace is known (RAMP_SHARDS taken): about this many records
RAMP_SHARDS = 16


class ShardClient:
    """A connection to the shard service, as a worker and as an administrator."""

    def __init__(
        self,
        address: str | None = None,
        token: str | None = None,
        name: str | None = None,
        *,
        timeout: float = 120.0,
        heartbeat: bool = True,
        async_acks: bool = False,
    ) -> None:
        """Connect to the master at ``address`` (default ``$STREAMROVER_MASTER``) with ``token``.

        ``async_acks``: when True, acks are queued and sent by a background thread in order
        (see the module docstring: who flushes them before a cut); when False (the default)
        every ack waits for the master's answer. ``ack(..., wait=...)`` overrides it per call.
        """
        self.address = address or os.environ.get("STREAMROVER_MASTER", "127.0.0.1:7070")
        self.token = token if token is not None else os.environ.get("STREAMROVER_TOKEN", "")
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.timeout = timeout
        self._channel = grpc.insecure_channel(
            self.address,
            options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.enable_retries", 1)],
        )
        self._stub = pb_grpc.ShardServiceStub(self._channel)
        self._metadata = (("authorization", f"Bearer {self.token}"),)
        self.worker_id = ""
        self.heartbeat_interval = 1.0
        self._want_heartbeat = heartbeat
        self._hb_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._left = False  # leave() was called (and join() not since): lease() must not join again
        self._lock = threading.Lock()
        self._source_lock = threading.Lock()
        self._request_id = 0
        self._sources: dict[str, Source] = {}
        self._held: dict[str, LeasedShard] = {}
        self._prefetched: dict[str, deque[LeasedShard]] = {}  # leases that came with acks, not yet yielded
        self._lease_more: dict[str, int] = {}  # per dataset read by shards(): leases to keep waiting
        self._prefetch_base: dict[str, int] = {}  # per dataset read by shards(): the prefetch it was asked for
        self._records_per_shard: dict[str, int] = {}  # per dataset whose source is open: as registered (0: default)
        self._revoked: set[tuple[str, int]] = set()  # (shard id, attempt): a shard id may be leased again
        self.async_acks = async_acks
        self._acks = AckQueue(self._send_acks, may_hold=self._readers_supplied)
        self._last_ack_answer = 0.0

    # ------------------------------------------------------------------ plumbing
    def _call(self, method: Callable[..., T], request: Any, timeout: float | None = None) -> T:
        give_up = time.monotonic() + self.timeout
        delay = 0.05
        while True:
            remaining = give_up - time.monotonic()
            try:
                return method(
                    request,
                    metadata=self._metadata,
                    wait_for_ready=True,
                    timeout=max(min(remaining, timeout or remaining), 0.01),
                )
            except grpc.RpcError as exc:
                code = exc.code()
                retry = code in _RETRYABLE or (code == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is None)
                if retry and time.monotonic() + delay < give_up:
                    time.sleep(delay * (0.5 + random.random()))  # backoff between retries, not synchronisation
                    delay = min(delay * 2, 2.0)
                    continue
                error = _ERRORS.get(code, ShardServiceError)
                raise error(f"{exc.details()} [{code.name} from {self.address}]") from None

    def close(self) -> None:
        """Send the acks still queued (for up to 10 s), stop the threads, close the channel.

        Does not raise ack failures (it runs on error paths too): unreported ones are logged;
        call :meth:`flush` or :meth:`leave` first to get them raised.
        """
        self._stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=5)
        self._acks.close(min(self.timeout, CLOSE_ACK_WAIT))
        for source in self._sources.values():
            source.close()
        self._channel.close()

    def __enter__(self) -> ShardClient:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.worker_id and exc[0] is None:
                self.leave()
        finally:
            self.close()

    # ------------------------------------------------------------------ datasets
    def register_dataset(self, spec: DatasetSpec) -> pb.RegisterDatasetResponse:
        return self._call(self._stub.RegisterDataset, pb.RegisterDatasetRequest(spec=convert.spec_to_pb(spec)))

    def describe_dataset(self, name: str, spec_only: bool = False) -> pb.DatasetInfo:
        """The dataset's spec, partitions and counts; ``spec_only``: its spec, kind and schema only (cheaper)."""
        return self._call(self._stub.DescribeDataset, pb.DescribeDatasetRequest(name=name, spec_only=spec_only))

    def remove_dataset(self, name: str) -> pb.RemoveDatasetResponse:
        """Remove a dataset (its leases are revoked, its shards and cursor entries deleted)."""
        return self._call(self._stub.RemoveDataset, pb.RemoveDatasetRequest(name=name))

    def list_datasets(self) -> list[pb.DatasetInfo]:
        return list(self._call(self._stub.ListDatasets, pb.ListDatasetsRequest()).datasets)

    def resume_dataset(self, name: str, skip_lost: bool = False) -> pb.ResumeDatasetResponse:
        """Resume a FAILED dataset (once its cause is fixed); ``resumed`` is False if it was not failed.

        ``skip_lost``: records deleted upstream so far are accounted as lost (as ``sr.on_data_loss=skip`` does).
        """
        return self._call(self._stub.ResumeDataset, pb.ResumeDatasetRequest(name=name, skip_lost=skip_lost))

    def commit_staged(
        self, dataset: str, producer: str, part: str, epoch: int, files: Sequence[tuple[str, int]]
    ) -> pb.CommitStagedResponse:
        """Commit staged Parquet files ``(uri, records)`` to a staged dataset, once per (producer, part, epoch).

        A repeat of a committed key answers ``already_committed`` and adds nothing (safe to retry).
        """
        staged = [pb.StagedFile(uri=uri, records=records) for uri, records in files]
        request = pb.CommitStagedRequest(dataset=dataset, producer=producer, part=part, epoch=epoch, files=staged)
        return self._call(self._stub.CommitStaged, request)

    def status(self) -> pb.StatusResponse:
        return self._call(self._stub.Status, pb.StatusRequest())

    def report(self, values: Mapping[str, float], step: int | None = None, reporter: str | None = None) -> None:
        """Report trainer metrics (``client.report({"loss": 0.41, "auc": 0.78}, step=120)``) to the master:
        its Prometheus ``/metrics`` (``streamrover_trainer_metric``) and dashboard show them.

        ``reporter`` defaults to the client's name (e.g. ``rank0@node``; a StreamSession names it so).
        """
        request = pb.ReportMetricsRequest(reporter=reporter or self.name, values=dict(values))
        if step is not None:
            request.has_step, request.step = True, step
        self._call(self._stub.ReportMetrics, request)

    def _source(self, dataset: str) -> Source:
        with self._source_lock:  # the ack sender adopts leases too
            source = self._sources.get(dataset)
            if source is None:
                spec = self.describe_dataset(dataset, spec_only=True).spec
                self._records_per_shard[dataset] = spec.records_per_shard
                source = open_source(spec.uri, spec.format, dict(spec.options))
                self._sources[dataset] = source
            return source

    # ------------------------------------------------------------------- worker
    def join(self) -> str:
        resp = self._call(self._stub.Join, pb.JoinRequest(name=self.name, worker_id=self.worker_id))
        self.worker_id = resp.worker_id
        self._left = False
        self.heartbeat_interval = resp.heartbeat_interval_seconds
        if self._want_heartbeat and self._hb_thread is None:
            self._hb_thread = threading.Thread(target=self._heartbeats, name="shard-heartbeat", daemon=True)
            self._hb_thread.start()
        return self.worker_id

    def leave(self) -> int:
        """Leave the job: queued acks are sent first, then every lease still held goes back.

        Returns how many leases went back. Raises :class:`AckFailedError` afterwards (the
        worker has left) if acks sent in the background were refused and not yet reported.
        """
        self._stop.set()
        self._left = True
        self._acks.wait()
        returned = self._call(self._stub.Leave, pb.LeaveRequest(worker_id=self.worker_id)).leases_returned
        self.worker_id = ""
        self._acks.raise_failures()
        return returned

    def _heartbeats(self) -> None:
        while not self._stop.wait(self.heartbeat_interval):
            with self._lock:
                progress = [
                    pb.ShardProgress(shard_id=s.shard_id, attempt=s.lease.attempt, position=s.position)
                    for s in self._held.values()
                ]
            try:
                resp = self._call(
                    self._stub.Heartbeat, pb.HeartbeatRequest(worker_id=self.worker_id, progress=progress)
                )
            except NotFoundError:  # declared dead (paused too long): every lease is gone; join afresh
                if self._stop.is_set():  # ...unless this client left meanwhile (leave() or close())
                    return
                with self._lock:
                    self._revoked.update((s.shard_id, s.lease.attempt) for s in self._held.values())
                    self._held.clear()
                self.worker_id = ""
                self.join()
                continue
            except ShardServiceError:
                continue
            with self._lock:
                self._revoked.update((r.shard_id, r.attempt) for r in resp.revoked)

    def lease(self, dataset: str, max_shards: int = 1, wait: float = 5.0) -> tuple[LeaseStatus, list[LeasedShard]]:
        """Lease up to ``max_shards``; returns (the lease status, leased shards).

        After :meth:`leave` (until :meth:`join` is called again) nothing is leased and the client does not
        join by itself: ``(WAIT, [])`` (a reader thread still running must not take shards back).
        """
        if self._left:
            return LeaseStatus.WAIT, []
        if not self.worker_id:
            self.join()
        with self._lock:
            self._request_id += 1
            request_id = self._request_id
        request = pb.LeaseRequest(
            worker_id=self.worker_id, dataset=dataset, max_shards=max_shards, request_id=request_id, wait_seconds=wait
        )
        try:
            resp = self._call(self._stub.LeaseShards, request)
        except NotFoundError as exc:
            if "worker" not in str(exc):
                raise
            if self._left:  # it left while this lease was on its way: nothing was leased
                return LeaseStatus.WAIT, []
            self.worker_id = ""
            self.join()
            return LeaseStatus.WAIT, []
        shards: list[LeasedShard] = []
        if resp.leases:
            self._adopt(dataset, resp.leases, shards)
        return convert.lease_status_from_pb(resp.status), shards

    def shards(self, dataset: str, wait: float = 5.0, prefetch: int = 2) -> Iterator[LeasedShard]:
        """Yield leased shards until the dataset ends (batch) or forever (stream).

        Shards are leased ahead, so one round trip serves several shards; the ones waiting
        their turn are kept alive by heartbeats like the rest. The first lease asks for
        ``prefetch`` (or, for small shards, about :data:`PREFETCH_RECORDS` records until
        :data:`RAMP_SHARDS` shards have shown the caller's pace); from then on the acks that
        finish shards bring the next leases back with them (no extra round trip), enough to
        keep ``prefetch`` shards waiting, or more when the caller gets through a shard
        quickly: about :data:`PREFETCH_SECONDS` of its work (the mean over the shards it
        took), at most :data:`MAX_PREFETCH` shards. Then queued acks (``async_acks``) gather
        into fewer batches while 2/3 of that is waiting.
        """
        queue = self._prefetched.setdefault(dataset, deque())
        base = max(prefetch, 1)
        self._lease_more[dataset] = self._prefetch_base[dataset] = base
        self._source(dataset)  # opened before the first lease: its spec says how big the shards are
        records = self._records_per_shard.get(dataset, 0)
        ramp = max(base, min(MAX_PREFETCH, math.ceil(PREFETCH_RECORDS / records))) if records else base
        self._lease_more[dataset] = ramp
        spent, taken = 0.0, 0  # seconds the caller spent on the shards it took (their mean sizes the prefetch)
        try:
            while True:
                if not queue:  # a queued ack that finishes a shard brings the next lease: wait for it first
                    self._acks.wait()
                if not queue:
                    status, leased = self.lease(dataset, self._lease_more.get(dataset, base), wait)
                    if status is LeaseStatus.END:
                        return
                    queue.extend(leased)
                while queue:
                    shard = queue.popleft()
                    t0 = time.monotonic()
                    yield shard
                    spent, taken = spent + time.monotonic() - t0, taken + 1
                    depth = math.ceil(PREFETCH_SECONDS * taken / spent) if spent > 0 else base
                    if taken < RAMP_SHARDS:  # the first shards pay the first reads: no pace yet to go by
                        depth = max(depth, ramp)
                    self._lease_more[dataset] = max(base, min(MAX_PREFETCH, depth))
        finally:
            self._lease_more.pop(dataset, None)
            self._prefetch_base.pop(dataset, None)

    def _readers_supplied(self) -> bool:
        """Whether every :meth:`shards` reader prefetching deeper than asked has 2/3 of its depth waiting.

        The ack sender may then let acks gather (it is called with the ack queue's lock held).
        """
        deep = False
        for dataset, target in list(self._lease_more.items()):
            if target <= self._prefetch_base.get(dataset, target):
                continue
            if len(self._prefetched.get(dataset, ())) * 3 < target * 2:
                return False
            deep = True
        return deep

    @overload
    def ack(
        self,
        lease: LeaseGrant,
        position: int,
        step: int | None = None,
        dead_letters: int = 0,
        lease_more: int = 0,
        *,
        wait: Literal[True],
    ) -> AckResult: ...

    @overload
    def ack(
        self,
        lease: LeaseGrant,
        position: int,
        step: int | None = None,
        dead_letters: int = 0,
        lease_more: int = 0,
        *,
        wait: bool | None = None,
    ) -> AckResult | None: ...

    def ack(
        self,
        lease: LeaseGrant,
        position: int,
        step: int | None = None,
        dead_letters: int = 0,
        lease_more: int = 0,
        *,
        wait: bool | None = None,
    ) -> AckResult | None:
        """Ack ``position`` of ``lease``; with ``lease_more``, a finished shard brings up to that many new leases.

        Queued (returns None) or synchronous (returns the answer) as :meth:`LeasedShard.ack`
        describes; a lease lost to an earlier queued ack raises that ack's error again.
        """
        return self._ack(lease, None, position, step, dead_letters, lease_more, wait)

    def _ack(
        self,
        lease: LeaseGrant,
        shard: LeasedShard | None,
        position: int,
        step: int | None,
        dead_letters: int,
        lease_more: int,
        wait: bool | None,
    ) -> AckResult | None:
        request = pb.AckRequest(
            lease_more=lease_more,
            dead_letters=dead_letters,
            worker_id=self.worker_id,
            shard_id=lease.shard_id,
            attempt=lease.attempt,
            position=position,
            has_step=step is not None,
            step=step or 0,
        )

        def answered(shard_done: bool) -> None:
            self._last_ack_answer = time.monotonic()
            if shard is not None:
                shard._answered(position, shard_done)

        def on_answer(resp: pb.AckResponse) -> None:
            answered(resp.shard_done)
            if resp.leases:
                self._adopt(lease.dataset, resp.leases, self._prefetched.setdefault(lease.dataset, deque()))

        if not (self.async_acks if wait is None else not wait):
            self._acks.wait()  # acks queued earlier go first
            self._raise_if_lost(lease)
            try:
                resp = self._call(self._stub.Ack, request)
            except ShardServiceError as exc:
                self._acks.note_lost(AckFailure(lease.shard_id, lease.attempt, position, step, exc))
                raise
            on_answer(resp)
            return AckResult(shard_done=resp.shard_done, duplicate=resp.duplicate)
        self._raise_if_lost(lease)
        if not lease.start <= position <= lease.end:  # the master's check, made now: its answer would come late
            raise InvalidArgumentError(
                f"ack of shard {lease.shard_id!r} at position {position} is outside the shard's range "
                f"[{lease.start}, {lease.end})"
            )
        self._acks.submit(request, lease.dataset, answered, progress=position < lease.end and lease_more == 0)
        return None

    def _send_acks(self, batch: list[QueuedAck]) -> list[bool | ShardServiceError]:
        """Send queued acks in one AckBatch (the ack sender thread); per ack, shard_done or its refusal.

        The batch asks for leases when one of its acks finishes a shard and asked for more
        (``lease_more``): for a dataset :meth:`shards` reads, enough to refill its prefetch
        queue as it is now; otherwise the ack's own ``lease_more``.
        """
        dataset, more, asker = "", 0, -1
        for i, item in enumerate(batch):
            if item.request.lease_more > 0:
                dataset, asker = item.dataset, i
                break
        if asker >= 0:
            target = self._lease_more.get(dataset, 0)
            if target:
                more = max(0, target - len(self._prefetched.get(dataset, ())))
            else:
                more = max(b.request.lease_more for b in batch if b.dataset == dataset)
        with self._lock:
            self._request_id += 1
            request_id = self._request_id
        request = pb.AckBatchRequest(
            worker_id=self.worker_id,
            acks=[item.request for item in batch],
            lease_dataset=dataset if more else "",
            lease_more=more,
            request_id=request_id,
        )
        resp = self._call(self._stub.AckBatch, request)
        outcomes: list[bool | ShardServiceError] = []
        for r in resp.results:
            if r.error_code:
                error = _ERRORS_BY_NAME.get(r.error_code, ShardServiceError)
                outcomes.append(error(f"{r.error} [{r.error_code} from {self.address}]"))
            else:
                outcomes.append(r.shard_done)
        if resp.leases:
            try:
                self._adopt(dataset, resp.leases, self._prefetched.setdefault(dataset, deque()))
            except Exception as exc:  # e.g. opening the source: the asking ack's failure, as a lone Ack's was
                if asker < len(outcomes) and not isinstance(outcomes[asker], ShardServiceError):
                    batch[asker].on_answer(bool(outcomes[asker]))
                    outcomes[asker] = ShardServiceError(
                        f"the ack was recorded but handling its answer failed: {exc!r}"
                    )
        return outcomes

    def _raise_if_lost(self, lease: LeaseGrant) -> None:
        failure = self._acks.lost(lease.shard_id, lease.attempt)
        if failure is not None:
            error = failure.error
            raise type(error)(f"{error} (refused when sent from the ack queue)")

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every ack queued so far is answered; raise :class:`AckFailedError` for refused ones.

        Each refused ack is reported once: by this, by the next ack of its lease, or by
        :meth:`take_ack_failures`. Raises TimeoutError if acks are still unanswered after
        ``timeout`` seconds (each ack's RPC is retried for up to the client's ``timeout``).
        """
        self._acks.wait(timeout)
        self._acks.raise_failures()

    def take_ack_failures(self) -> list[AckFailure]:
        """Refused acks not yet reported, oldest first, without waiting or raising; they count as reported."""
        return self._acks.take_failures()

    @property
    def acks_pending(self) -> int:
        """Acks queued or in flight, not yet answered by the master."""
        return self._acks.pending

    @property
    def acks_in_flight(self) -> int:
        """Acks sent to the master and not yet answered (the rest of :attr:`acks_pending` is still queued)."""
        return self._acks.in_flight

    @property
    def last_ack_answered(self) -> float:
        """``time.monotonic()`` when the master last recorded an ack of this client (0.0 before the first)."""
        return self._last_ack_answer

    def _leases_wanted(self, dataset: str) -> int:
        """How many leases a finishing ack of ``dataset`` asks for: one, or a refill of a queue that ran dry."""
        target = self._lease_more.get(dataset, 0)
        if target == 0:
            return 0
        return max(1, target - len(self._prefetched.get(dataset, ())))

    def _adopt(self, dataset: str, leases: Any, into: deque[LeasedShard] | list[LeasedShard]) -> None:
        source = self._source(dataset)
        with self._lock:
            for msg in leases:
                shard = LeasedShard(self, convert.lease_from_pb(msg), source)
                self._held[shard.shard_id] = shard
                into.append(shard)

    # ------------------------------------------------------------------- cursor
    def prepare_cut(self, step: int | None = None, *, persisting: bool = False) -> tuple[int, DataCursor]:
        """Take a cut of everything acked (with step <= ``step`` when given); returns (cut id, its cursor).

        Idempotent per ``step``: every rank of one checkpoint gets the same cut. ``persisting``: the
        checkpoint of this cut will be persisted, so the cut is kept until it commits, however long that takes.

        This client's queued acks are flushed first (:meth:`flush`), so the cut holds every ack
        this client made before the call; a refused one raises :class:`AckFailedError` and no
        cut is taken. Acks queued in *other* clients (other ranks) are theirs to flush first.
        """
        self.flush()
        request = pb.CutPrepareRequest(has_step=step is not None, step=step or 0, persisting=persisting)
        resp = self._call(self._stub.CutPrepare, request)
        return resp.cut_id, convert.cursor_from_pb(resp.cursor)

    def commit_cut(self, cut_id: int) -> DataCursor:
        """Commit a prepared cut (its manifest is durable). Does not wait for queued acks: the cut is fixed."""
        resp = self._call(self._stub.CutCommit, pb.CutCommitRequest(cut_id=cut_id))
        return convert.cursor_from_pb(resp.committed)

    def get_cursor(self) -> tuple[DataCursor, DataCursor]:
        """(committed cursor, committed plus acked cursor), after this client's queued acks (see :meth:`flush`)."""
        self.flush()
        resp = self._call(self._stub.GetCursor, pb.GetCursorRequest())
        return convert.cursor_from_pb(resp.committed), convert.cursor_from_pb(resp.acked)

    def restore_cursor(
        self, cursor: DataCursor, *, from_memory: bool = False, discard_committed: bool = False
    ) -> pb.RestoreResponse:
        """Reset the service to ``cursor``; every lease (this client's too) is revoked.

        ``from_memory``: the cursor is of a shared-memory snapshot that storage does not hold, so offsets
        committed upstream stay at the newest durable checkpoint's. An empty ``cursor`` while the service
        has committed progress is refused (``FailedPreconditionError``) unless ``discard_committed``:
        that throws away every committed cut, and every record is read again.

        Acks still queued in this client are dropped, and unreported ack failures forgotten:
        they concern leases the restore revokes (an ack already in flight is answered first).
        """
        self._acks.discard()
        request = pb.RestoreRequest(
            cursor=convert.cursor_to_pb(cursor), from_memory=from_memory, discard_committed=discard_committed
        )
        resp = self._call(self._stub.Restore, request)
        self._forget_leases()
        return resp

    def restore_cut(self, cut_id: int) -> pb.RestoreResponse:
        """Reset the service to a cut it remembers; queued acks are dropped as in :meth:`restore_cursor`."""
        self._acks.discard()
        resp = self._call(self._stub.Restore, pb.RestoreRequest(cut_id=cut_id))
        self._forget_leases()
        return resp

    def _forget_leases(self) -> None:
        """A restore revoked every lease: drop the held and prefetched ones so none is read again."""
        with self._lock:
            self._revoked.update((s.shard_id, s.lease.attempt) for s in self._held.values())
            self._held.clear()
            for queue in self._prefetched.values():
                queue.clear()

    # ---------------------------------------------------------------- key-value
    def kv_get(self, key: str) -> tuple[bytes, int] | None:
        """(value, version) of ``key``, or None when it was never set."""
        resp = self._call(self._stub.KvGet, pb.KvGetRequest(key=key))
        return (resp.value, resp.version) if resp.found else None

    def kv_set(self, key: str, value: bytes, expected_version: int) -> tuple[bool, bytes, int]:
        """Compare-and-set; returns (written, current value, current version)."""
        resp = self._call(self._stub.KvSet, pb.KvSetRequest(key=key, value=value, expected_version=expected_version))
        return resp.ok, resp.value, resp.version

    def kv_delete(self, key: str, expected_version: int) -> tuple[bool, bytes, int]:
        """Compare-and-delete; returns (deleted, current value, current version) — (True, b"", 0) once gone."""
        request = pb.KvSetRequest(key=key, expected_version=expected_version, delete=True)
        resp = self._call(self._stub.KvSet, request)
        return resp.ok, resp.value, resp.version
