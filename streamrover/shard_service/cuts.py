"""Cut, commit and restore: binding model states to data cursors (ARCHITECTURE.md, the exactly-once contract).

- ``cut_prepare(step)``: the cursor of a model state = the committed cursor plus
  every ack with ``step <= step`` (all acks when ``step`` is None). Idempotent per step:
  every rank of a multi-rank checkpoint asks for the cut of its step and gets the same
  one (the first call fixes the cursor), so the ranks' parts form one checkpoint.
- ``cut_commit(cut_id)``: the checkpoint holding that cursor is durable; it
  becomes the committed cursor, and shards inside it are compacted away.
- ``restore(cursor)``: everything outside the cursor is to be read again: leases
  are revoked and the uncovered ranges are re-planned as fresh shards.
"""

from __future__ import annotations

import itertools

from streamrover.cursor import DataCursor, IntervalSet
from streamrover.shard_service import fencing
from streamrover.shard_service.api import FailedPreconditionError, NotFoundError, ShardState
from streamrover.shard_service.bookkeeping import CutRecord, CutState, DatasetRecord
from streamrover.shard_service.planner import plan_epoch
from streamrover.shard_service.state import CoreState
from streamrover.sources.api import SourceKind

KEEP_COMMITTED_CUTS = 8
MAX_PREPARED_CUTS = 32  # cuts of snapshots not (yet) to be persisted: the oldest beyond this are evicted
MAX_PERSISTING_CUTS = 1024  # cuts being persisted: beyond this, ones in the middle are evicted (never the oldest)
KEEP_OLDEST_PERSISTING = 64  # the oldest persisting cuts are the ones whose persists are running
REMEMBER_FORGOTTEN = 256
PENDING = (CutState.PREPARED, CutState.PERSISTING)


