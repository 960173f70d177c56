"""The trainer-facing API: save to memory (and storage), load the newest consistent checkpoint, wait.

>>> ckpt = Checkpointer("/data/ckpt", rank=0, world_size=1, binder=shard_client)
>>> ckpt.save(step, {"model": model.state_dict(), "optim": optim.state_dict()})   # blocks for a memcpy
>>> TorchCheckpoint(ckpt, model, optim, overlap=True).save(step)   # copies params in the background
>>> loaded = ckpt.load()          # newest of shared memory and storage; resets the shard service's cursor
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

from streamrover.ckpt.api import (
    CheckpointError,
    CorruptCheckpointError,
    CursorBinder,
    LoadedCheckpoint,
    LoadedFrom,
    NoCheckpointError,
    PersistResult,
    RetentionPolicy,
    SaverError,
    SnapshotRefusedError,
)
from streamrover.ckpt.layout import complete_steps, read_manifest, read_part
from streamrover.ckpt.link import SaverLink
from streamrover.ckpt.memory import MemoryEngine, Snapshot, SnapshotWrite
from streamrover.ckpt.storage import CHECKSUM_ALGO, Storage
from streamrover.ckpt.wire import namespace_for, saver_address
from streamrover.cursor import DataCursor

log = logging.getLogger(__name__)
MAX_RESULTS = 64  # persist reports kept between two wait() calls (see Checkpointer._results)


class CheckpointFallbackWarning(UserWarning):
    """A checkpoint was skipped at load (partial or corrupted); an older one is used."""


class Checkpointer:
    """Flash checkpoints of one rank.

    Args:
        url: checkpoint root: a local directory, or any fsspec URL (``s3://...``).
        rank, world_size: this rank and the number of ranks whose parts form one checkpoint.
        binder: the shard service (``ShardClient``); when given, every save takes a cut and
            every published manifest commits it, and :meth:`load` restores the cursor.
        retention: which persisted checkpoints to keep.
        num_buffers: shared-memory snapshot buffers of this rank (>= 2: double buffering).
        saver: ``"auto"`` (connect to this node's saver, start one if none: the default),
            ``"thread"`` (a private in-process saver: persists do not survive this process),
            or ``"agent"`` (connect to the saver an elastic agent hosts; never start one).
        job: a job name that separates namespaces of jobs sharing a root on one node.
        linger: seconds an auto-started saver stays up with no trainer connected.
        persist_on_exit: the saver persists unpersisted snapshots when this trainer dies.
        on_durable: called with the step of every checkpoint whose manifest this rank's saver published (after
            its cut is committed), on a background thread: a serving exporter's hook (streamrover.serving). It
            must not block for long; an exception from it is logged, never raised into training.
    """

    def __init__(
        self,
        url: str,
        *,
        rank: int = 0,
        world_size: int = 1,
        binder: CursorBinder | None = None,
        retention: RetentionPolicy | None = None,
        num_buffers: int = 2,
        saver: str = "auto",
        job: str | None = None,
        linger: float = 600.0,
        persist_on_exit: bool = True,
        storage_options: dict[str, Any] | None = None,
        checksum: str = CHECKSUM_ALGO,
        on_durable: Callable[[int], None] | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if saver not in ("auto", "thread", "agent"):
            raise ValueError(f"saver must be 'auto', 'thread' or 'agent', got {saver!r}")
        self.url = url
        self.rank = rank
        self.world_size = world_size
        self.binder = binder
        self.retention = retention or RetentionPolicy()
        if binder is not None and self.retention.keep_last < 2 and not self.retention.keep_every:
            log.warning(
                "RetentionPolicy(keep_last=%d) with a binder: upstream commits lag storage by one checkpoint, so a "
                "fallback from a corrupt newest checkpoint needs the one before it; keep_last >= 2 keeps it",
                self.retention.keep_last,
            )
        self.namespace = namespace_for(url, job)
        self.storage = Storage(url, storage_options)
        self.engine = MemoryEngine(self.namespace, rank, num_buffers)
        self._saver_mode = saver
        self._linger = linger
        self._persist_on_exit = persist_on_exit
        self._storage_options = storage_options
        self._checksum = checksum
        self.on_durable = on_durable
        self._link: SaverLink | None = None
        self._cond = threading.Condition()
        self._busy: set[int] = set()  # buffers the saver is reading
        self._want_persist = False
        self._newest: Snapshot | None = None
        # reports since the last wait(): the newest MAX_RESULTS, and the first MAX_RESULTS failures (never lost to
        # newer successes), so a loop that saves and never waits keeps constant memory
        self._results: deque[PersistResult] = deque(maxlen=MAX_RESULTS)
        self._failures: list[PersistResult] = []
        self._lost: str | None = None
        self._pending: SnapshotWrite | None = None
        self._persisted_step: int | None = None  # the last step saved with persist

    # -- save ------------------------------------------------------------------------
    def prepare(self, state: Any) -> None:
        """Allocate and pre-fault the snapshot buffers for ``state`` now (optional; else on first save)."""
        self.engine.prepare(state)

    def save(
        self,
        step: int,
        state: Any,
        *,
        cursor: DataCursor | None = None,
        persist: bool = True,
        meta: dict[str, Any] | None = None,
        defer: Callable[[Any], bool] | None = None,
    ) -> None:
        """Snapshot ``state`` at ``step`` into shared memory; with ``persist``, have the saver write it out.

        Blocks for the copy into shared memory (and, with a binder, its ``prepare_cut``): by default
        the snapshot is complete and visible when this returns.

        Overlapped saves (``defer``): the torch tensors for which ``defer(tensor)`` is true are copied
        by a background thread after this returns, while training goes on; everything else is copied
        before it returns. The caller promises not to mutate a deferred tensor until
        :meth:`wait_snapshot` has returned, which the next :meth:`save`, :meth:`load`, :meth:`wait` and
        :meth:`close` call first. The header that makes the snapshot visible (to a restarted trainer
        and to the saver) is written only once the whole copy is done, so a crash during the
        background copy leaves the previous snapshot the newest. :class:`TorchCheckpoint` with
        ``overlap=True`` uses this safely: it defers only the optimizer's parameters and state, and an
        optimizer step pre-hook calls :meth:`wait_snapshot` before they are mutated.
        """
        if persist and step == self._persisted_step:  # its files would change under readers (exports, restores)
            raise CheckpointError(f"step {step} was already saved to persist: a durable checkpoint is never rewritten")
        self.wait_snapshot()
        cut_id: int | None = None
        run_id: str | None = None
        if cursor is None and self.binder is not None:
            cut_id, cursor = self.binder.prepare_cut(step, persisting=persist)
            run_id = getattr(self.binder, "run_id", None)  # the cut's run (CursorBinder): checked at a restore
        with self._cond:
            if persist:
                self._ensure_link()  # in this thread: a saver it starts must not be a child of a copy thread
            index = self.engine.choose(self._busy)
            if self._newest is not None and self._newest.index == index:
                # Overwritten from now on (in the background with defer): never dispatch it. A persist still
                # wanted goes to the snapshot that replaces it, once published.
                self._newest = None
            self._pending = self.engine.write(
                index,
                step,
                state,
                {
                    "world_size": self.world_size,
                    "cursor": cursor.to_json() if cursor is not None else None,
                    "cut_id": cut_id,
                    "run_id": run_id,
                    "meta": meta or {},
                },
                defer=defer,
                on_published=lambda snap: self._published(snap, persist),
            )
        self._persisted_step = step if persist else self._persisted_step
        if not self._pending.deferred:  # nothing left to the background: published already
            self.wait_snapshot()

    def _published(self, snap: Snapshot, persist: bool) -> None:
        with self._cond:
            self._newest = snap
            if persist:
                self._want_persist = True
                self._dispatch_locked()

    def wait_snapshot(self) -> None:
        """Return once the last save's snapshot is complete and visible; the copy's remaining chunks are
        done by this thread too. Raises :class:`SnapshotCopyError` (once) if that copy failed."""
        pending = self._pending
        if pending is None:
            return
        try:
            pending.wait()
        finally:
            self._pending = None

    @property
    def snapshot_pending(self) -> bool:
        """True while an overlapped save's background copy has not been waited for."""
        return self._pending is not None

    def _ensure_link(self) -> None:
        if self._link is not None and self._lost is not None:
            # The saver died (or never came up): try a new one; wait() has reported or will report the loss
            # of the persist that was running. The wanted snapshot is re-sent once connected.
            log.warning("reconnecting to a checkpoint saver after: %s", self._lost)
            self._link.close()
            self._link = None
            self._lost = None
        if self._link is not None:
            return
        address = saver_address(self.namespace)
        if self._saver_mode == "thread":
            address = f"{address}-thread-{os.getpid()}-{id(self)}"
        hello = {
            "namespace": self.namespace,
            "rank": self.rank,
            "world_size": self.world_size,
            "url": self.url,
            "storage_options": self._storage_options,
            "buffers": self.engine.names(),
            "retention": {"keep_last": self.retention.keep_last, "keep_every": self.retention.keep_every},
            "checksum": self._checksum,
            "persist_on_exit": self._persist_on_exit,
        }
        self._link = SaverLink(
            hello,
            self._saver_mode,
            address,
            self._linger,
            on_ready=self._on_ready,
            on_done=self._on_done,
            on_lost=self._on_lost,
        )

    def _dispatch_locked(self) -> None:
        link = self._link
        if not self._want_persist or self._busy or link is None or not link.ready() or self._newest is None:
            return
        snap = self._newest
        self._busy.add(snap.index)
        self._want_persist = False
        link.send_persist(snap.index, snap.name, snap.generation, snap.step)

    def _on_ready(self) -> None:
        with self._cond:
            self._dispatch_locked()

    def _on_done(self, index: int, result: PersistResult) -> None:
        results = [result]
        if result.ok and result.manifest_published and result.cut_id is not None and self.binder is not None:
            try:  # before the persist counts as done, so wait() returns only after the commit
                self.binder.commit_cut(int(result.cut_id))
            except Exception as exc:  # any binder failure is reported by wait(); a later manifest commits a later cut
                if getattr(exc, "code", None) == "NOT_FOUND":  # the cut was forgotten: a restore came after it
                    log.info("commit_cut(%s) for step %d superseded: %s", result.cut_id, result.step, exc)
                else:
                    log.warning("commit_cut(%s) for step %d failed: %s", result.cut_id, result.step, exc)
                    results.append(PersistResult(result.step, False, True, result.cut_id, f"commit_cut: {exc}"))
        if result.ok and result.manifest_published and self.on_durable is not None:
            try:
                self.on_durable(result.step)
            except Exception:  # a hook's failure must not fail the persist (it is the hook's to report)
                log.exception("on_durable(%d) failed", result.step)
        with self._cond:
            self._busy.discard(index)
            self._results.extend(results)
            self._failures.extend(r for r in results if not r.ok)
            del self._failures[MAX_RESULTS:]
            self._dispatch_locked()
            self._cond.notify_all()

    def _on_lost(self, error: str) -> None:
        with self._cond:
            self._lost = error
            self._busy.clear()
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> list[PersistResult]:
        """Wait until every requested persist is done; return the reports since the last wait.

        Raises :class:`SaverError` if a persist failed or the saver is gone, and
        ``TimeoutError`` if ``timeout`` passes first. An overlapped save's copy is completed first.
        """
        self.wait_snapshot()
        with self._cond:
            done = self._cond.wait_for(
                lambda: self._lost is not None or (not self._busy and not self._want_persist), timeout
            )
            if not done:
                raise TimeoutError(f"persists still running after {timeout} s")
            results, failed = list(self._results), self._failures
            self._results.clear()
            self._failures = []
            if self._lost is not None:
                raise SaverError(self._lost)
        if failed:
            raise SaverError("; ".join(f"step {r.step}: {r.error}" for r in failed))
        return results

    # -- load ------------------------------------------------------------------------
    def load(
        self, *, part: int | None = None, zero_copy: bool = False, restore: bool = True, memory: bool = True
    ) -> LoadedCheckpoint:
        """The newest consistent checkpoint of this rank (or of rank ``part``).

        Shared memory wins when its snapshot is at least as new as the newest checkpoint on
        storage (a process restart on a live node); storage otherwise. Partial or corrupted
        checkpoints are skipped with a :class:`CheckpointFallbackWarning`. With a binder and
        ``restore``, the shard service is reset to the loaded cursor. When storage wins, this
        rank's memory snapshots of later steps are invalidated: training resumes from the loaded
        step, and a snapshot of the abandoned run must not be persisted or loaded later.

        A shared-memory snapshot the shard service refuses to restore (:class:`SnapshotRefusedError`: it is not
        of this run, e.g. left on this node by an earlier run of the job with the same URL and job name) is
        discarded with every snapshot of its rank, and storage is loaded instead (:class:`NoCheckpointError`
        when storage holds none: start fresh).
        """
        self.wait_snapshot()  # the caller will mutate what an overlapped save may still be copying
        part = self.rank if part is None else part
        loaded = self._load(part, zero_copy, memory)
        self._persisted_step = None if restore else self._persisted_step  # a step reached again is saved anew
        if loaded.source == LoadedFrom.MEMORY and restore and self.binder is not None:
            run = loaded.extra.get("run_id")  # the snapshot's cut and run, named when it has them (CursorBinder)
            named: dict[str, Any] = {"snapshot_cut": loaded.cut_id, "snapshot_run": run} if loaded.cut_id or run else {}
            try:
                self.binder.restore_cursor(loaded.cursor, from_memory=True, **named)
                return loaded
            except SnapshotRefusedError as exc:
                log.warning("the shared-memory snapshot of step %d (cut %s of run %s, rank %d) is refused by the "
                            "shard service: %s; it is not of this run: discarded (with this rank's other "
                            "snapshots), loading from storage instead (starting fresh when storage holds none)",
                            loaded.step, loaded.cut_id, run, part, exc)  # fmt: skip
                self._drop_snapshots(-1, part)
            loaded = self._load(part, zero_copy, memory=False)
        if loaded.source == LoadedFrom.STORAGE:
            self._drop_snapshots(loaded.step)
        if restore and self.binder is not None:
            self.binder.restore_cursor(loaded.cursor)
        return loaded

    def _drop_snapshots(self, after: int, part: int | None = None) -> None:
        """Invalidate this rank's (or rank ``part``'s) snapshots of steps > ``after``: training resumes from
        ``after`` (-1: none is of this run), so none of them may be loaded later, nor persisted after a death."""
        engine = self.engine
        if part not in (None, self.rank):
            engine = MemoryEngine(self.namespace, int(part or 0), engine.num_buffers)
        with self._cond:
            for snap in engine.snapshots():
                buf = engine.buffers[snap.index]
                if snap.step > after and buf is not None and not (engine is self.engine and snap.index in self._busy):
                    buf.invalidate()

    def _memory_snapshot(self, part: int) -> tuple[MemoryEngine, Snapshot] | None:
        engine = self.engine if part == self.rank else MemoryEngine(self.namespace, part, self.engine.num_buffers)
        engine.attach()
        snap = engine.newest()
        if snap is None or int(snap.header.get("world_size", -1)) != self.world_size:
            return None
        return engine, snap

    def _load(self, part: int, zero_copy: bool, memory: bool) -> LoadedCheckpoint:
        mem = self._memory_snapshot(part) if memory else None
        skipped: list[str] = []
        for step in reversed(complete_steps(self.storage)):
            if mem is not None and mem[1].step >= step:
                break
            try:
                manifest = read_manifest(self.storage, step)
                if manifest["world_size"] != self.world_size:
                    raise CorruptCheckpointError(
                        f"step {step} has world size {manifest['world_size']}, not {self.world_size}"
                    )
                doc, state, cursor = read_part(self.storage, manifest, part)
            except (CorruptCheckpointError, FileNotFoundError) as exc:  # not StorageUnavailableError: never skipped
                msg = f"skipping checkpoint at step {step}: {exc}"
                warnings.warn(msg, CheckpointFallbackWarning, stacklevel=3)
                log.warning(msg)
                skipped.append(msg)
                continue
            cut_ids = manifest.get("cut_ids") or []
            return LoadedCheckpoint(
                step,
                state,
                cursor,
                LoadedFrom.STORAGE,
                cut_ids[0] if cut_ids else None,
                self.storage.join(f"step-{step:012d}"),
                {"skipped": skipped, "meta": doc.get("meta")},
            )
        if mem is not None:
            engine, snap = mem
            state = engine.load(snap, zero_copy)
            cursor_json = snap.header.get("cursor")
            cursor = DataCursor.from_json(cursor_json) if cursor_json else DataCursor()
            return LoadedCheckpoint(
                snap.step,
                state,
                cursor,
                LoadedFrom.MEMORY,
                snap.header.get("cut_id"),
                None,
                {"skipped": skipped, "meta": snap.header.get("meta"), "run_id": snap.header.get("run_id")},
                snap.ref(),
            )
        raise NoCheckpointError(
            f"no consistent checkpoint for rank {part} in shared memory or at {self.url!r}"
            + (f" ({len(skipped)} skipped as corrupt)" if skipped else "")
        )

    @property
    def saver_pid(self) -> int | None:
        """The pid of the saver serving this rank, once connected."""
        return self._link.saver_pid if self._link is not None else None

    # -- lifecycle -------------------------------------------------------------------
    def close(self, unlink: bool = False) -> None:
        """Wait for pending persists and disconnect; with ``unlink``, free the shared memory too.

        Without ``unlink`` the snapshots stay in shared memory for a restarted trainer;
        an auto-started saver removes them when it exits after ``linger`` idle seconds.
        """
        try:
            try:
                self.wait_snapshot()  # an overlapped save's copy failure is raised, after the disconnect below
            finally:
                self.engine._join_prefault()  # a buffer still being allocated in the background is finished first
            if self._link is not None and self._lost is None:
                self.wait()
        finally:
            if self._link is not None:
                self._link.close(keep=not unlink)
                self._link = None
            if unlink:
                self.engine.unlink()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["CheckpointError", "CheckpointFallbackWarning", "Checkpointer"]
