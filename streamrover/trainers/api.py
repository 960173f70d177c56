"""The trainer contract: what a trainer does so that every record's effect is in the model exactly once.

A trainer glues a framework's training loop to the shard service
(:class:`~streamrover.shard_service.api.ShardService`) and to flash checkpoints
(:mod:`streamrover.ckpt`). Whatever the framework, it keeps four rules, in this order
(ARCHITECTURE.md, "The exactly-once contract"); both trainers here follow them:
:class:`~streamrover.trainers.torch.session.StreamSession` (synchronous data parallel: every rank
acks its own records) and :class:`~streamrover.trainers.tensorflow.trainer.PSTrainer` (parameter
server: the chief acks for every worker).

1. **Restore before lease** (:func:`restore_before_lease`). Load the newest checkpoint and reset
   the shard service to its cursor, or to the empty cursor when there is none (a crashed first
   round's acks are forgotten), before any process of the job leases a shard: the reset revokes
   every lease of the previous round, and a shard leased before it would be read from a position
   the model has not seen. With several ranks, one rank restores and a barrier (or the broadcast
   of the restored state) holds the others back until it did.
2. **Ack after the step.** Ack a record's position only after the optimizer step that applied it,
   tagged with that step's number (:meth:`~streamrover.shard_service.api.Shard.ack`): a cut of
   step S holds exactly the acks of steps <= S. A lease lost under applied records
   (:class:`~streamrover.shard_service.api.LeaseLostError`) means the model holds records the
   service will hand out again: roll back to the last checkpoint (PS), or fail the step so the
   group restarts and restores (torch).
3. **Flush and barrier before the cut** (:func:`flush_before_cut`). Every process that acks waits
   until the master recorded its queued acks, then a barrier lets the one process that takes the
   cut (``prepare_cut`` of step S, inside :meth:`~streamrover.ckpt.Checkpointer.save`) go on. A
   refused ack there means applied records are not acked: the state is lost, restart from the
   last checkpoint. Where one process acks everything (the PS chief) ``prepare_cut``'s own flush
   is the whole rule.
4. **Commit after durability.** A cut is committed only once the checkpoint holding its cursor
   is durable: the checkpointer's saver calls ``commit_cut`` when the manifest is published. A
   trainer never commits a cut itself, and never commits offsets to the broker (the shard service
   does, after the commit, up to the previous durable checkpoint).

Uneven inputs (synchronous data parallelism): a rank with no records must not hold back the ranks
that have some, and must not change the update. The torch trainer steps an idle rank at once with an
empty batch (its datasets agree on every step with one small all-reduce) and weighs each rank's
gradient by its share of the step's records (:mod:`streamrover.trainers.torch.lockstep`). The user's
script changes nothing.

Frameworks that own the training loop (Lightning, the Hugging Face ``Trainer``) keep the rules through
their own hooks, with :class:`~streamrover.trainers.flash.FlashRun` doing the work:
:class:`~streamrover.trainers.lightning.FlashCheckpoint` (a Lightning ``Callback``; its storage half is
:class:`~streamrover.trainers.lightning.FlashCheckpointIO`) and :class:`~streamrover.trainers.hf.FlashTrainer`
(a ``Trainer`` subclass). What they promise: the framework's whole checkpoint (weights, optimizer,
scheduler, its loop state) is snapshotted into shared memory every ``every_n_steps`` global steps by
rank 0 (one copy) and persisted by the node's saver; training resumes at the newest snapshot's global
step, from shared memory after a worker restart on the same node, before the first batch is read (rule
1); with a stream, each optimizer step acks its records with the global step (rule 2) and each
snapshot is preceded by every rank's flush and a barrier (rule 3). A checkpoint path given to the
framework by the user wins over the snapshot. Sharded states (FSDP, DeepSpeed) are not supported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from streamrover.ckpt.api import NoCheckpointError
from streamrover.cursor import DataCursor
from streamrover.shard_service.api import AckFailedError, ShardService

T = TypeVar("T")


def restore_before_lease(load: Callable[[], T], service: ShardService) -> T | None:
    """Rule 1: ``load()`` the newest checkpoint, which resets ``service`` to its cursor; None when there is none.

    ``load`` is a checkpointer's load with ``restore=True`` (it calls ``restore_cursor`` with the
    loaded cursor); what it returns is returned. With no checkpoint, ``service`` is reset to the
    empty cursor: nothing is in the model, so every record is read again, whatever a crashed earlier
    round acked. Call it before any process of the job leases. Raises what ``load`` raises besides
    :class:`~streamrover.ckpt.NoCheckpointError` (storage unavailable: do not start over).
    """
    try:
        return load()
    except NoCheckpointError:
        service.restore_cursor(DataCursor())
        return None


def flush_before_cut(service: ShardService, lost: Callable[[AckFailedError], Exception]) -> None:
    """Rule 3, this process's half: block until its queued acks are recorded (the barrier comes next).

    A refused ack raises ``lost(error)`` (chained to the :class:`AckFailedError`): records already
    applied are not acked, so the model state can no longer be checkpointed exactly.
    """
    try:
        service.flush()
    except AckFailedError as exc:
        raise lost(exc) from exc
