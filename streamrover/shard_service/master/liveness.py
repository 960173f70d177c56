"""Worker liveness in the shard core: workers join, beat and leave; leases and workers whose deadline passed expire.

``Liveness`` is the part of :class:`~.core.ShardCore` that owns the two expiry queues (``deadlines.py``: lower
bounds of every lease's deadline and every worker's heartbeat deadline), so that expiry looks only at what may
have expired. Lease deadlines and worker liveness are not journalled: a restarted master gives every lease and
worker one fresh TTL.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from streamrover.shard_service.api import DEFAULT_LEASE_TTL, NotFoundError, ShardState
from streamrover.shard_service.master.bookkeeping import ShardRecord, WorkerRecord
from streamrover.shard_service.master.deadlines import DeadlineQueue
from streamrover.shard_service.master.journal import Journal
from streamrover.shard_service.master.staged import StagedCommits
from streamrover.shard_service.master.state import CoreState


class Liveness(CoreState):
    """Workers (join, heartbeat, leave) and the expiry of leases and workers, over the shard table."""

    staged: StagedCommits  # (the core's: its commit gaps expire with the rest)

    def __init__(self, journal: Journal, lease_ttl: float = DEFAULT_LEASE_TTL, clock: Callable[[], float] = time.time):
        super().__init__(journal, lease_ttl, clock)
        self.lease_due: DeadlineQueue[str] = DeadlineQueue(self._lease_deadline)
        self.worker_due: DeadlineQueue[str] = DeadlineQueue(self._worker_deadline)
        for w in self.workers.values():
            self.worker_due.track(w.id, w.last_seen + self.lease_ttl)
        for sid in self.leased:
            self.lease_due.track(sid, self.shards[sid].deadline)

    def _lease_deadline(self, sid: str) -> float | None:
        s = self.shards.get(sid)
        return s.deadline if s is not None and s.state is ShardState.LEASED else None

    def _worker_deadline(self, worker_id: str) -> float | None:
        w = self.workers.get(worker_id)
        return None if w is None else w.last_seen + self.lease_ttl

    # ------------------------------------------------------------------ workers
    def join(self, name: str, worker_id: str = "") -> WorkerRecord:
        """Register worker ``worker_id`` (a new id when empty) named ``name``, or refresh it; returns its record."""
        worker_id = worker_id or f"w-{uuid.uuid4().hex[:12]}"
        w = self.workers.get(worker_id)
        if w is None:
            w = WorkerRecord(worker_id, name)
            self.workers[worker_id] = w
            self.events["joins"] += 1
            with self.journal.transaction():
                self.journal.put_worker(w)
        w.last_seen = self.clock()
        self.worker_due.track(worker_id, w.last_seen + self.lease_ttl)
        return w

    def worker(self, worker_id: str) -> WorkerRecord:
        """The record of a live worker; :class:`NotFoundError` (join again) when it left or was declared dead."""
        w = self.workers.get(worker_id)
        if w is None:
            raise NotFoundError(
                f"worker {worker_id!r} is unknown: it left, or missed heartbeats for {self.lease_ttl:.1f}s "
                "and was declared dead; join again"
            )
        return w

    def leave(self, worker_id: str) -> int:
        """Remove a worker and return every lease it holds to the queue (front first); returns how many."""
        w = self.worker(worker_id)
        with self.journal.transaction():
            returned = self._drop_worker(w)
        return returned

    def _drop_worker(self, w: WorkerRecord) -> int:
        returned = 0
        for sid in sorted(w.leases):
            self._return_lease(self.shards[sid])
            returned += 1
        del self.workers[w.id]
        for key in [k for k in self.tails if k[0] == w.id]:
            del self.tails[key]
        self.journal.delete_worker(w.id)
        self.save_counters()
        return returned

    def _return_lease(self, s: ShardRecord) -> None:
        w = self.workers.get(s.worker or "")
        if w is not None:
            w.leases.discard(s.id)
        self._set_state(s, ShardState.TODO)
        s.worker, s.deadline = None, 0.0
        self._push(s, front=True)
        self.journal.put_shard(s)

    def expire(self) -> int:
        """Declare dead the workers that missed their heartbeats, returning their leases, and act on staged commit
        gaps past their bound (``staged.expire_gaps``). Returns how many leases and gaps changed.

        Looks only at the leases and workers whose deadline may have passed (``lease_due``, ``worker_due``).
        """
        now = self.clock()
        dead = [self.workers[wid] for wid in self.worker_due.due(now)]
        late = [self.shards[sid] for sid in self.lease_due.due(now)]
        count = len(self.staged.expire_gaps())  # a failed dataset refuses the lease calls waiting for it
        if not dead and not late:
            return count
        self.events["workers_lost"] += len(dead)
        with self.journal.transaction():
            for s in late:
                if s.state is ShardState.LEASED and s.deadline < now:
                    self._return_lease(s)
                    count += 1
            for w in dead:
                count += self._drop_worker(w)
            self.save_counters()
        return count

    def next_deadline(self) -> float | None:
        """The earliest moment a lease, a worker or a staged commit gap can expire (for the reaper's timer)."""
        due = (self.lease_due.earliest(), self.worker_due.earliest(), self.staged.next_gap_deadline())
        times = [t for t in due if t is not None]
        return min(times) if times else None

    def heartbeat(self, worker_id: str) -> tuple[float, list[tuple[str, int]]]:
        """Extend every lease of the worker by the TTL; returns (new deadline, leases revoked since the last beat)."""
        w = self.worker(worker_id)
        now = self.clock()
        w.last_seen = now
        deadline = now + self.lease_ttl
        for sid in w.leases:
            self.shards[sid].deadline = deadline
        revoked = sorted(w.revoked)
        w.revoked.clear()
        return deadline, revoked


__all__ = ["Liveness"]
