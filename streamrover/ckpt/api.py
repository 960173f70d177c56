"""The flash-checkpoint contract: what a checkpoint is, how it binds to the data cursor, its errors.

A *snapshot* is one rank's state at one training step, held in shared memory. A
*checkpoint* is a set of snapshots of the same step (one *part* per rank) persisted
to storage with a manifest; it exists exactly when its manifest exists. The manifest
holds the data cursor of that step, so a model state is never restored without the
positions whose effect is in it. A checkpoint's files never change once written: a
step saved to persist is not saved to persist again (the next one is numbered on).

Reading this module alone tells what the package promises; the rest is mechanism.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from streamrover.cursor import DataCursor

#: Bumped when the on-storage or shared-memory layout changes incompatibly.
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """Base class of every error this package raises."""


class SharedMemoryTooSmallError(CheckpointError):
    """``/dev/shm`` cannot hold the snapshot buffers; the message says how much is needed and how to fix it."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint on storage is partial or fails its checksums; the loader falls back to an older one."""


class StorageUnavailableError(CheckpointError):
    """Checkpoint storage kept failing (I/O errors, not missing files) through every retry. Nothing was
    skipped as corrupt: restoring an older checkpoint, or none, would throw progress away; fix storage."""


class NoCheckpointError(CheckpointError):
    """No consistent checkpoint exists, neither in shared memory nor on storage."""


class UnsupportedStateError(CheckpointError, TypeError):
    """The state holds a value that cannot be checkpointed (a key that is not str/int, an object...)."""


class SnapshotCopyError(CheckpointError):
    """The copy of a snapshot into shared memory failed (raised by the next save, step, load or wait after an
    overlapped save); that snapshot was never published, the previous one is still the newest."""


class SaverError(CheckpointError):
    """The saver process could not be started or reached, or reported a failed persist."""


class SnapshotRefusedError(CheckpointError):
    """Raised by a binder, not by this package: :meth:`CursorBinder.restore_cursor` refuses a shared-memory snapshot's
    cursor (``from_memory``) because the snapshot is not of the binder's run. :meth:`Checkpointer.load` then
    discards it and loads storage. ``ShardClient`` raises a subclass that is also the shard service's
    ``FailedPreconditionError``."""


class LoadedFrom(enum.Enum):
    """Where a loaded checkpoint came from."""

    MEMORY = "memory"
    STORAGE = "storage"


@runtime_checkable
class CursorBinder(Protocol):
    """The shard service as seen by checkpoints (``ShardClient`` implements it).

    The cut protocol (ARCHITECTURE.md, "The exactly-once contract", steps 2-4):

    * :meth:`prepare_cut` is called by :meth:`Checkpointer.save` before the state is
      copied; its cursor is stored with that snapshot (and so in the manifest). Every rank of
      a multi-rank checkpoint calls it for the same step and must get the same cut (the
      shard service's is idempotent per step), so the parts carry one cut id and the
      manifest is published. The caller makes sure every rank's acks for steps ``<= step``
      are recorded before the first rank saves (each rank flushes its acks, then a barrier).
    * :meth:`commit_cut` is called once the manifest holding that cursor is durable.
      It is called from a background thread, at most once per published manifest, by
      the rank whose saver published it; it must be idempotent (two savers finishing at
      the same moment may both publish the same manifest). A cut whose snapshot is
      superseded in memory before it is persisted is never committed: the shard service
      must tolerate abandoned cuts.
    * :meth:`restore_cursor` is called after a load, with the loaded cursor. For a shared-memory snapshot
      (``from_memory``) it names the snapshot's cut (``snapshot_cut``) and run (``snapshot_run``) when the
      snapshot has them: a binder with a ``run_id`` attribute (the run its cuts are prepared in, read after each
      :meth:`prepare_cut`) has it recorded in each snapshot. A snapshot that is not of the binder's run (it
      outlived an earlier run of the job on this node) must be refused with :class:`SnapshotRefusedError`:
      :meth:`Checkpointer.load` then discards it and loads storage instead (any other error it raises).
    """

    def prepare_cut(self, step: int | None, *, persisting: bool = False) -> tuple[int, DataCursor]:
        """Take a cut for ``step``: return its id and the cursor of positions applied up to it.

        ``persisting``: the snapshot will be persisted, so the cut must stay committable however slow
        the persist is (cuts of memory-only snapshots may be forgotten)."""
        ...

    def commit_cut(self, cut_id: int) -> object:
        """Mark cut ``cut_id`` committed: its manifest is durable (any return value is ignored).

        An error whose ``code`` is ``"NOT_FOUND"`` (the shard service's ``NotFoundError``) says the cut is no
        longer remembered because a restore came after it: the commit is superseded, not failed (the checkpoint
        stays durable; a later checkpoint commits a later cut). Any other error is a failure :meth:`wait` raises."""
        ...

    def restore_cursor(
        self,
        cursor: DataCursor,
        *,
        from_memory: bool = False,
        snapshot_cut: int | None = None,
        snapshot_run: str | None = None,
    ) -> object:
        """Reset the shard service to ``cursor``: everything acked or leased after it is read again.

        ``from_memory``: the cursor is of a shared-memory snapshot, not of a checkpoint on storage; the
        shard service then commits nothing upstream beyond the newest durable checkpoint's cursor.
        ``snapshot_cut``, ``snapshot_run``: that snapshot's cut id and run id (given only when it has one)."""
        ...


