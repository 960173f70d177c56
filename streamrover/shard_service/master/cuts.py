"""The cut book: cuts, the committed cursor and the durable limits (ARCHITECTURE.md, the exactly-once contract).

A part of the core (``ShardCore.cut_book``) with its own state: the cut records, the committed cursor, the
durable and upstream cursors, the cut counters. It reads the shards only through what the core passes to a call
(the acked cursor to cut, the fold of a committed cursor into the shards).

- ``cut_prepare(step)``: the cursor of a model state = the committed cursor plus
  every ack with ``step <= step`` (all acks when ``step`` is None). Idempotent per step:
  every rank of a multi-rank checkpoint asks for the cut of its step and gets the same
  one (the first call fixes the cursor), so the ranks' parts form one checkpoint.
- ``cut_commit(cut_id)``: the checkpoint holding that cursor is durable; it
  becomes the committed cursor, and shards inside it are compacted away.
- ``restore(cursor)`` (the core, with :meth:`CutBook.reset`): everything outside the cursor is to be read
  again: leases are revoked and the uncovered ranges are re-planned as fresh shards.

The journal's **run id** (random, fixed when the journal is created; a journal from before it gets one when
first opened) is answered with every cut. A shared-memory snapshot records it with its cut id, and outlives
every process on purpose; a restore from such a snapshot names both, and :meth:`CutBook.check_snapshot`
refuses a snapshot of another run (a new run of the job on the same node, with a fresh journal).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from streamrover.cursor import DataCursor
from streamrover.shard_service.api import FailedPreconditionError, NotFoundError
from streamrover.shard_service.master import fencing
from streamrover.shard_service.master.bookkeeping import CutRecord, CutState
from streamrover.shard_service.master.journal import Journal

KEEP_COMMITTED_CUTS = 8
MAX_PREPARED_CUTS = 32  # cuts of snapshots not (yet) to be persisted: the oldest beyond this are evicted
MAX_PERSISTING_CUTS = 1024  # cuts being persisted: beyond this, ones in the middle are evicted (never the oldest)
KEEP_OLDEST_PERSISTING = 64  # the oldest persisting cuts are the ones whose persists are running
REMEMBER_FORGOTTEN = 256
PENDING = (CutState.PREPARED, CutState.PERSISTING)



class CutBook:
    """The cuts taken, the committed cursor, and the durable limits of upstream commits, over the journal."""

    def __init__(self, journal: Journal, clock: Callable[[], float]) -> None:
        self.journal = journal
        self.clock = clock
        self.committed = journal.load_cursor()
        self.cuts: dict[int, CutRecord] = {cut.id: cut for cut in journal.load_cuts()}
        self.forgotten_cuts: dict[int, str] = {}  # recently forgotten uncommitted cuts -> why (memory only, bounded)
        self.cut_commit_error = ""  # the last refused cut commit since the last successful one, and why
        self.last_commit_time = 0.0  # when the last cut committed (memory only)
        self._cut_seq = int(journal.get_meta("cut_seq") or 0)
        self.last_committed_cut = int(journal.get_meta("last_committed_cut") or 0)
        durable = journal.get_meta("durable_cursor")  # the newest checkpoint storage holds: the upstream limit
        self.durable = DataCursor.from_json(durable) if durable else self.committed.copy()
        upstream = journal.get_meta("upstream_cursor")  # the durable checkpoint before it: what upstream may hold
        self.upstream = DataCursor.from_json(upstream) if upstream else self.durable.copy()
        self.run_id = journal.get_meta("run_id") or ""
        if not self.run_id:
            self.run_id = os.urandom(8).hex()
            with journal.transaction():
                journal.put_meta("run_id", self.run_id)

    @property
    def seq(self) -> int:
        """The id of the newest cut taken (prepared or restored); a restore takes one."""
        return self._cut_seq

    def _save_counters(self) -> None:
        self.journal.put_meta("cut_seq", str(self._cut_seq))
        self.journal.put_meta("last_committed_cut", str(self.last_committed_cut))

    def prepare(self, step: int | None, persisting: bool, acked: Callable[[int | None], DataCursor]) -> CutRecord:
        """The cut of ``step``: a new one of cursor ``acked(step)``, or the one already taken for ``step`` since
        the last commit or restore (the core's :meth:`~streamrover.shard_service.master.core.ShardCore.cut_prepare`)."""
        if step is not None:
            same = self._cut_of_step(step)
            if same is not None:
                if persisting and same.state is CutState.PREPARED:
                    same.state = CutState.PERSISTING
                    with self.journal.transaction():
                        self.journal.put_cut(same)
                return same
        cursor = acked(step)
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

    def commit(self, cut_id: int, fold: Callable[[DataCursor], None]) -> DataCursor:
        """Commit cut ``cut_id`` (its checkpoint is durable); a refusal is kept for ``status`` with its reason.

        ``fold(committed)`` folds the new committed cursor into the shards, in the commit's journal transaction.
        """
        try:
            committed = self._commit(cut_id, fold)
        except (NotFoundError, FailedPreconditionError) as exc:
            self.cut_commit_error = str(exc)
            raise
        self.cut_commit_error = ""
        return committed

    def _commit(self, cut_id: int, fold: Callable[[DataCursor], None]) -> DataCursor:
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
            fold(self.committed)
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

    def persisting(self) -> int:
        """Prepared cuts whose checkpoints are being persisted."""
        return sum(1 for c in self.cuts.values() if c.state is CutState.PERSISTING)

    def _forget_cuts(self, keep_after: int) -> None:
        committed = sorted(c.id for c in self.cuts.values() if c.state is CutState.COMMITTED)
        stale = [c.id for c in self.cuts.values() if c.state in PENDING and c.id < keep_after]
        for cid in stale + committed[:-KEEP_COMMITTED_CUTS]:
            del self.cuts[cid]
            self.journal.delete_cut(cid)

    # ------------------------------------------------------------------ restore (the core's restore)
    def cursor_of(self, cut_id: int | None) -> DataCursor:
        """The cursor of remembered cut ``cut_id``; :class:`NotFoundError` when it is not remembered."""
        cut = self.cuts.get(cut_id or 0)
        if cut is None:
            raise NotFoundError(f"cut {cut_id} is not remembered; restore from the checkpoint's cursor instead")
        return cut.cursor

    def issued(self, cursor: DataCursor) -> bool:
        """Whether ``cursor`` is one this master issued: the committed, durable or upstream cursor, or a cut's."""
        known = [self.committed, self.durable, self.upstream, *(c.cursor for c in self.cuts.values())]
        return any(cursor == k for k in known)

    def check_snapshot(self, cursor: DataCursor, cut_id: int | None, run_id: str | None) -> None:
        """Refuse (:class:`FailedPreconditionError`) a restore from a shared-memory snapshot not of this run.

        ``run_id`` and ``cut_id`` are the snapshot's (None: not recorded). Another run id is another journal's
        snapshot: refused. Without a run id (a snapshot taken before run ids existed) the cut says what it can:
        a cut id this journal never reached, or a remembered cut whose cursor is not the snapshot's, is refused.
        With neither (a snapshot saved with a cursor of its own, or an older client) nothing can be told: taken.
        """
        if run_id and run_id != self.run_id:
            why = f"it was taken in run {run_id}, and this shard service's journal is of run {self.run_id}"
        elif cut_id and cut_id > self._cut_seq:
            why = f"its cut {cut_id} was never prepared by this shard service's journal (newest: {self._cut_seq})"
        elif cut_id and not run_id and cut_id in self.cuts and self.cuts[cut_id].cursor != cursor:
            why = f"its cursor is not the one of cut {cut_id} of this shard service's journal"
        else:
            return
        raise FailedPreconditionError(
            f"refusing to restore a shared-memory snapshot (cut {cut_id}) that is not of this run: {why}; its "
            "cursor says nothing of this run's records (a new run of the job on this node, with the same checkpoint "
            "path and job name?): restore from storage, or start fresh"
        )

    def check_reset(self, cursor: DataCursor, discard_committed: bool) -> None:
        """Refuse a reset to an empty cursor while the committed one is not empty, unless ``discard_committed``."""
        if not cursor.keys() and self.committed.keys() and not discard_committed:
            parts = len(self.committed.keys())
            raise FailedPreconditionError(
                f"refusing to reset to an empty cursor: it would throw away committed cut {self.last_committed_cut} "
                f"(progress in {parts} partition(s) of {', '.join(self.committed.datasets())}) and every record "
                "would be read again; if no checkpoint can be loaded because storage is unreachable, fix storage "
                "and restart; to start over on purpose pass discard_committed "
                "(`streamrover restore --empty --discard-committed`)"
            )

    def reset(self, cursor: DataCursor, from_memory: bool) -> None:
        """``cursor`` is committed by a restore (in the caller's transaction): pending cuts are discarded, and a
        committed cut of the cursor is taken. ``from_memory``: the durable limits stay where they were."""
        self.committed = cursor.copy()
        self.journal.put_cursor(self.committed)
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

    def forget_dataset(self, name: str) -> None:
        """Drop dataset ``name`` from the committed and durable cursors and every cut (its removal's transaction)."""
        if name in self.committed.datasets():
            self.committed = without_dataset(self.committed, name)
            self.journal.put_cursor(self.committed)
        if name in self.durable.datasets():
            self.durable = without_dataset(self.durable, name)
            self.journal.put_meta("durable_cursor", self.durable.to_json())
        for cut in self.cuts.values():  # a cut committed later must not bring the dataset back
            if name in cut.cursor.datasets():
                cut.cursor = without_dataset(cut.cursor, name)
                self.journal.put_cut(cut)


def without_dataset(cursor: DataCursor, name: str) -> DataCursor:
    """``cursor`` less every entry of dataset ``name``."""
    return DataCursor({k: v for k, v in cursor.items() if k.dataset != name})
