"""Flash checkpoints for the Hugging Face ``Trainer``: ``FlashTrainer``, a drop-in subclass.

Replace ``Trainer`` with :class:`FlashTrainer` in an existing script and run it under
``dlrover-run --ckpt-dir URL``::

    from streamrover.trainers.hf import FlashTrainer
    trainer = FlashTrainer(model=model, args=args, train_dataset=ds, flash_every_n_steps=50)
    trainer.train()

Every ``flash_every_n_steps`` optimizer steps (``on_step_end``) the model's weights, the optimizer
and scheduler states, the ``TrainerState`` and the torch RNG state are copied into shared memory;
the saver that the agent hosts persists them asynchronously (every ``flash_persist_every``-th).
``train()`` without ``resume_from_checkpoint`` resumes from the newest snapshot (shared memory after
a worker restart on the same node, storage otherwise) through the Trainer's own resume path: the
global step, epoch and learning-rate schedule go on from the snapshot's and the data loader skips
the batches already trained in the current epoch (unless ``ignore_data_skip``). A
``resume_from_checkpoint`` given by the user wins. The Trainer's own ``save_steps`` checkpoints are
left as they are. Streams do not feed it yet (the Trainer builds its own loader): the snapshots carry no cut,
and a shard service given to ``dlrover-run`` is left alone.
Sharded setups (FSDP, DeepSpeed) are not supported: rank 0 holds the one copy.

Imports transformers and torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from streamrover.ckpt.torch_adapter import _clone_tensors, _unwrap, load_module_state
from streamrover.trainers.flash import FlashRun

TRAINER_STATE_NAME = "trainer_state.json"  # transformers.trainer's name for it


class _SaveCallback(TrainerCallback):
    def __init__(self, trainer: FlashTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer.flash.step_done(int(state.global_step)):
            self.trainer._flash_save(state)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._flash_close(state)


class FlashTrainer(Trainer):
    """``transformers.Trainer`` with flash checkpoints; see the module docstring.

    Keyword arguments besides the Trainer's: ``flash_every_n_steps`` (default ``STREAMROVER_CKPT_EVERY``,
    else 50), ``flash_persist_every`` (1), ``flash_dir`` (default ``STREAMROVER_CKPT_DIR``), ``flash_keep_last``.
    """

    def __init__(
        self,
        *args: Any,
        flash_every_n_steps: int | None = None,
        flash_persist_every: int = 1,
        flash_dir: str | None = None,
        flash_keep_last: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.flash = FlashRun(
            every_n_steps=flash_every_n_steps,
            persist_every=flash_persist_every,
            ckpt_dir=flash_dir,
            stream=False,
            keep_last=flash_keep_last,
        )
        super().__init__(*args, **kwargs)
        self.add_callback(_SaveCallback(self))
        self._flash_state: dict[str, Any] | None = None
        self._flash_marker: str | None = None

    @property
    def restored_from(self) -> str | None:
        """``"memory:STEP"`` or ``"storage:STEP"`` when ``train()`` resumed a snapshot, else None."""
        return self.flash.restored_from

    # -- resume -------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        self.flash.open(self.args.process_index)
        if resume_from_checkpoint is None or resume_from_checkpoint is False:
            # zero-copy: the overrides below copy each part out (the weights straight into the model) before the
            # first step's save can reuse the buffer; a private copy of the whole state first doubled the copying
            loaded = self.flash.restore(zero_copy=True)
            if loaded is not None:
                # The Trainer resumes from a directory: one holding only trainer_state.json (the snapshot's); the
                # weights, optimizer, scheduler and RNG come from the snapshot through the overrides below.
                self._flash_state = loaded.state
                self._flash_marker = tempfile.mkdtemp(prefix="streamrover-flash-")
                with open(os.path.join(self._flash_marker, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
                    f.write(loaded.state["trainer_state"])
                resume_from_checkpoint = self._flash_marker
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self._flash_state = None
            if self._flash_marker is not None:
                shutil.rmtree(self._flash_marker, ignore_errors=True)
                self._flash_marker = None

    def _flash(self, checkpoint: Any) -> dict[str, Any] | None:
        if self._flash_state is not None and checkpoint is not None and checkpoint == self._flash_marker:
            return self._flash_state
        return None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        state = self._flash(resume_from_checkpoint)
        if state is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        load_module_state(_unwrap(model if model is not None else self.model), state["model"])

    def _load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
        state = self._flash(checkpoint)
        if state is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        assert self.optimizer is not None  # created before the Trainer loads a checkpoint's optimizer state
        self.optimizer.load_state_dict(_clone_tensors(state["optimizer"]))
        if self.lr_scheduler is not None and state.get("scheduler") is not None:
            self.lr_scheduler.load_state_dict(_clone_tensors(state["scheduler"]))

    def _load_scaler(self, checkpoint: Any) -> None:
        if self._flash(checkpoint) is None:
            super()._load_scaler(checkpoint)

    def _load_rng_state(self, checkpoint: Any) -> None:
        state = self._flash(checkpoint)
        if state is None:
            super()._load_rng_state(checkpoint)
            return
        if state.get("rng") is not None:
            torch.set_rng_state(state["rng"].clone())

    # -- save ---------------------------------------------------------------------------------
    def _flash_state_now(self, state: Any) -> dict[str, Any]:
        if not self.args.should_save:  # another rank: the state is rank 0's
            return {}
        assert self.optimizer is not None  # a step ended: the optimizer exists
        return {
            "model": _unwrap(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "trainer_state": json.dumps(dataclasses.asdict(state), sort_keys=True),
            "rng": torch.get_rng_state(),
        }

    def _flash_save(self, state: Any) -> None:
        self.flash.save(int(state.global_step), self._flash_state_now(state))

    def _flash_close(self, state: Any) -> None:
        self.flash.close(int(state.global_step), self._flash_state_now(state))
