"""Flash checkpoints for PyTorch Lightning: a ``Callback`` (snapshots, resume, stream acks) and a ``CheckpointIO``.

Add the callback to an existing Lightning script, and run it under ``dlrover-run --ckpt-dir URL``::

    from streamrover.trainers.lightning import FlashCheckpoint
    trainer = L.Trainer(max_steps=1000, callbacks=[FlashCheckpoint(every_n_steps=50)])
    trainer.fit(model, loader)

Every ``every_n_steps`` optimizer steps, :class:`FlashCheckpoint` copies Lightning's full checkpoint
(what ``trainer.save_checkpoint`` writes: weights, optimizer and scheduler states, loops, callbacks)
into shared memory; the saver that the agent hosts persists it asynchronously. When ``fit`` starts
it resumes from the newest snapshot, in shared memory after a worker restart on the same node
(seconds), from storage otherwise, the global step going on from the snapshot's; ``fit(ckpt_path=...)``
given by the user wins over it. With a stream, build the loader from :meth:`FlashCheckpoint.dataset`:
each optimizer step acks its records and each snapshot takes the cut of its step (the contract of
:mod:`streamrover.trainers.flash`).

:class:`FlashCheckpointIO` is the storage half alone, for ``Trainer(plugins=[FlashCheckpointIO()])``:
every ``trainer.save_checkpoint(path)`` (``ModelCheckpoint``'s too) becomes a flash save, numbered by the
checkpoint's global step, and any ``fit(ckpt_path=...)`` loads the newest snapshot (the path only says
"resume"); retention is the checkpointer's, so ``remove_checkpoint`` is a no-op. It is for loops without
a stream: Lightning calls it on rank 0 alone, so it cannot flush every rank's acks before the cut (the
callback does). Strategies that shard the state (FSDP, DeepSpeed) are not supported: rank 0 holds the one
copy.

Imports lightning and torch.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import CheckpointIO

from streamrover.ckpt.torch_adapter import _clone_tensors
from streamrover.trainers.flash import FlashRun, TrainedOnly


def _weights_as_views(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A zero-copy checkpoint as Lightning may keep it: the weights (``state_dict``) stay views of shared memory,
    which ``load_state_dict`` copies into the model before the first step; every other tensor is copied out
    (``Optimizer.load_state_dict`` keeps the tensors it is given, and so may a callback's state)."""
    return {k: v if k == "state_dict" else _clone_tensors(v) for k, v in checkpoint.items()}


class FlashCheckpointIO(CheckpointIO):
    """Lightning's ``CheckpointIO`` over a :class:`FlashRun` (see the module docstring)."""

    def __init__(self, run: FlashRun | None = None, **kwargs: Any) -> None:
        self.run = run if run is not None else FlashRun(**kwargs)
        self.rank = 0

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Snapshot ``checkpoint`` at its ``global_step`` (Lightning calls this on global rank 0 only)."""
        self.run.open(self.rank)
        self.run.save(int(checkpoint["global_step"]), checkpoint, flushed=True)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The newest snapshot's checkpoint dictionary, whatever ``path`` says (a collective under DDP)."""
        self.run.open(self.rank)
        loaded = self.run.restore()
        if loaded is None:
            raise FileNotFoundError(f"no flash checkpoint in shared memory or at {self.run.root!r}")
        return loaded.state

    def remove_checkpoint(self, path: Any) -> None:
        """A no-op: the checkpointer's retention policy decides what storage keeps."""

    def teardown(self) -> None:
        if self.run.checkpointer is not None:
            self.run.checkpointer.wait(timeout=300)


class FlashCheckpoint(Callback):
    """Flash snapshots every ``every_n_steps`` global steps and resume at ``fit`` start; see the module docstring.

    Args (all optional; see :class:`FlashRun`): ``every_n_steps``, ``persist_every`` (persist every n-th
    snapshot), ``ckpt_dir``, ``master``, ``token``, ``keep_last``.
    """

    def __init__(self, **kwargs: Any) -> None:
        self.run = FlashRun(**kwargs)
        self.io = FlashCheckpointIO(self.run)

    @property
    def restored_from(self) -> str | None:
        """``"memory:STEP"`` or ``"storage:STEP"`` when ``fit`` resumed a snapshot, else None."""
        return self.run.restored_from

    def dataset(self, name: str, batch_size: int = 256, **kwargs: Any) -> TrainedOnly:
        """A stream dataset whose batches are acked at the optimizer step that applied them
        (``DataLoader(ds, batch_size=None)``; ``kwargs`` as :class:`StreamDataset`'s)."""
        return self.run.dataset(name, batch_size, **kwargs)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        self.io.rank = trainer.global_rank
        self.run.open(trainer.global_rank)
        loaded = self.run.restore(zero_copy=True)
        if loaded is not None:
            # Lightning restores the model, callbacks, optimizers, schedulers and loops from the checkpoint its
            # connector holds once ``setup`` returns (``fit(ckpt_path=...)`` replaces it: the user's path wins).
            trainer._checkpoint_connector._loaded_checkpoint = _weights_as_views(loaded.state)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.run.batch_trained()
        step = int(trainer.global_step)
        if self.run.step_done(step):
            self.run.flush()  # every rank's acks are in before rank 0 takes the cut
            state = trainer._checkpoint_connector.dump_checkpoint(weights_only=False) if trainer.is_global_zero else {}
            self.run.save(step, state, flushed=True)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        step = int(trainer.global_step)
        state = trainer._checkpoint_connector.dump_checkpoint(weights_only=False) if trainer.is_global_zero else {}
        self.run.close(step, state)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.run.checkpointer is not None:
            self.run.checkpointer.close()
            self.run.checkpointer = None