@dataclass(frozen=True)
class RetentionPolicy:
    """Which persisted checkpoints to keep.

    The newest ``keep_last`` checkpoints are kept, and so is every checkpoint whose
    step is a multiple of ``keep_every`` (when set). ``keep_last`` must be at least 1:
    the newest checkpoint is never deleted. Partial checkpoints (no manifest) older than
    the newest complete one are deleted too.

    The default keeps 3, and with a binder (the shard service) at least 2 are needed: upstream
    commits lag durable storage by one checkpoint (the broker is committed to the cursor of the
    checkpoint before the newest), so a fallback from a corrupt newest checkpoint to the one before
    it never needs records a broker may have deleted. ``keep_last=1`` with a binder warns.
    """

    keep_last: int = 3
    keep_every: int | None = None

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {self.keep_last}")
        if self.keep_every is not None and self.keep_every < 1:
            raise ValueError(f"keep_every must be >= 1 or None, got {self.keep_every}")

    def to_delete(self, steps: list[int]) -> list[int]:
        """Of the complete checkpoints at ``steps``, the ones this policy drops (ascending)."""
        ordered = sorted(set(steps))
        keep = set(ordered[-self.keep_last :])
        if self.keep_every:
            keep.update(s for s in ordered if s % self.keep_every == 0)
        return [s for s in ordered if s not in keep]


@dataclass(frozen=True)
class SnapshotRef:
    """A shared-memory snapshot that another process on the same node can map (:func:`~streamrover.ckpt.shared.
    load_shared`): its buffer's name, the seqlock generation it was read at and the snapshot's random id. A
    process on another node never matches it: a buffer of the same name there holds another id."""

    name: str
    generation: int
    uid: str


@dataclass
class LoadedCheckpoint:
    """What :meth:`Checkpointer.load` returns.

    ``state`` has the nested structure that was saved. With ``LoadedFrom.MEMORY`` and
    ``zero_copy=True`` its tensors are views of shared memory, valid until this
    rank's next save: copy them into the model (``load_state_dict`` does) first.
    ``snapshot`` (from memory): where other processes of this node can map the same snapshot.
    """

    step: int
    state: dict[str, Any]
    cursor: DataCursor
    source: LoadedFrom
    cut_id: int | None = None
    path: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    snapshot: SnapshotRef | None = None


@dataclass(frozen=True)
class PersistResult:
    """The saver's report on one persist of one rank's snapshot."""

    step: int
    ok: bool
    manifest_published: bool
    cut_id: int | None
    error: str | None = None
