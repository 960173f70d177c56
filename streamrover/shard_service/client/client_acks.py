"""The worker client's ack queue: acks leave the read path, a background thread sends them in order.

With ``async_acks=True`` (or ``ack(..., wait=False)``),
:class:`~streamrover.shard_service.client.ShardClient` queues an ack and returns at
once; one sender thread sends the queued acks to the master one after another, in
the order they were queued, and hands each answer back (a finished shard's answer
may carry the next leases). The semantics, which the client's docstrings repeat:

* **Batches.** The sender sends every ack queued while the previous batch was in
  flight (up to :data:`MAX_BATCH`) in one ``AckBatch`` round trip. The master applies
  them in queue order, each exactly as a lone ``Ack`` (fenced by its own attempt; a
  refused ack does not stop the acks after it), commits them to its journal in one
  transaction before answering, and answers per ack; each refusal becomes that ack's
  :class:`AckFailure` below. The batch also asks for the leases the reader wants next.
  While the client says holding is harmless (``may_hold``: its :meth:`shards` readers
  have enough leases waiting), the sender lets acks gather for up to :data:`ACK_LINGER`
  seconds, so that small shards cost one round trip per batch, not per shard. Acks that
  end inside their shard and ask for no lease (progress acks: a trainer acking every
  step) wait up to :data:`PROGRESS_LINGER` seconds while nothing but such acks is
  queued: a batch reader acking every batch sends a fraction of the round trips, and
  the shard-finishing ack, which may bring leases, goes at once. Anything that waits
  for acks (``flush`` and the rest below) sends at once.
* **Order.** Acks are sent in the order they were queued (one sender, FIFO). An ack
  queued right behind another ack of the same lease and the same step replaces it
  (the later position covers the earlier one; their dead-letter counts add up);
  acks with different steps are never merged, so a cut at step S still sees exactly
  the records acked with steps <= S.
* **What waits for them.** Whatever depends on acks being recorded first waits until
  every ack queued before it is answered: ``flush()``, ``prepare_cut()``,
  ``get_cursor()``, ``leave()``, and a synchronous ``ack(..., wait=True)``. Only this
  client's queue: when another process takes the cut (rank 0 for all ranks, a PS
  coordinator), every acking process must ``flush()`` before the barrier that lets it.
* **Failures never vanish.** A refused ack (a stale attempt or revoked lease:
  FAILED_PRECONDITION; an unknown shard or worker: NOT_FOUND; anything else) is kept
  as an :class:`AckFailure` until it is reported, once, by the next of: ``flush()``
  and the calls that flush (they raise :class:`AckFailedError`), the next ``ack`` of
  the same lease (it raises the lease's own error, as a synchronous ack would have),
  or :meth:`AckQueue.take_failures` (returns them without raising). A lease refused
  with FAILED_PRECONDITION or NOT_FOUND is lost for good: every later ack of it raises.
* **A worker killed with acks queued** loses them. The master re-leases those shards
  from the last *recorded* ack, so their records are read again: a model restarts from
  its last checkpoint, whose cut holds only recorded acks (``prepare_cut`` flushes);
  a sink that fences its writes by position (the ledger) finds itself ahead of the
  lease and acks its own position instead of writing again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from streamrover.shard_service.api import AckFailedError, AckFailure, ShardServiceError
from streamrover.shard_service.v1 import shard_service_pb2 as pb

log = logging.getLogger(__name__)
MAX_QUEUED_ACKS = 256  # ack() blocks beyond this many unsent acks (a sender far behind is back-pressure, not memory)
MAX_BATCH = 256  # acks per AckBatch round trip
# seconds the sender may let acks gather while may_hold() says the readers have work (or can get no more):
# holding stops as soon as a reader's queue falls under ~12 ms of its work (pacing.PrefetchPace.supplied), so this
# bounds only how late an ack is recorded, not a reader's wait
ACK_LINGER = 0.05
# seconds the sender may let acks gather while every queued ack is progress inside its shard (nothing waits on it)
PROGRESS_LINGER = 0.05
LeaseKey = tuple[str, int]  # (shard id, attempt)


@dataclass
class QueuedAck:
    """An ack waiting in the queue (or in flight); ``on_answer(shard_done)`` runs when the master recorded it."""

    request: pb.AckRequest
    dataset: str
    seq: int
    on_answer: Callable[[bool], None]
    queued_at: float = 0.0
    progress: bool = False  # ends before its shard's end and asks for no lease: nobody waits on its answer

    @property
    def key(self) -> tuple[str, str, int, bool, int]:
        """What two acks in a row must share for the later to merge into the earlier: worker, shard, attempt, step."""
        r = self.request
        return r.worker_id, r.shard_id, r.attempt, r.has_step, r.step


# Sends a batch of queued acks; returns, per ack and in order, shard_done or the error that refused it.
SendBatch = Callable[[list[QueuedAck]], list["bool | ShardServiceError"]]


class AckQueue:
    """Queued acks and the thread that sends them; see the module docstring for the semantics."""

    def __init__(
        self,
        send: SendBatch,
        max_queued: int = MAX_QUEUED_ACKS,
        max_batch: int = MAX_BATCH,
        may_hold: Callable[[], bool] | None = None,
        linger: float = ACK_LINGER,
        progress_linger: float = PROGRESS_LINGER,
    ) -> None:
        self._send = send
        self._max = max_queued
        self._max_batch = max(max_batch, 1)
        self._may_hold = may_hold
        self._linger = linger
        self._progress_linger = progress_linger
        self._waiters = 0  # threads in wait(): acks are sent at once while any waits
        self._cond = threading.Condition()
        self._queue: deque[QueuedAck] = deque()
        self._queued_seq = 0  # the last sequence number handed out
        self._answered_seq = 0  # every ack up to this one is answered (or failed, or discarded)
        self._in_flight: list[QueuedAck] = []
        self._unreported: dict[LeaseKey, AckFailure] = {}
        self._lost: dict[LeaseKey, AckFailure] = {}
        self._thread: threading.Thread | None = None
        self._closing = False

    @property
    def pending(self) -> int:
        """Acks queued or in flight, not yet answered."""
        with self._cond:
            return len(self._queue) + len(self._in_flight)

    @property
    def in_flight(self) -> int:
        """Acks sent to the master whose answer has not arrived yet."""
        with self._cond:
            return len(self._in_flight)

    # ----------------------------------------------------------------- producers
    def submit(
        self, request: pb.AckRequest, dataset: str, on_answer: Callable[[bool], None], progress: bool = False
    ) -> None:
        """Queue ``request`` (an ack of a lease of ``dataset``); ``on_answer(shard_done)`` runs in the sender thread.

        ``progress``: the ack ends inside its shard and asks for no lease, so nothing waits on its answer.
        """
        with self._cond:
            if self._closing:
                raise RuntimeError("the client is closed: no more acks")
            self._queued_seq += 1
            item = QueuedAck(request, dataset, self._queued_seq, on_answer, time.monotonic(), progress)
            tail = self._queue[-1] if self._queue else None
            if tail is not None and tail.key == item.key and request.position >= tail.request.position:
                tail.request.position = request.position  # same lease, same step: the later position covers it
                tail.request.dead_letters += request.dead_letters
                tail.request.lease_more = max(tail.request.lease_more, request.lease_more)
                tail.seq = item.seq
                tail.on_answer = on_answer
                tail.progress = progress and tail.request.lease_more == 0
                return
            while len(self._queue) >= self._max and not self._closing:
                self._cond.wait()
            self._queue.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="shard-acks", daemon=True)
                self._thread.start()
            if len(self._queue) == 1 or not self._holding():  # the sender starts its linger or sends now
                self._cond.notify_all()

    def _holding(self) -> bool:
        """Whether the sender may let the queued acks gather (called with the lock held)."""
        if self._waiters or len(self._queue) >= self._max_batch:
            return False
        return self._progress_only() or (self._may_hold is not None and self._may_hold())

    def _progress_only(self) -> bool:
        return all(item.progress for item in self._queue)

    def _linger_for(self) -> float:
        """How long the oldest queued ack may wait for company (called with the lock held)."""
        return max(self._linger, self._progress_linger) if self._progress_only() else self._linger

    def wait(self, timeout: float | None = None) -> None:
        """Until every ack queued so far is answered. Raises TimeoutError after ``timeout`` seconds."""
        if self._answered_seq >= self._queued_seq:  # nothing queued is unanswered (ints read whole: no lock needed)
            return
        give_up = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            target = self._queued_seq
            if self._answered_seq >= target:
                return
            self._waiters += 1
            self._cond.notify_all()  # a lingering sender sends now
            try:
                while self._answered_seq < target:
                    remaining = None if give_up is None else give_up - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(f"{target - self._answered_seq} ack(s) still unanswered after {timeout}s")
                    self._cond.wait(remaining)
            finally:
                self._waiters -= 1

    # ------------------------------------------------------------------ failures
    def lost(self, shard_id: str, attempt: int) -> AckFailure | None:
        """The failure that lost this lease, if any; it counts as reported from now on."""
        if not self._lost:  # no lease lost (the common case): no lock
            return None
        with self._cond:
            failure = self._lost.get((shard_id, attempt))
            if failure is not None:
                self._unreported.pop((shard_id, attempt), None)
            return failure

    def note_lost(self, failure: AckFailure) -> None:
        """A synchronous ack was refused (the caller got the error): later acks of the lease raise it too."""
        if failure.lease_lost:
            with self._cond:
                self._lost.setdefault((failure.shard_id, failure.attempt), failure)

    def take_failures(self) -> list[AckFailure]:
        """Failures not yet reported, oldest first; they count as reported."""
        with self._cond:
            failures = list(self._unreported.values())
            self._unreported.clear()
            return failures

    def raise_failures(self) -> None:
        """Raise :class:`AckFailedError` with the refused acks not yet reported, if any."""
        failures = self.take_failures()
        if failures:
            raise AckFailedError(failures)

    # ------------------------------------------------------------------ lifecycle
    def discard(self) -> int:
        """Drop the queued acks and every failure, after the ack in flight is answered; returns how many dropped.

        For a restore: it revokes every lease, so these acks would be refused and their failures are moot.
        """
        with self._cond:
            dropped = len(self._queue)
            self._queue.clear()
            while self._in_flight:
                self._cond.wait()
            self._answered_seq = self._queued_seq
            self._unreported.clear()
            self._lost.clear()
            self._cond.notify_all()
            return dropped

    def close(self, timeout: float) -> None:
        """Send what is queued (up to ``timeout`` seconds), then stop the sender. Unreported failures are logged."""
        try:
            self.wait(timeout)
        except TimeoutError as exc:
            log.warning("closing with acks unsent (%s): their shards will be read again", exc)
        with self._cond:
            self._closing = True
            self._queue.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=1)  # an ack stuck in flight ends when the client closes its channel
        for failure in self.take_failures():
            log.warning("closing with an unreported ack failure: %s", failure)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closing:
                    if not self._queue:
                        self._cond.wait()
                        continue
                    linger = self._queue[0].queued_at + self._linger_for() - time.monotonic()
                    if linger <= 0 or not self._holding():
                        break
                    self._cond.wait(linger)
                if self._closing:
                    return
                n = min(len(self._queue), self._max_batch)
                batch = self._in_flight = [self._queue.popleft() for _ in range(n)]
                self._cond.notify_all()  # a producer blocked on a full queue may go on
            try:
                outcomes = self._send(batch)
                if len(outcomes) != len(batch):
                    raise ShardServiceError(f"the master answered {len(outcomes)} of {len(batch)} acks")
            except Exception as exc:  # _call maps RPC errors to ShardServiceError; anything else is kept too
                error = exc if isinstance(exc, ShardServiceError) else ShardServiceError(repr(exc))
                outcomes = [error] * len(batch)
            failures: list[AckFailure] = []
            for item, outcome in zip(batch, outcomes):
                if not isinstance(outcome, ShardServiceError):
                    try:
                        item.on_answer(outcome)
                        continue
                    except Exception as exc:  # none may vanish
                        outcome = ShardServiceError(f"the ack was recorded but handling its answer failed: {exc!r}")
                r = item.request
                failures.append(AckFailure(r.shard_id, r.attempt, r.position, r.step if r.has_step else None, outcome))
            with self._cond:
                for failure in failures:  # in queue order: a lease's first failure is the one reported
                    key = (failure.shard_id, failure.attempt)
                    if key not in self._lost:  # the first failure of a lost lease says it all
                        self._unreported.setdefault(key, failure)
                    if failure.lease_lost:
                        self._lost.setdefault(key, failure)
                self._in_flight = []
                self._answered_seq = max(self._answered_seq, batch[-1].seq)
                self._cond.notify_all()
