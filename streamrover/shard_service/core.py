"""The shard service core: datasets, leases, fenced acks, and the durable cursor.

Single-threaded by contract: the server holds one lock around every call. Each
public method that changes state writes it to the journal in one transaction
before it returns, so a process killed at any point restarts (:meth:`ShardCore.open`)
with nothing lost or doubled. Lease deadlines and worker liveness are not
journalled: a restarted master gives every lease and worker one fresh TTL.

Cut, commit and restore (ARCHITECTURE.md, "The exactly-once contract"):

- ``cut_prepare(step)``: the cursor of a model state = the committed cursor plus
  every ack with ``step <= step`` (all acks when ``step`` is None).
- ``cut_commit(cut_id)``: the checkpoint holding that cursor is durable; it
  becomes the committed cursor, and shards inside it are compacted away.
- ``restore(cursor)``: everything outside the cursor is to be read again: leases
  are revoked and the uncovered ranges are re-planned as fresh shards.
"""

from __future__ import annotations

import heapq
import itertools
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from streamrover.cursor import DataCursor, PartitionKey
from streamrover.shard_service import acks as ackrules
from streamrover.shard_service.api import (
    DEFAULT_LEASE_TTL,
    AckResult,
    AlreadyExistsError,
    DatasetSpec,
    FailedPreconditionError,
    InvalidArgumentError,
    LeaseGrant,
    LeaseStatus,
    NotFoundError,
    PartitionPlan,
    ShardState,
    shard_id_for,
)
from streamrover.shard_service.journal import Journal
from streamrover.shard_service.planner import PlannedShard, grid_cells_covered, plan_epoch
from streamrover.shard_service.records import CutRecord, CutState, DatasetRecord, ShardRecord, WorkerRecord
from streamrover.sources.api import Partition, SourceKind

KEEP_COMMITTED_CUTS = 8
MAX_PREPARED_CUTS = 32


@dataclass(frozen=True)
class LeaseOutcome:
    status: LeaseStatus
    leases: list[LeaseGrant]
    retry_after: float = 0.0


@dataclass(frozen=True)
class DatasetCounts:
    todo: int
    leased: int
    acked: int
    committed: int
    records_acked: int
    records_committed: int
    finished: bool