class CutOps(CoreState):
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
        cursor.update(self.lost)  # positions skipped as deleted upstream: in the cursor's lost part (upstream.py)
        return cursor

    def cut_prepare(self, step: int | None = None, persisting: bool = False) -> CutRecord:
        """The cut of ``step``: a new one, or the one already taken for ``step`` since the last commit or restore.

        All ranks' acks with ``step <= step`` must be recorded before the first rank asks (a barrier after
        each rank flushed its acks): later calls for the same step return the first call's cursor.
        ``persisting``: its checkpoint will be persisted, so the cut is kept until it or a newer cut commits
        (a slow persist still commits); other prepared cuts beyond :data:`MAX_PREPARED_CUTS` are evicted.
        """
        if step is not None:
            same = self._cut_of_step(step)
            if same is not None:
                if persisting and same.state is CutState.PREPARED:
                    same.state = CutState.PERSISTING
                    with self.journal.transaction():
                        self.journal.put_cut(same)
                return same
        cursor = self.acked_cursor(step)
        self._cut_seq += 1
        cut = CutRecord(self._cut_seq, step, cursor, CutState.PERSISTING if persisting else CutState.PREPARED)
        self.cuts[cut.id] = cut
        with self.journal.transaction():
            self.journal.put_cut(cut)
            self._evict_cuts()
            self._save_counters()
        return cut

    def _evict_cuts(self) -> None:
        prepared = sorted(c.id for c in self.cuts.values() if c.state is CutState.PREPARED)
        for old in prepared[:-MAX_PREPARED_CUTS]:
            self._forget_cut(old, f"evicted: more than {MAX_PREPARED_CUTS} newer cuts were prepared, not persisting")
        persisting = sorted(c.id for c in self.cuts.values() if c.state is CutState.PERSISTING)
        excess = len(persisting) - MAX_PERSISTING_CUTS
        for old in persisting[KEEP_OLDEST_PERSISTING : KEEP_OLDEST_PERSISTING + max(excess, 0)]:
            self._forget_cut(old, f"evicted: more than {MAX_PERSISTING_CUTS} cuts were being persisted at once")

    def _forget_cut(self, cut_id: int, why: str) -> None:
        """Forget an uncommitted cut (with the journal transaction open), remembering why for a late commit."""
        cut = self.cuts.pop(cut_id)
        self.journal.delete_cut(cut_id)
        self.forgotten_cuts[cut_id] = f"cut {cut_id} (step {cut.step}) was {why}"
        while len(self.forgotten_cuts) > REMEMBER_FORGOTTEN:
            del self.forgotten_cuts[next(iter(self.forgotten_cuts))]

    def _cut_of_step(self, step: int) -> CutRecord | None:
        """The prepared cut of ``step`` (or the last committed cut, if it is of ``step``), if any."""
        for cut in sorted(self.cuts.values(), key=lambda c: -c.id):
            if cut.step == step and (cut.state in PENDING or cut.id == self.last_committed_cut):
                return cut
        return None

    def cut_commit(self, cut_id: int) -> DataCursor:
        """Commit cut ``cut_id`` (its checkpoint is durable); a refusal is kept for ``status`` with its reason."""
        try:
            committed = self._cut_commit(cut_id)
        except (NotFoundError, FailedPreconditionError) as exc:
            self.cut_commit_error = str(exc)
            raise
        self.cut_commit_error = ""
        return committed

    def _cut_commit(self, cut_id: int) -> DataCursor:
        cut = self.cuts.get(cut_id)
        if cut is None:
            if cut_id in self.forgotten_cuts:
                raise NotFoundError(f"cannot commit: {self.forgotten_cuts[cut_id]}")
            if cut_id <= self.last_committed_cut:
                raise FailedPreconditionError(
                    f"cut {cut_id} is older than the committed cut {self.last_committed_cut} and was discarded"
                )
            if cut_id > self._cut_seq:
                raise NotFoundError(f"cut {cut_id} was never prepared by this shard service (newest: {self._cut_seq})")
            raise NotFoundError(f"cut {cut_id} is no longer remembered (forgotten before the master restarted)")
        if cut.state is CutState.COMMITTED:
            return self.committed.copy()
        if cut_id < self.last_committed_cut:
            raise FailedPreconditionError(f"cut {cut_id} is older than the committed cut {self.last_committed_cut}")
        missing = fencing.not_contained(self.committed, cut.cursor)
        if missing:
            raise FailedPreconditionError(
                f"cut {cut_id} does not contain the committed cursor (e.g. {missing}); commit a newer cut"
            )
        with self.journal.transaction():
            cut.state = CutState.COMMITTED
            self.journal.put_cut(cut)
            self.last_committed_cut = cut_id
            self.last_commit_time = self.clock()
            self.committed = cut.cursor.copy()
            self.journal.put_cursor(self.committed)
            self._set_durable(self.committed, previous=self.durable)
            self._fold_committed()
            self._forget_cuts(keep_after=cut_id)
            self._save_counters()
        return self.committed.copy()

    def _set_durable(self, cursor: DataCursor, previous: DataCursor | None = None) -> None:
        """``cursor`` is the newest durable checkpoint's; ``previous`` the one before it (None: ``cursor`` was
        just loaded whole from storage, so it is both).

        The upstream limit is the previous durable checkpoint's cursor: upstream commits lag durable storage by
        one checkpoint, so a fallback from a corrupt newest checkpoint to the one before it (which retention
        keeps: ``RetentionPolicy.keep_last`` >= 2) never needs records a broker may have deleted.
        """
        self.durable = cursor.copy()
        self.upstream = (cursor if previous is None else previous).copy()
        self.journal.put_meta("durable_cursor", self.durable.to_json())
        self.journal.put_meta("upstream_cursor", self.upstream.to_json())

    def persisting_cuts(self) -> int:
        """Prepared cuts whose checkpoints are being persisted."""
        return sum(1 for c in self.cuts.values() if c.state is CutState.PERSISTING)

    def _fold_committed(self) -> None:
        for sid in sorted(self.unfolded):
            s = self.shards[sid]
            covered = self.committed.get(self._key(s))
            s.acks = [(st, pos) for st, pos in s.acks if not covered.covers(s.start, pos)]
            if s.state is ShardState.ACKED and covered.covers(s.start, s.end):
                self._drop_shard(sid)
                self.journal.delete_shard(sid)
                continue
            if not s.acks:
                self.unfolded.discard(sid)
            self.journal.put_shard(s)

    def _forget_cuts(self, keep_after: int) -> None:
        committed = sorted(c.id for c in self.cuts.values() if c.state is CutState.COMMITTED)
        stale = [c.id for c in self.cuts.values() if c.state in PENDING and c.id < keep_after]
        for cid in stale + committed[:-KEEP_COMMITTED_CUTS]:
            del self.cuts[cid]
            self.journal.delete_cut(cid)

    # ------------------------------------------------------------------ restore
    def restore(
        self,
        cursor: DataCursor | None = None,
        cut_id: int | None = None,
        *,
        discard_committed: bool = False,
        from_memory: bool = False,
    ) -> tuple[int, int]:
        """Reset to ``cursor`` (or the cursor of cut ``cut_id``). Returns (leases revoked, records requeued).

        ``from_memory``: ``cursor`` is of a shared-memory snapshot, not on storage: the upstream commit limit
        stays at the newest durable checkpoint's cursor. An empty cursor while the committed cursor is not
        empty is refused unless ``discard_committed`` (it throws all committed progress away).
        """
        if cursor is None:
            cut = self.cuts.get(cut_id or 0)
            if cut is None:
                raise NotFoundError(f"cut {cut_id} is not remembered; restore from the checkpoint's cursor instead")
            cursor = cut.cursor
        if not cursor.keys() and self.committed.keys() and not discard_committed:
            parts = len(self.committed.keys())
            raise FailedPreconditionError(
                f"refusing to reset to an empty cursor: it would throw away committed cut {self.last_committed_cut} "
                f"(progress in {parts} partition(s) of {', '.join(self.committed.datasets())}) and every record "
                "would be read again; if no checkpoint can be loaded because storage is unreachable, fix storage "
                "and restart; to start over on purpose pass discard_committed "
                "(`streamrover restore --empty --discard-committed`)"
            )
        fencing.check_restorable(cursor, self.datasets)
        self.lost.update(DataCursor(lost=dict(cursor.lost_items())))  # (a checkpoint taken on another master's state)
        revoked = 0
        requeued = 0
        with self.journal.transaction():
            for sid in sorted(self.leased):
                s = self.shards[sid]
                w = self.workers.get(s.worker or "")
                if w is not None:
                    w.leases.discard(sid)
                    w.revoked.add((sid, s.attempt))
                revoked += 1
            self.leased.clear()
            for ds in self.datasets.values():
                requeued += self._replan(ds, cursor.only(ds.name))
            self.committed = cursor.copy()
            self.journal.put_cursor(self.committed)
            self.journal.put_meta("lost_cursor", self.lost.to_json())
            # A memory snapshot is not on storage: the limits stay where they were, and are journalled even before
            # any cut committed (a restart would otherwise take the restored cursor for durable).
            if from_memory:
                self._set_durable(self.durable, previous=self.upstream)
            else:
                self._set_durable(cursor)
            for cid in [c.id for c in self.cuts.values() if c.state in PENDING]:
                self._forget_cut(cid, f"discarded by a restore (cut {self._cut_seq + 1})")
            self._cut_seq += 1
            restored = CutRecord(self._cut_seq, None, cursor.copy(), CutState.COMMITTED)
            self.cuts[restored.id] = restored
            self.journal.put_cut(restored)
            self.last_committed_cut = restored.id
            self._forget_cuts(keep_after=restored.id)
            self._save_counters()
        return revoked, requeued

    def _replan(self, ds: DatasetRecord, cursor: DataCursor) -> int:
        for sid in sorted(self.by_dataset[ds.name]):
            self.restore_revoked.add(sid)
            self._drop_shard(sid)
        self._new_dataset_indexes(ds.name)
        self.journal.delete_shards_of(ds.name)
        done = {(k.epoch, k.partition): ivs.copy() for k, ivs in cursor.items()}
        for k, ivs in self.lost.only(ds.name).lost_items():  # deleted upstream: never planned again
            done.setdefault((k.epoch, k.partition), IntervalSet()).update(ivs)
        if ds.kind is SourceKind.BATCH:
            ds.epochs_planned = max([k.epoch + 1 for k in cursor.keys()] + [1])
        planned = list(
            itertools.chain.from_iterable(
                plan_epoch(ds.partitions, e, ds.shard_size, ds.spec.shuffle, ds.spec.seed, done, ds.runs)
                for e in range(ds.epochs_planned)
            )
        )
        self._add_planned(ds, planned)
        self.journal.put_dataset(ds)
        self.restore_revoked -= self.by_dataset[ds.name]
        return sum(p.records for p in planned)
