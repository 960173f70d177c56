"""The worker-side client of the shard service: lease, read, ack, heartbeat, cut.

``ShardClient`` is framework-neutral; trainers wrap it. A typical worker::

    with ShardClient("127.0.0.1:7070", token=token, async_acks=True) as client:
        for shard in client.shards("clicks"):
            for batch in shard.batches():
                apply(batch.records)
                shard.ack(batch.end)      # queued: returns at once
        client.flush()                    # every ack recorded; raises AckFailedError if any was refused

By default ``ack()`` waits for the master's answer. With ``async_acks=True`` (or
``ack(..., wait=False)``) ``ack()`` queues the ack and returns; a sender thread sends the
queued acks in order, in ``AckBatch`` round trips. Everything that depends on acks being
recorded waits for them first (``flush()``, ``prepare_cut()``, ``get_cursor()``, ``leave()``,
``ack(..., wait=True)``), and a refused ack is never dropped; when another process takes the
cut, each acking process must ``flush()`` before the barrier. The full semantics are in
:mod:`streamrover.shard_service.client.client_acks`.

Leases, acks and heartbeats go as messages on one worker session stream (:mod:`.transport`); joining,
the heartbeats and leaving are :mod:`.membership`'s, the cut and cursor calls :mod:`.cursor_client`'s.
Calls survive a master restart: they are retried through ``UNAVAILABLE`` for up to ``timeout``
seconds (safe: acks are idempotent per attempt, lease requests carry a request id).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any, Literal, overload

from streamrover.shard_service import convert
from streamrover.shard_service.api import (
    AckResult,
    DataLostError,
    FailedPreconditionError,
    InvalidArgumentError,
    LeaseGrant,
    LeaseStatus,
    NotFoundError,
    ShardServiceError,
)
from streamrover.shard_service.client.client_acks import AckFailure, AckQueue, QueuedAck
from streamrover.shard_service.client.lease_table import LeaseTable
from streamrover.shard_service.client.leased import LeasedShard
from streamrover.shard_service.client.membership import MemberClient
from streamrover.shard_service.client.pacing import Pacing, PrefetchPace
from streamrover.shard_service.client.tls import ClientTls
from streamrover.shard_service.v1 import shard_service_pb2 as pb
from streamrover.sources.api import Source, open_source

log = logging.getLogger(__name__)
CLOSE_ACK_WAIT = 10.0  # seconds close() waits for queued acks (a master restarting comes back within this)


class ShardClient(MemberClient):
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
        session: bool = True,
        tls: ClientTls | bool | None = True,
    ) -> None:
        """Connect to the master at ``address`` (default ``$STREAMROVER_MASTER``) with ``token``.

        ``async_acks``: when True, acks are queued and sent by a background thread in order
        (see the module docstring: who flushes them before a cut); when False (the default)
        every ack waits for the master's answer. ``ack(..., wait=...)`` overrides it per call.
        ``session``: leases, acks and heartbeats go as messages on one worker session stream
        (:mod:`.transport`; answered exactly as the unary calls); False: one unary call each. ``tls``: as
        :class:`AdminClient`'s (default: from ``$STREAMROVER_TLS_CA``...).
        """
        super().__init__(address, token, name, timeout=timeout, session=session, tls=tls)
        self.worker_id = ""
        self.heartbeat_interval = 1.0
        self._want_heartbeat = heartbeat
        self._hb_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._left = False  # leave() was called (and join() not since): lease() must not join again
        self._source_lock = threading.Lock()
        self._request_ids = itertools.count(1)  # per worker, increasing (next() is atomic: the threads share it)
        self._sources: dict[str, Source] = {}
        self._records_per_shard: dict[str, int] = {}  # per dataset whose source is open: as registered (0: default)
        self.leases = LeaseTable()
        self.pacing = Pacing(self.leases)
        self.async_acks = async_acks
        self._acks = AckQueue(self._send_acks, may_hold=self.pacing.readers_supplied)
        self._last_ack_answer = 0.0

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
        super().close()

    def __enter__(self) -> ShardClient:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.worker_id and exc[0] is None:
                self.leave()
        finally:
            self.close()

    def _source(self, dataset: str, info: pb.DatasetInfo | None = None) -> Source:
        """The open source of ``dataset``: opened once, from ``info`` (a first lease's answer) or a describe."""
        source = self._sources.get(dataset)  # opened once: then read without the lock
        if source is not None:
            return source
        with self._source_lock:  # the ack sender adopts leases too
            source = self._sources.get(dataset)
            if source is None:
                spec = (info if info is not None else self.describe_dataset(dataset, spec_only=True)).spec
                self._records_per_shard[dataset] = spec.records_per_shard
                source = open_source(spec.uri, spec.format, dict(spec.options))
                self._sources[dataset] = source
            return source

    # ------------------------------------------------------------------- worker
    def report_unreadable(self, lease: LeaseGrant, position: int, error: Exception) -> bool:
        """Say ``lease``'s data could not be read from ``position`` (ReportUnreadable: the master checks it).

        Raises :class:`DataLostError` when the master cannot read it either and failed the dataset (the default,
        ``sr.on_data_loss=fail``); True when the loss was accounted (``skip``: the lease is gone), False when
        the master reads the data (this worker's access is broken: the caller's error stands). Never silent:
        the master logs it too.
        """
        request = pb.ReportUnreadableRequest(
            worker_id=self.worker_id, shard_id=lease.shard_id, attempt=lease.attempt, position=position,
            error=f"{type(error).__name__}: {error}"[:4000],
        )  # fmt: skip
        try:
            answer = self._call(self._stub.ReportUnreadable, request)
        except FailedPreconditionError as exc:  # the master reads it: this worker's access is broken
            log.error("%s", exc)
            return False
        except NotFoundError:  # the shard is gone (dropped as lost by an earlier report, or its dataset removed)
            return True
        if answer.failed:
            raise DataLostError(f"dataset {lease.dataset!r} failed: {answer.reason}") from error
        log.error("dataset %s: %s (%d records accounted as lost)", lease.dataset, answer.reason, answer.lost_records)
        return True

    def lease(self, dataset: str, max_shards: int = 1, wait: float = 5.0) -> tuple[LeaseStatus, list[LeasedShard]]:
        """Lease up to ``max_shards``; returns (the lease status, leased shards).

        When nothing can be leased now, waits up to ``wait`` seconds for a shard (a long poll).
        After :meth:`leave` (until :meth:`join` is called again) nothing is leased and the client does not
        join by itself: ``(WAIT, [])`` (a reader thread still running must not take shards back).
        """
        merge = self.pacing.merge_records(dataset)
        return self._lease(pb.LeaseRequest(dataset=dataset, max_shards=max_shards, merge_records=merge), wait)

    def _first_lease(self, dataset: str, pace: PrefetchPace, wait: float) -> tuple[LeaseStatus, list[LeasedShard]]:
        """A reader's first lease, before it knows the dataset: one round trip brings the spec and the first shards
        (sized in records: :meth:`PrefetchPace.first_lease`)."""
        outcome = self._lease(pace.first_lease(dataset), wait, pace)
        if dataset not in self._sources:  # no spec in the answer (a worker that joined again, an older master)
            self._source(dataset)
            pace.sized(self._records_per_shard.get(dataset, 0))
        return outcome

    def _lease(
        self, request: pb.LeaseRequest, wait: float, pace: PrefetchPace | None = None
    ) -> tuple[LeaseStatus, list[LeasedShard]]:
        """:meth:`lease` of ``request`` (its worker and request id filled in here)."""
        if self._left:
            return LeaseStatus.WAIT, []
        if not self.worker_id:
            self.join()
        request.worker_id, request.request_id, dataset = self.worker_id, next(self._request_ids), request.dataset
        try:
            resp = self._transport.worker_call("lease", self._stub.LeaseShards, request)  # never waits on the stream
            if resp.status == pb.LEASE_STATUS_WAIT and wait > 0:
                request.request_id, request.wait_seconds = next(self._request_ids), wait
                resp = self._call(self._stub.LeaseShards, request)
        except NotFoundError as exc:
            if not str(exc).startswith("worker "):  # (not a dataset named "...worker...")
                raise
            if self._left:  # it left while this lease was on its way: nothing was leased
                return LeaseStatus.WAIT, []
            self.worker_id = ""
            self.join()
            return LeaseStatus.WAIT, []
        shards: list[LeasedShard] = []
        if resp.HasField("dataset"):  # a first lease: the spec came with it
            self._source(dataset, resp.dataset)
            if pace is not None:
                pace.sized(self._records_per_shard.get(dataset, 0))
        asked = request.max_shards if pace is None else pace.target
        self.pacing.granted(dataset, asked, self.pacing.units_of(resp.leases), resp.todo)
        if resp.leases:
            self._adopt(dataset, resp.leases, shards)
        return convert.lease_status_from_pb(resp.status), shards

    def shards(self, dataset: str, wait: float = 5.0, prefetch: int = 2) -> Iterator[LeasedShard]:
        """Yield leased shards until the dataset ends (batch) or forever (stream).

        Shards are leased ahead, so one round trip serves several shards; the ones waiting
        their turn are kept alive by heartbeats like the rest. The first lease of a dataset this
        client has not opened yet brings the dataset's spec with it (one round trip, no describe
        first) and asks for about 256 Ki records of shards; the depth is then ``prefetch`` or more
        (:class:`~streamrover.shard_service.client.pacing.PrefetchPace`: about 20 ms of the caller's work by
        its measured pace, at least 8 shards of up to 100 ms in all); from then on the acks that
        finish shards bring the next leases back with them (no extra round trip), enough to keep
        that many waiting. Then queued acks (``async_acks``) gather into fewer batches while ~12 ms
        of work is waiting. The leases ask the master to merge runs of small shards
        (:mod:`~streamrover.shard_service.master.merging`: about 10 ms of the caller's work per lease once
        its pace is known), so a lease and its ack serve several planned shards.
        """
        queue = self.leases.waiting(dataset)
        first = dataset not in self._sources  # then the first lease brings the spec (the shards' size) with it
        pace = self.pacing.start(dataset, prefetch, self._records_per_shard.get(dataset, 0))
        try:
            while True:
                if not queue:  # a queued ack that finishes a shard brings the next lease: wait for it first
                    self._acks.wait()
                if not queue:
                    if first:
                        first = False
                        status, leased = self._first_lease(dataset, pace, wait)
                    else:
                        status, leased = self.lease(dataset, pace.target, wait)
                    if status is LeaseStatus.END:
                        return
                    queue.extend(leased)
                while queue:
                    shard = queue.popleft()
                    t0 = time.monotonic()
                    yield shard
                    pace.took(time.monotonic() - t0, shard.lease.shards)
        finally:
            self.pacing.stop(dataset)

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
        return self.send_ack(lease, None, position, step, dead_letters, lease_more, wait)

    def send_ack(
        self,
        lease: LeaseGrant,
        shard: LeasedShard | None,
        position: int,
        step: int | None,
        dead_letters: int,
        lease_more: int,
        wait: bool | None,
    ) -> AckResult | None:
        """:meth:`ack`, telling ``shard`` (:meth:`LeasedShard.answered`) when the master recorded it.

        Without ``shard`` (an ack through :meth:`ack`), the lease object this client made for ``lease`` is
        told, so a finished shard leaves the lease table (and the heartbeats) whichever way it was acked.
        """
        if shard is None:
            shard = self.leases.live(lease.shard_id, lease.attempt)
        request = pb.AckRequest(
            lease_more=lease_more,
            merge_records=self.pacing.merge_records(lease.dataset) if lease_more else 0,
            dead_letters=dead_letters,
            worker_id=self.worker_id,
            shard_id=lease.shard_id,
            attempt=lease.attempt,
            position=position,
            has_step=step is not None,
            step=step or 0,
        )

        if not (self.async_acks if wait is None else not wait):
            self._acks.wait()  # acks queued earlier go first
            self._raise_if_lost(lease)
            try:
                resp = self._transport.worker_call("ack", self._stub.Ack, request)
            except ShardServiceError as exc:
                self._acks.note_lost(AckFailure(lease.shard_id, lease.attempt, position, step, exc))
                raise
            self._last_ack_answer = time.monotonic()
            if shard is not None:
                shard.answered(position, resp.shard_done)
            if resp.leases:
                self._adopt(lease.dataset, resp.leases, self.leases.waiting(lease.dataset))
            return AckResult(shard_done=resp.shard_done, duplicate=resp.duplicate)

        def answered(shard_done: bool) -> None:
            self._last_ack_answer = time.monotonic()
            if shard is not None:
                shard.answered(position, shard_done)

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
            asked = max(b.request.lease_more for b in batch if b.dataset == dataset)
            more = self.pacing.refill(dataset, asked)
        request = pb.AckBatchRequest(
            worker_id=self.worker_id,
            acks=[item.request for item in batch],
            lease_dataset=dataset if more else "",
            lease_more=more,
            request_id=next(self._request_ids),
            merge_records=self.pacing.merge_records(dataset) if more else 0,
        )
        resp = self._transport.worker_call("ack_batch", self._stub.AckBatch, request)
        self.pacing.granted(dataset, more, self.pacing.units_of(resp.leases), resp.todo)
        outcomes: list[bool | ShardServiceError] = [
            self._transport.error(r.error_code, r.error) if r.error_code else r.shard_done for r in resp.results
        ]
        if resp.leases:
            try:
                self._adopt(dataset, resp.leases, self.leases.waiting(dataset))
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

    def _adopt(self, dataset: str, leases: Any, into: Any) -> None:
        """New leases of ``dataset`` (protobuf): held from now on, appended to ``into``."""
        source = self._source(dataset)
        self.leases.add([LeasedShard(self, convert.lease_from_pb(msg), source) for msg in leases], into)