class ShardCore:
    """The service's state machine over a :class:`Journal`."""

    def __init__(self, journal: Journal, lease_ttl: float = DEFAULT_LEASE_TTL, clock: Callable[[], float] = time.time):
        self.journal = journal
        self.lease_ttl = lease_ttl
        self.clock = clock
        self.datasets: dict[str, DatasetRecord] = {}
        self.shards: dict[str, ShardRecord] = {}
        self.by_dataset: dict[str, set[str]] = {}
        self.queues: dict[str, list[tuple[float, str]]] = {}
        self.leased: set[str] = set()
        self.unfolded: set[str] = set()  # shards with acks not yet in the committed cursor
        self.workers: dict[str, WorkerRecord] = {}
        self.committed = DataCursor()
        self.cuts: dict[int, CutRecord] = {}
        self.restore_revoked: set[str] = set()
        self.ack_log: deque[tuple[float, int]] = deque()
        self.started = clock()
        self._lease_seq = int(journal.get_meta("lease_seq") or 0)
        self._cut_seq = int(journal.get_meta("cut_seq") or 0)
        self._front = float(journal.get_meta("front_priority") or 0.0)
        self._back = float(journal.get_meta("back_priority") or 0.0)
        self.last_committed_cut = int(journal.get_meta("last_committed_cut") or 0)
        self._load()

    # ------------------------------------------------------------------ loading
    def _load(self) -> None:
        now = self.clock()
        for ds in self.journal.load_datasets():
            self.datasets[ds.name] = ds
            self.by_dataset[ds.name] = set()
            self.queues[ds.name] = []
        for w in self.journal.load_workers():
            w.last_seen = now
            self.workers[w.id] = w
        for s in self.journal.load_shards():
            self._index(s)
            if s.state is ShardState.LEASED:
                s.deadline = now + self.lease_ttl
                worker = self.workers.get(s.worker or "")
                if worker is None:  # worker row gone with the lease still recorded: return the shard
                    s.state, s.worker = ShardState.TODO, None
                    self._push(s)
                else:
                    worker.leases.add(s.id)
        self.committed = self.journal.load_cursor()
        for cut in self.journal.load_cuts():
            self.cuts[cut.id] = cut

    def _index(self, s: ShardRecord) -> None:
        self.shards[s.id] = s
        self.by_dataset[s.dataset].add(s.id)
        if s.state is ShardState.TODO:
            heapq.heappush(self.queues[s.dataset], (s.priority, s.id))
        elif s.state is ShardState.LEASED:
            self.leased.add(s.id)
        if s.acks:
            self.unfolded.add(s.id)

    def _push(self, s: ShardRecord, front: bool = False) -> None:
        if front:
            self._front -= 1
            s.priority = self._front
        heapq.heappush(self.queues[s.dataset], (s.priority, s.id))

    def _save_counters(self) -> None:
        j = self.journal
        j.put_meta("lease_seq", str(self._lease_seq))
        j.put_meta("cut_seq", str(self._cut_seq))
        j.put_meta("front_priority", repr(self._front))
        j.put_meta("back_priority", repr(self._back))
        j.put_meta("last_committed_cut", str(self.last_committed_cut))

    # ----------------------------------------------------------------- datasets
    def register_dataset(
        self, spec: DatasetSpec, kind: SourceKind, partitions: list[Partition], schema_json: str
    ) -> tuple[DatasetRecord, bool]:
        spec = spec.normalized()
        existing = self.datasets.get(spec.name)
        if existing is not None:
            if existing.spec == spec:
                return existing, False
            raise AlreadyExistsError(
                f"dataset {spec.name!r} is already registered with a different spec "
                f"({existing.spec.uri!r}); choose another name"
            )
        if kind is SourceKind.STREAM and (spec.epochs > 1 or spec.shuffle):
            raise InvalidArgumentError(
                f"dataset {spec.name!r} is a stream: epochs and shuffle apply to batch data only"
            )
        plans = [PartitionPlan(i, p.id, p.start, p.end) for i, p in enumerate(partitions)]
        ds = DatasetRecord(spec, kind, plans, schema_json, epochs_planned=0)
        self.datasets[ds.name] = ds
        self.by_dataset[ds.name] = set()
        self.queues[ds.name] = []
        with self.journal.transaction():
            if kind is SourceKind.BATCH:
                self._plan_next_epoch(ds)
            else:
                ds.epochs_planned = 1
                self._add_planned(ds, plan_epoch(plans, 0, ds.shard_size, False, 0))
            self.journal.put_dataset(ds)
            self._save_counters()
        return ds, True

    def dataset(self, name: str) -> DatasetRecord:
        ds = self.datasets.get(name)
        if ds is None:
            known = ", ".join(sorted(self.datasets)) or "none"
            raise NotFoundError(f"dataset {name!r} is not registered (registered: {known})")
        return ds

    def _plan_next_epoch(self, ds: DatasetRecord) -> None:
        epoch = ds.epochs_planned
        ds.epochs_planned += 1
        spec = ds.spec
        self._add_planned(ds, plan_epoch(ds.partitions, epoch, ds.shard_size, spec.shuffle, spec.seed))
        self.journal.put_dataset(ds)

    def _add_planned(self, ds: DatasetRecord, planned: Iterable[PlannedShard]) -> None:
        for p in planned:
            self._back += 1
            sid = shard_id_for(ds.name, p.epoch, p.partition.index, p.start, p.end)
            s = ShardRecord(sid, ds.name, p.epoch, p.partition.index, p.start, p.end, priority=self._back)
            self._index(s)
            self.journal.put_shard(s)

    # ------------------------------------------------------------------ workers
    def join(self, name: str, worker_id: str = "") -> WorkerRecord:
        worker_id = worker_id or f"w-{uuid.uuid4().hex[:12]}"
        w = self.workers.get(worker_id)
        if w is None:
            w = WorkerRecord(worker_id, name)
            self.workers[worker_id] = w
            with self.journal.transaction():
                self.journal.put_worker(w)
        w.last_seen = self.clock()
        return w

    def worker(self, worker_id: str) -> WorkerRecord:
        w = self.workers.get(worker_id)
        if w is None:
            raise NotFoundError(
                f"worker {worker_id!r} is unknown: it left, or missed heartbeats for {self.lease_ttl:.1f}s "
                "and was declared dead; join again"
            )
        return w

    def leave(self, worker_id: str) -> int:
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
        self.journal.delete_worker(w.id)
        self._save_counters()
        return returned

    def _return_lease(self, s: ShardRecord) -> None:
        w = self.workers.get(s.worker or "")
        if w is not None:
            w.leases.discard(s.id)
        s.state, s.worker, s.deadline = ShardState.TODO, None, 0.0
        self.leased.discard(s.id)
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

    def heartbeat(self, worker_id: str) -> tuple[float, list[str]]:
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
        self.expire()
        w = self.worker(worker_id)
        ds = self.dataset(dataset)
        now = self.clock()
        w.last_seen = now
        if request_id and request_id == w.last_request_id:  # a retry of a call whose answer was lost
            held = [self.shards[s] for s in w.last_lease_ids if s in w.leases]
            return LeaseOutcome(LeaseStatus.OK if held else LeaseStatus.WAIT, [self._grant(ds, s) for s in held], 0.1)
        grants: list[LeaseGrant] = []
        with self.journal.transaction():
            while len(grants) < max(max_shards, 1):
                s = self._pop_todo(ds)
                if s is None:
                    break
                self._lease_seq += 1
                s.state, s.attempt, s.worker, s.deadline = (
                    ShardState.LEASED,
                    self._lease_seq,
                    w.id,
                    now + self.lease_ttl,
                )
                self.leased.add(s.id)
                w.leases.add(s.id)
                self.journal.put_shard(s)
                grants.append(self._grant(ds, s))
            if grants:
                w.last_request_id = request_id
                w.last_lease_ids = [g.shard_id for g in grants]
                self.journal.put_worker(w)
                self._save_counters()
        if grants:
            return LeaseOutcome(LeaseStatus.OK, grants)
        if self.counts(ds).finished:
            return LeaseOutcome(LeaseStatus.END, [])
        deadline = self.next_deadline()
        retry = 1.0 if deadline is None else min(max(deadline - now, 0.05), 1.0)
        return LeaseOutcome(LeaseStatus.WAIT, [], retry)

    def _pop_todo(self, ds: DatasetRecord) -> ShardRecord | None:
        queue = self.queues[ds.name]
        while True:
            while queue:
                prio, sid = heapq.heappop(queue)
                s = self.shards.get(sid)
                if s is not None and s.state is ShardState.TODO and s.priority == prio:
                    return s
            if ds.kind is SourceKind.BATCH and ds.epochs_planned < ds.spec.epochs:
                self._plan_next_epoch(ds)
                continue
            return None

    def _grant(self, ds: DatasetRecord, s: ShardRecord) -> LeaseGrant:
        part = ds.partitions[s.pindex]
        return LeaseGrant(s.id, s.attempt, ds.name, s.epoch, part, s.start, s.end, s.acked_to, s.deadline)

    # --------------------------------------------------------------------- acks
    def ack(self, worker_id: str, shard_id: str, attempt: int, position: int, step: int | None = None) -> AckResult:
        self.expire()
        s = self.shards.get(shard_id)
        if s is None:
            return self._ack_unknown(shard_id, attempt)
        verdict = ackrules.judge(s, worker_id, attempt, position, self.restore_revoked)
        if verdict is not None:
            return verdict
        w = self.workers[worker_id]
        w.last_seen = self.clock()
        w.records_acked += position - s.acked_to
        self.ack_log.append((w.last_seen, position - s.acked_to))
        s.acks.append((step, position))
        s.acked_by[attempt] = position
        s.acked_to = position
        self.unfolded.add(s.id)
        done = position == s.end
        if done:
            s.state, s.worker = ShardState.ACKED, None
            self.leased.discard(s.id)
            w.leases.discard(s.id)
        with self.journal.transaction():
            self.journal.put_shard(s)
        return AckResult(shard_done=done, duplicate=False)

    def _ack_unknown(self, shard_id: str, attempt: int) -> AckResult:
        key_range = ackrules.committed_range(shard_id, self.datasets)
        if key_range is not None and self.committed.get(key_range[0]).covers(key_range[1], key_range[2]):
            return AckResult(shard_done=True, duplicate=True)  # compacted after a commit: nothing to change
        if shard_id in self.restore_revoked:
            raise FailedPreconditionError(
                f"ack of shard {shard_id!r} attempt {attempt} refused: the shard was discarded by a restore"
            )
        raise NotFoundError(f"shard {shard_id!r} is unknown to this shard service")

    # --------------------------------------------------------------------- cuts
    def acked_cursor(self, step: int | None = None) -> DataCursor:
        """The committed cursor plus every ack with ``step <= step`` (all acks when None)."""
        cursor = self.committed.copy()
        for sid in self.unfolded:
            s = self.shards[sid]
            pos = s.start
            for ack_step, ack_pos in s.acks:
                if step is not None and ack_step is not None and ack_step > step:
                    break
                pos = ack_pos
            if pos > s.start:
                cursor.add(self._key(s), s.start, pos)
        return cursor

    def _key(self, s: ShardRecord) -> PartitionKey:
        return PartitionKey(s.dataset, s.epoch, self.datasets[s.dataset].partitions[s.pindex].id)

    def cut_prepare(self, step: int | None = None) -> CutRecord:
        cursor = self.acked_cursor(step)
        self._cut_seq += 1
        cut = CutRecord(self._cut_seq, step, cursor, CutState.PREPARED)
        self.cuts[cut.id] = cut
        with self.journal.transaction():
            self.journal.put_cut(cut)
            prepared = sorted(c.id for c in self.cuts.values() if c.state is CutState.PREPARED)
            for old in prepared[:-MAX_PREPARED_CUTS]:
                del self.cuts[old]
                self.journal.delete_cut(old)
            self._save_counters()
        return cut

    def cut_commit(self, cut_id: int) -> DataCursor:
        cut = self.cuts.get(cut_id)
        if cut is None:
            if cut_id <= self.last_committed_cut:
                raise FailedPreconditionError(
                    f"cut {cut_id} is older than the committed cut {self.last_committed_cut} and was discarded"
                )
            raise NotFoundError(f"cut {cut_id} is unknown (prepared cuts are discarded by a restore)")
        if cut.state is CutState.COMMITTED:
            return self.committed.copy()
        if cut_id < self.last_committed_cut:
            raise FailedPreconditionError(f"cut {cut_id} is older than the committed cut {self.last_committed_cut}")
        missing = ackrules.not_contained(self.committed, cut.cursor)
        if missing:
            raise FailedPreconditionError(
                f"cut {cut_id} does not contain the committed cursor (e.g. {missing}); commit a newer cut"
            )
        with self.journal.transaction():
            cut.state = CutState.COMMITTED
            self.journal.put_cut(cut)
            self.last_committed_cut = cut_id
            self.committed = cut.cursor.copy()
            self.journal.put_cursor(self.committed)
            self._fold_committed()
            self._forget_cuts(keep_after=cut_id)
            self._save_counters()
        return self.committed.copy()

    def _fold_committed(self) -> None:
        for sid in sorted(self.unfolded):
            s = self.shards[sid]
            covered = self.committed.get(self._key(s))
            s.acks = [(st, pos) for st, pos in s.acks if not covered.covers(s.start, pos)]
            if s.state is ShardState.ACKED and covered.covers(s.start, s.end):
                del self.shards[sid]
                self.by_dataset[s.dataset].discard(sid)
                self.unfolded.discard(sid)
                self.journal.delete_shard(sid)
                continue
            if not s.acks:
                self.unfolded.discard(sid)
            self.journal.put_shard(s)

    def _forget_cuts(self, keep_after: int) -> None:
        committed = sorted(c.id for c in self.cuts.values() if c.state is CutState.COMMITTED)
        stale = [c.id for c in self.cuts.values() if c.state is CutState.PREPARED and c.id < keep_after]
        for cid in stale + committed[:-KEEP_COMMITTED_CUTS]:
            del self.cuts[cid]
            self.journal.delete_cut(cid)

    # ------------------------------------------------------------------ restore
    def restore(self, cursor: DataCursor | None = None, cut_id: int | None = None) -> tuple[int, int]:
        """Reset to ``cursor`` (or the cursor of cut ``cut_id``). Returns (leases revoked, records requeued)."""
        if cursor is None:
            cut = self.cuts.get(cut_id or 0)
            if cut is None:
                raise NotFoundError(f"cut {cut_id} is not remembered; restore from the checkpoint's cursor instead")
            cursor = cut.cursor
        ackrules.check_restorable(cursor, self.datasets)
        revoked = 0
        requeued = 0
        with self.journal.transaction():
            for sid in sorted(self.leased):
                s = self.shards[sid]
                w = self.workers.get(s.worker or "")
                if w is not None:
                    w.leases.discard(sid)
                    w.revoked.add(sid)
                revoked += 1
            self.leased.clear()
            for ds in self.datasets.values():
                requeued += self._replan(ds, cursor.only(ds.name))
            self.committed = cursor.copy()
            self.journal.put_cursor(self.committed)
            for cid in [c.id for c in self.cuts.values() if c.state is CutState.PREPARED]:
                del self.cuts[cid]
                self.journal.delete_cut(cid)
            self._cut_seq += 1
            restored = CutRecord(self._cut_seq, None, cursor.copy(), CutState.COMMITTED)
            self.cuts[restored.id] = restored
            self.journal.put_cut(restored)
            self.last_committed_cut = restored.id
            self._forget_cuts(keep_after=restored.id)
            self._save_counters()
        return revoked, requeued

    def _replan(self, ds: DatasetRecord, cursor: DataCursor) -> int:
        for sid in self.by_dataset[ds.name]:
            self.restore_revoked.add(sid)
            self.unfolded.discard(sid)
            del self.shards[sid]
        self.by_dataset[ds.name] = set()
        self.queues[ds.name] = []
        self.journal.delete_shards_of(ds.name)
        done = {(k.epoch, k.partition): ivs for k, ivs in cursor.items()}
        if ds.kind is SourceKind.BATCH:
            ds.epochs_planned = max([k.epoch + 1 for k in cursor.keys()] + [1])
        planned = list(
            itertools.chain.from_iterable(
                plan_epoch(ds.partitions, e, ds.shard_size, ds.spec.shuffle, ds.spec.seed, done)
                for e in range(ds.epochs_planned)
            )
        )
        self._add_planned(ds, planned)
        self.journal.put_dataset(ds)
        self.restore_revoked -= self.by_dataset[ds.name]
        return sum(p.records for p in planned)

    # ------------------------------------------------------------------- status
    def counts(self, ds: DatasetRecord) -> DatasetCounts:
        states = {state: 0 for state in ShardState}
        acked_records = 0
        for sid in self.by_dataset[ds.name]:
            s = self.shards[sid]
            states[s.state] += 1
        committed_cells = 0
        committed_records = 0
        for part in ds.partitions:
            for epoch in range(ds.epochs_planned):
                covered = self.committed.get(PartitionKey(ds.name, epoch, part.id))
                committed_cells += grid_cells_covered(part, ds.shard_size, covered)
                committed_records += covered.size()
        acked_records = self.acked_cursor().only(ds.name).size()
        finished = (
            ds.kind is SourceKind.BATCH
            and ds.epochs_planned >= ds.spec.epochs
            and states[ShardState.TODO] == 0
            and states[ShardState.LEASED] == 0
        )
        return DatasetCounts(
            todo=states[ShardState.TODO],
            leased=states[ShardState.LEASED],
            acked=states[ShardState.ACKED],
            committed=committed_cells,
            records_acked=acked_records,
            records_committed=committed_records,
            finished=finished,
        )

    def rates(self, window: float = 5.0) -> tuple[float, float]:
        """(records acked per second, acks per second) over the last ``window`` seconds."""
        now = self.clock()
        while self.ack_log and self.ack_log[0][0] < now - window:
            self.ack_log.popleft()
        span = min(window, max(now - self.started, 1e-3))
        return sum(n for _, n in self.ack_log) / span, len(self.ack_log) / span
