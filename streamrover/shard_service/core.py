"""The shard service core: datasets, leases, fenced acks, and the durable cursor.

Single-threaded by contract: the server holds one lock around every call. Each
public method that changes state writes it to the journal in one transaction
before it returns, so a process killed at any point restarts (:meth:`ShardCore.open`)
with nothing lost or doubled. Lease deadlines and worker liveness are not
journalled: a restarted master gives every lease and worker one fresh TTL.

Cut, commit and restore live in ``cuts.py``, stream planning in ``streams.py``.
"""

from __future__ import annotations

import heapq
import uuid
from dataclasses import dataclass

from streamrover.cursor import PartitionKey
from streamrover.shard_service import fencing
from streamrover.shard_service.api import (
    AckResult,
    FailedPreconditionError,
    LeaseGrant,
    LeaseStatus,
    NotFoundError,
    ShardServiceError,
    ShardState,
)
from streamrover.shard_service.bookkeeping import DatasetRecord, ShardRecord, WorkerRecord
from streamrover.shard_service.cuts import CutOps
from streamrover.shard_service.datasets import DatasetOps
from streamrover.shard_service.planner import grid_cells_covered
from streamrover.shard_service.staged import StagedOps
from streamrover.shard_service.state import RATE_WINDOW
from streamrover.shard_service.streams import StreamOps
from streamrover.sources.api import SourceKind

# how many queued shards a lease looks past for one of a partition no other worker reads
AFFINITY_SCAN = 64


@dataclass(frozen=True)
class LeaseOutcome:
    """The answer to a lease request: its status, the leases granted, and when to ask again (seconds) when WAIT."""

    status: LeaseStatus
    leases: list[LeaseGrant]
    retry_after: float = 0.0


@dataclass(frozen=True)
class AckItem:
    """One ack of a batch (:meth:`ShardCore.ack_batch`): the arguments of :meth:`ShardCore.ack`."""

    worker_id: str
    shard_id: str
    attempt: int
    position: int
    step: int | None = None
    dead_letters: int = 0


@dataclass(frozen=True)
class DatasetCounts:
    """A dataset's shards by state and its records acked and committed (for status)."""

    todo: int
    leased: int
    acked: int
    committed: int
    records_acked: int
    records_committed: int
    finished: bool


