"""The shard service core: workers, leases, fenced acks, composed with its parts.

Single-threaded by contract: the server holds one lock around every call. Each public method that changes
state writes it to the journal in one transaction before it returns, so a process killed at any point restarts
with nothing lost or doubled. Lease deadlines and worker liveness are not journalled: a restarted master gives
every lease and worker one fresh TTL.

The core is the shard table (``state.py``: datasets, shards, queues, workers, every shard state change), worker
liveness and expiry (``liveness.py``: join, heartbeat, leave, expire) and the parts it composes, each with its
own state: ``cut_book`` (``cuts.py``: cuts, the committed cursor, the durable limits), ``streams``
(``streams.py`` and ``upstream.py``: planning from polls, lag, upstream commits, data deleted upstream),
``staged`` (``staged.py``: files committed by sinks), ``kv`` (``kv.py``). What spans parts is here or in
``datasets.py``: registering and removing datasets, restore, the acked cursor.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from streamrover.cursor import DataCursor
from streamrover.shard_service.api import (
    DEFAULT_LEASE_TTL,
    AckResult,
    DatasetSpec,
    FailedPreconditionError,
    LeaseGrant,
    LeaseStatus,
    NotFoundError,
    ShardServiceError,
    ShardState,
)
from streamrover.shard_service.master import datasets, fencing
from streamrover.shard_service.master.bookkeeping import (
    AckItem,
    CutRecord,
    DatasetCounts,
    DatasetRecord,
    LeaseOutcome,
    ShardRecord,
)
from streamrover.shard_service.master.compaction import compact, expand
from streamrover.shard_service.master.cuts import CutBook
from streamrover.shard_service.master.journal import Journal
from streamrover.shard_service.master.kv import KvStore
from streamrover.shard_service.master.liveness import Liveness
from streamrover.shard_service.master.merging import merge_room, merge_run
from streamrover.shard_service.master.staged import StagedCommits, StagedOutcome
from streamrover.shard_service.master.streams import StreamPlanner
from streamrover.shard_service.master.tallies import RATE_WINDOW
from streamrover.sources.api import Partition, SourceKind
from streamrover.sources.staged import FileFacts


class ShardCore(Liveness):
    """The service's state machine over a :class:`Journal`: the shard table, composed with its parts."""

    def __init__(self, journal: Journal, lease_ttl: float = DEFAULT_LEASE_TTL, clock: Callable[[], float] = time.time):
        super().__init__(journal, lease_ttl, clock)
        self.kv = KvStore(journal)
        self.cut_book = CutBook(journal, self.clock)
        self.streams = StreamPlanner(self, self.cut_book)
        self.staged = StagedCommits(self, self.streams)

    # ------------------------------------------------------------------- leases
    def lease(
        self, worker_id: str, dataset: str, max_shards: int = 1, request_id: int = 0, merge_records: int = 0
    ) -> LeaseOutcome:
        """Lease up to ``max_shards`` shards of ``dataset`` to a worker (expired leases are returned first).

        ``request_id``: a retry of the worker's last request (same id) gets the same leases, not new ones.
        ``merge_records`` > 0: runs of never-leased shards may be granted merged (:mod:`.merging`).
        OK with the grants; END when a batch dataset is finished; WAIT with when to ask again otherwise.
        Raises NotFoundError (worker, dataset) and FailedPreconditionError (a failed dataset).
        """
        self.expire()
        return self._lease(worker_id, dataset, max_shards, request_id, merge_records)

    def _lease(self, worker_id: str, dataset: str, max_shards: int, request_id: int, merge: int = 0) -> LeaseOutcome:
        """:meth:`lease` once expired leases and workers are gone."""
        w = self.worker(worker_id)
        ds = self.dataset(dataset)
        self.check_usable(ds)
        now = self.clock()
        w.last_seen = now
        if request_id and request_id == w.last_request_id:  # a retry of a call whose answer was lost
            held = [self.shards[s] for s in w.last_lease_ids if s in w.leases]
            again = [self._grant(ds, s, ds.planned_in(s.pindex, s.start, s.end)) for s in held]  # merged: counted
            return LeaseOutcome(LeaseStatus.OK if held else LeaseStatus.WAIT, again, 0.1)
        grants: list[LeaseGrant] = []
        wanted = self.share(ds, w, max(max_shards, 1))
        cap = wanted if wanted >= max_shards else -(-wanted // 2)  # a binding share (the end): two leases at least
        room = merge_room(self, ds, w, wanted, merge) if wanted >= max_shards else 0  # far from the end (.merging)
        journal, tail, until = self.journal, (w.id, ds.name), now + self.lease_ttl
        taken = 0  # planned shards granted (a merged shard counts each of its members: .merging)
        with journal.transaction():
            while taken < wanted:
                s = self.pop_todo(ds, w)
                if s is None:
                    break
                s, covered = merge_run(self, ds, s, room - taken if room else min(wanted - taken, cap), merge)
                taken += covered
                self.tails[tail] = (s.epoch, s.pindex, s.end)
                self._set_state(s, ShardState.LEASED)
                s.attempt, s.worker, s.deadline = self.next_attempt(), w.id, until
                w.leases.add(s.id)
                self.lease_due.track(s.id, until)
                journal.put_shard_leased(s)
                grants.append(self._grant(ds, s, covered))
            if grants:
                self.events["leases_granted"] += len(grants)
                w.last_request_id = request_id
                w.last_lease_ids = [g.shard_id for g in grants]
                journal.put_worker_request(w)
                self.save_counters()
        if grants:
            return LeaseOutcome(LeaseStatus.OK, grants)
        if self.finished(ds):
            return LeaseOutcome(LeaseStatus.END, [])
        deadline = self.next_deadline()
        retry = 1.0 if deadline is None else min(max(deadline - now, 0.05), 1.0)
        return LeaseOutcome(LeaseStatus.WAIT, [], retry)

    def _grant(self, ds: DatasetRecord, s: ShardRecord, shards: int = 1) -> LeaseGrant:
        part = ds.partitions[s.pindex]
        return LeaseGrant(s.id, s.attempt, ds.name, s.epoch, part, s.start, s.end, s.acked_to, s.deadline, shards)

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
            self.journal.put_shard_acked(s)
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
        merge_records: int = 0,
    ) -> tuple[list[AckResult | ShardServiceError], LeaseOutcome | None]:
        """Several acks in order, each judged as :meth:`ack` judges it, in one journal transaction.

        Expired leases and workers are dropped once, at the start: the batch is judged at one moment.

        A refused ack does not stop the ones after it: its error is returned in its place
        (refusals are raised before anything changes). Every accepted ack is committed to
        the journal before this returns, all in one transaction. Then, when ``lease_more``
        > 0, up to that many shards of ``lease_dataset`` are leased to ``worker_id`` (no
        wait; ``request_id`` and ``merge_records`` as in :meth:`lease`); a
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
                    outcome = self._lease(worker_id, lease_dataset, lease_more, request_id, merge_records)
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
        """Shard and record counts for status (:func:`datasets.counts`; not for hot paths)."""
        return datasets.counts(self, ds, self.committed, self.acked_cursor(), self.finished(ds))

    def planned_records(self, ds: DatasetRecord) -> int:
        """Records in the dataset's planned extents (a stream's grows as it is planned)."""
        return ds.planned_records()

    def rates(self) -> tuple[float, float]:
        """(records acked per second, acks per second) over the last few seconds (``state.RATE_WINDOW``)."""
        now = self.clock()
        records, acks = self.ack_log.totals(now)
        span = min(RATE_WINDOW, max(now - self.started, 1e-3))
        return records / span, acks / span

    # ------------------------------------------------------------------ datasets (datasets.py)
    def register_dataset(
        self, spec: DatasetSpec, kind: SourceKind, partitions: list[Partition], schema_json: str, timed: bool = False
    ) -> tuple[DatasetRecord, bool]:
        """Register a dataset; returns (its record, whether it was created) (:func:`datasets.register`)."""
        return datasets.register(self, self.streams, spec, kind, partitions, schema_json, timed)

    def remove_dataset(self, name: str) -> tuple[int, int]:
        """Forget dataset ``name``; returns (leases revoked, shards removed) (:func:`datasets.remove`)."""
        return datasets.remove(self, self.cut_book, self.streams, self.staged, name)

    # ------------------------------------------------------------------ cuts (cuts.py)
    @property
    def committed(self) -> DataCursor:
        """The committed cursor (the cut book's)."""
        return self.cut_book.committed

    @property
    def cuts(self) -> dict[int, CutRecord]:
        """The cuts remembered, by id (the cut book's)."""
        return self.cut_book.cuts

    def acked_cursor(self, step: int | None = None) -> DataCursor:
        """The committed cursor plus every ack with ``step <= step`` (all acks when None)."""
        cursor = self.cut_book.committed.copy()
        self.add_acks(cursor, step)
        cursor.update(self.streams.upstream.lost)  # positions skipped as deleted upstream: the lost part (upstream.py)
        return cursor

    def cut_prepare(self, step: int | None = None, persisting: bool = False) -> CutRecord:
        """The cut of ``step``: a new one, or the one already taken for ``step`` since the last commit or restore.

        All ranks' acks with ``step <= step`` must be recorded before the first rank asks (a barrier after
        each rank flushed its acks): later calls for the same step return the first call's cursor.
        ``persisting``: its checkpoint will be persisted, so the cut is kept until it or a newer cut commits
        (a slow persist still commits); other prepared cuts beyond ``cuts.MAX_PREPARED_CUTS`` are evicted.
        """
        return self.cut_book.prepare(step, persisting, self.acked_cursor)

    def cut_commit(self, cut_id: int) -> DataCursor:
        """Commit cut ``cut_id`` (its checkpoint is durable): the committed cursor, its shards compacted away, and
        staged files no restore can need (that retention had at an earlier commit) compacted (compaction.py)."""
        committed = self.cut_book.commit(cut_id, self.fold)
        return self.committed.copy() if compact(self.staged) else committed

    def restore(
        self,
        cursor: DataCursor | None = None,
        cut_id: int | None = None,
        *,
        discard_committed: bool = False,
        from_memory: bool = False,
        snapshot_cut: int | None = None,
        snapshot_run: str | None = None,
    ) -> tuple[int, int]:
        """Reset to ``cursor`` (or the cursor of cut ``cut_id``). Returns (leases revoked, records requeued).

        Everything outside the cursor is to be read again: leases are revoked and the uncovered ranges are
        re-planned as fresh shards. ``from_memory``: ``cursor`` is of a shared-memory snapshot, not on storage:
        the upstream commit limit stays at the newest durable checkpoint's cursor, and a snapshot of another run
        (``snapshot_cut``, ``snapshot_run``: its cut and run ids) is refused (:meth:`CutBook.check_snapshot`). An
        empty cursor while the committed cursor is not empty is refused unless ``discard_committed`` (it throws
        all committed progress away).
        """
        if cursor is None:
            cursor = self.cut_book.cursor_of(cut_id)
        elif from_memory:
            self.cut_book.check_snapshot(cursor, snapshot_cut, snapshot_run)
        self.cut_book.check_reset(cursor, discard_committed)
        cursor = expand(cursor, self.datasets)  # staged files compacted since: in the compacted form (compaction.py)
        fencing.check_restorable(cursor, self.datasets)
        lost = self.streams.upstream.restore_lost(cursor)
        with self.journal.transaction():
            revoked = self.revoke_leases()
            rewound = [self.streams.rewind_to_holds(ds, cursor) for ds in list(self.datasets.values())]  # history.py
            requeued = sum(self.replan(ds, cursor.only(ds.name), lost, shuffle) for ds, shuffle in rewound)
            self.cut_book.reset(cursor, from_memory)
            self.streams.upstream.save_lost()
            self.save_counters()
        return revoked, requeued

    # ------------------------------------------------------------------ streams (streams.py, upstream.py)
    def extend_stream(self, name: str, polled: list[Partition], force: bool = False, timed: bool = False) -> int:
        """Plan new shards from a poll of the source's partitions and ends (:meth:`StreamPlanner.extend_stream`)."""
        return self.streams.extend_stream(name, polled, force, timed)

    def lag(self, ds: DatasetRecord) -> list[tuple[int, int, int]]:
        """Per partition: (available end, committed end, lag in records between them)."""
        return self.streams.lag(ds)

    def committed_positions(self, ds: DatasetRecord) -> dict[str, int]:
        """Per partition id: how far to commit upstream (:meth:`StreamPlanner.committed_positions`)."""
        return self.streams.committed_positions(ds)

    # ------------------------------------------------------------------ staged datasets (staged.py)
    @property
    def staged_commits(self) -> dict[tuple[str, str, str, int], tuple[int, list[str]]]:
        """(dataset, producer, part, epoch) -> (records, file URIs) of each staged commit."""
        return self.staged.staged_commits

    def commit_staged(self, name: str, producer: str, part: str, epoch: int, files: list[FileFacts]) -> StagedOutcome:
        """Commit the checked ``files`` under the key, or answer that the key was committed before."""
        return self.staged.commit_staged(name, producer, part, epoch, files)