class ShardCore(DatasetOps, CutOps, StagedOps, StreamOps):
    """The service's state machine over a :class:`Journal`."""

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
        self._save_counters()
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
        """Declare dead the workers that missed their heartbeats, returning their leases. Returns how many."""
        now = self.clock()
        dead = [w for w in self.workers.values() if w.last_seen + self.lease_ttl < now]
        late = [self.shards[sid] for sid in self.leased if self.shards[sid].deadline < now]
        if not dead and not late:
            return 0
        count = 0
        self.events["workers_lost"] += len(dead)
        with self.journal.transaction():
            for s in late:
                if s.state is ShardState.LEASED and s.deadline < now:
                    self._return_lease(s)
                    count += 1
            for w in dead:
                count += self._drop_worker(w)
            self._save_counters()
        return count

    def next_deadline(self) -> float | None:
        """The earliest moment a lease or a worker can expire (for the reaper's timer)."""
        times = [self.shards[sid].deadline for sid in self.leased]
        times += [w.last_seen + self.lease_ttl for w in self.workers.values()]
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

    # ------------------------------------------------------------------- leases
    def lease(self, worker_id: str, dataset: str, max_shards: int = 1, request_id: int = 0) -> LeaseOutcome:
        """Lease up to ``max_shards`` shards of ``dataset`` to a worker (expired leases are returned first).

        ``request_id``: a retry of the worker's last request (same id) gets the same leases, not new ones.
        OK with the grants; END when a batch dataset is finished; WAIT with when to ask again otherwise.
        Raises NotFoundError (worker, dataset) and FailedPreconditionError (a failed dataset).
        """
        self.expire()
        return self._lease(worker_id, dataset, max_shards, request_id)

    def _lease(self, worker_id: str, dataset: str, max_shards: int, request_id: int) -> LeaseOutcome:
        """:meth:`lease` once expired leases and workers are gone."""
        w = self.worker(worker_id)
        ds = self.dataset(dataset)
        self.check_usable(ds)
        now = self.clock()
        w.last_seen = now
        if request_id and request_id == w.last_request_id:  # a retry of a call whose answer was lost
            held = [self.shards[s] for s in w.last_lease_ids if s in w.leases]
            return LeaseOutcome(LeaseStatus.OK if held else LeaseStatus.WAIT, [self._grant(ds, s) for s in held], 0.1)
        grants: list[LeaseGrant] = []
        with self.journal.transaction():
            while len(grants) < max(max_shards, 1):
                s = self._pop_todo(ds, w)
                if s is None:
                    break
                self.tails[(w.id, ds.name)] = (s.epoch, s.pindex, s.end)
                self._lease_seq += 1
                self._set_state(s, ShardState.LEASED)
                s.attempt, s.worker, s.deadline = self._lease_seq, w.id, now + self.lease_ttl
                w.leases.add(s.id)
                self.journal.put_shard(s)
                grants.append(self._grant(ds, s))
                self.events["leases_granted"] += 1
            if grants:
                w.last_request_id = request_id
                w.last_lease_ids = [g.shard_id for g in grants]
                self.journal.put_worker(w)
                self._save_counters()
        if grants:
            return LeaseOutcome(LeaseStatus.OK, grants)
        if self.finished(ds):
            return LeaseOutcome(LeaseStatus.END, [])
        deadline = self.next_deadline()
        retry = 1.0 if deadline is None else min(max(deadline - now, 0.05), 1.0)
        return LeaseOutcome(LeaseStatus.WAIT, [], retry)

    def _pop_todo(self, ds: DatasetRecord, w: WorkerRecord | None = None) -> ShardRecord | None:
        """The next shard to lease: queue order, with lease affinity for ``w`` unless the dataset is shuffled.

        Affinity: a worker gets the shard that starts where the last shard it was granted ends
        (its reader is positioned there: a Kafka consumer keeps its prefetched records), unless
        a returned shard waits (those go first); otherwise the first shard in queue order of a
        partition that no other worker is reading, so that workers do not leapfrog along one
        partition. Neither changes what is leased, only in which order and to whom.
        """
        queue = self.queues[ds.name]
        prefer = w is not None and not ds.spec.shuffle
        while True:
            head = self._queue_head(queue)
            if prefer and w is not None and (head is None or head[0] >= 0):  # (front priorities are < 0)
                tail = self.tails.get((w.id, ds.name))
                sid = self.todo_at.get((ds.name, *tail)) if tail is not None else None
                if sid is not None:
                    return self.shards[sid]  # its queue entry is now stale and skipped later
            skipped: list[tuple[float, str]] = []
            found: ShardRecord | None = None
            while queue:
                prio, sid = heapq.heappop(queue)
                s = self.shards.get(sid)
                if s is None or s.state is not ShardState.TODO or s.priority != prio:
                    continue  # stale
                if prefer and prio >= 0 and len(skipped) < AFFINITY_SCAN and self._read_by_others(s, w):
                    skipped.append((prio, sid))
                    continue
                found = s
                break
            if found is None and skipped:
                found = self.shards[skipped.pop(0)[1]]
            for item in skipped:
                heapq.heappush(queue, item)
            if found is not None:
                return found
            if ds.kind is SourceKind.BATCH and ds.epochs_planned < ds.spec.epochs:
                self._plan_next_epoch(ds)
                continue
            return None

    def _queue_head(self, queue: list[tuple[float, str]]) -> tuple[float, str] | None:
        """The first live entry of a queue (stale entries in front of it are dropped)."""
        while queue:
            prio, sid = queue[0]
            s = self.shards.get(sid)
            if s is not None and s.state is ShardState.TODO and s.priority == prio:
                return prio, sid
            heapq.heappop(queue)
        return None

    def _read_by_others(self, s: ShardRecord, w: WorkerRecord | None) -> bool:
        """Whether another worker than ``w`` holds a lease on ``s``'s partition (in ``s``'s epoch)."""
        key = (s.dataset, s.epoch, s.pindex)
        mine = 0 if w is None else sum(1 for sid in w.leases if self._reading_key(sid) == key)
        return self.reading.get(key, 0) > mine

    def _reading_key(self, sid: str) -> tuple[str, int, int] | None:
        s = self.shards.get(sid)
        return None if s is None else (s.dataset, s.epoch, s.pindex)

    def _grant(self, ds: DatasetRecord, s: ShardRecord) -> LeaseGrant:
        part = ds.partitions[s.pindex]
        return LeaseGrant(s.id, s.attempt, ds.name, s.epoch, part, s.start, s.end, s.acked_to, s.deadline)

    # --------------------------------------------------------------------- acks
    def ack(
        self, worker_id: str, shard_id: str, attempt: int, position: int, step: int | None = None, dead_letters: int = 0
    ) -> AckResult:
        """Record that the records of ``shard_id`` before ``position`` are applied (after ``step``), fenced.

        Applied only for the worker holding attempt ``attempt`` now (``fencing.judge``): a repeat is a harmless
        duplicate, a stale attempt raises :class:`StaleLeaseError`, a position outside the shard
        :class:`InvalidArgumentError`. Acking the shard's end makes it ACKED. Journalled before it returns.
        """
        self.expire()
        return self._ack(worker_id, shard_id, attempt, position, step, dead_letters)

    def _ack(
        self, worker_id: str, shard_id: str, attempt: int, position: int, step: int | None, dead_letters: int
    ) -> AckResult:
        """:meth:`ack` once expired leases and workers are gone."""
        s = self.shards.get(shard_id)
        if s is None:
            return self._ack_unknown(shard_id, attempt)
        verdict = fencing.judge(s, worker_id, attempt, position, self.restore_revoked)
        if verdict is not None:
            return verdict
        w = self.workers[worker_id]
        w.last_seen = self.clock()
        records = self.datasets[s.dataset].records_in(s.pindex, s.acked_to, position)
        w.records_acked += records
        self.ack_log.add(w.last_seen, records)
        if s.acks and s.acks[-1][0] == step:  # a cut of any step sees only the last ack of each step:
            s.acks[-1] = (step, position)  # progress acks of one step (or of none) keep one entry, not one each
        else:
            s.acks.append((step, position))
        s.acked_by[attempt] = position
        s.acked_to = position
        self.unfolded.add(s.id)
        done = position == s.end
        if done:
            self._set_state(s, ShardState.ACKED)
            s.worker = None
            w.leases.discard(s.id)
        with self.journal.transaction():
            self.journal.put_shard(s)
            if dead_letters:
                ds = self.datasets[s.dataset]
                ds.dead_letters += dead_letters
                self.journal.put_dataset(ds)
        return AckResult(shard_done=done, duplicate=False)

    def ack_batch(
        self,
        acks: list[AckItem],
        worker_id: str = "",
        lease_dataset: str = "",
        lease_more: int = 0,
        request_id: int = 0,
    ) -> tuple[list[AckResult | ShardServiceError], LeaseOutcome | None]:
        """Several acks in order, each judged as :meth:`ack` judges it, in one journal transaction.

        Expired leases and workers are dropped once, at the start: the batch is judged at one moment.

        A refused ack does not stop the ones after it: its error is returned in its place
        (refusals are raised before anything changes). Every accepted ack is committed to
        the journal before this returns, all in one transaction. Then, when ``lease_more``
        > 0, up to that many shards of ``lease_dataset`` are leased to ``worker_id`` (no
        wait; ``request_id`` as in :meth:`lease`: a retried batch gets the same leases); a
        lease that cannot be granted (unknown worker or dataset, a failed dataset) yields None.
        """
        results: list[AckResult | ShardServiceError] = []
        outcome: LeaseOutcome | None = None
        with self.journal.transaction():
            self.expire()  # once for the batch: its acks and leases are judged at one moment
            for a in acks:
                try:
                    results.append(self._ack(a.worker_id, a.shard_id, a.attempt, a.position, a.step, a.dead_letters))
                except ShardServiceError as exc:
                    results.append(exc)
            if lease_more > 0 and lease_dataset:
                try:
                    outcome = self._lease(worker_id, lease_dataset, lease_more, request_id)
                except ShardServiceError:
                    outcome = None
        return results, outcome

    def shards_dataset(self, shard_id: str) -> str | None:
        """The dataset a shard id belongs to (None if it names no registered dataset)."""
        s = self.shards.get(shard_id)
        if s is not None:
            return s.dataset
        key_range = fencing.committed_range(shard_id, self.datasets)
        return key_range[0].dataset if key_range is not None else None

    def _ack_unknown(self, shard_id: str, attempt: int) -> AckResult:
        key_range = fencing.committed_range(shard_id, self.datasets)
        if key_range is not None and self.committed.get(key_range[0]).covers(key_range[1], key_range[2]):
            return AckResult(shard_done=True, duplicate=True)  # compacted after a commit: nothing to change
        if shard_id in self.restore_revoked:
            raise FailedPreconditionError(
                f"ack of shard {shard_id!r} attempt {attempt} refused: the shard was discarded by a restore"
            )
        raise NotFoundError(f"shard {shard_id!r} is unknown to this shard service")

    # ------------------------------------------------------------------- status
    def finished(self, ds: DatasetRecord) -> bool:
        """A batch dataset is finished when every epoch is planned and no shard waits or is leased."""
        states = self.state_counts[ds.name]
        return (
            ds.kind is SourceKind.BATCH
            and ds.epochs_planned >= ds.spec.epochs
            and states[ShardState.TODO] == 0
            and states[ShardState.LEASED] == 0
        )

    def counts(self, ds: DatasetRecord) -> DatasetCounts:
        """Shard and record counts for status (walks the committed cursor: not for hot paths)."""
        states = self.state_counts[ds.name]
        committed_cells = 0
        committed_records = 0
        for part in ds.partitions:
            for epoch in range(ds.epochs_planned):
                covered = self.committed.get(PartitionKey(ds.name, epoch, part.id))
                committed_cells += grid_cells_covered(part, ds.shard_size, covered, ds.runs.get(part.index))
                committed_records += ds.records_in_set(part.index, covered)
        index = {p.id: p.index for p in ds.partitions}
        acked_records = sum(
            ds.records_in_set(index[key.partition], covered)
            for key, covered in self.acked_cursor().only(ds.name).items()
            if key.partition in index
        )
        finished = self.finished(ds)
        return DatasetCounts(
            todo=states[ShardState.TODO],
            leased=states[ShardState.LEASED],
            acked=states[ShardState.ACKED],
            committed=committed_cells,
            records_acked=acked_records,
            records_committed=committed_records,
            finished=finished,
        )

    def planned_records(self, ds: DatasetRecord) -> int:
        """Records in the dataset's planned extents (a stream's grows as it is planned)."""
        return ds.planned_records()

    def rates(self) -> tuple[float, float]:
        """(records acked per second, acks per second) over the last few seconds (``state.RATE_WINDOW``)."""
        now = self.clock()
        records, acks = self.ack_log.totals(now)
        span = min(RATE_WINDOW, max(now - self.started, 1e-3))
        return records / span, acks / span

    # ------------------------------------------------------------------ key-value (kv.py)
    def kv_get(self, key: str) -> tuple[bytes, int] | None:
        """(value, version) of ``key`` in the service's key-value store, or None when absent."""
        return self.kv.get(key)

    def kv_set(self, key: str, value: bytes, expected_version: int) -> tuple[bool, bytes, int]:
        """Compare-and-set (:meth:`KvStore.set`)."""
        return self.kv.set(key, value, expected_version)

    def kv_delete(self, key: str, expected_version: int) -> tuple[bool, bytes, int]:
        """Compare-and-delete (:meth:`KvStore.delete`)."""
        return self.kv.delete(key, expected_version)

    def kv_delete_range(self, key: str, range_end: str) -> int:
        """Remove the keys in ``[key, range_end)`` (:meth:`KvStore.delete_range`)."""
        return self.kv.delete_range(key, range_end)
