"""A plain Hugging Face Trainer script, with the two lines the README changes (marked ``# streamrover``).

Trains a tiny GPT-2 (built from a config: nothing is downloaded) on random tokens for ``--max-steps``
steps. A callback of the script appends each step's global step and a fingerprint of the weights, the
optimizer state and the learning rate (:func:`fingerprint`) to ``steps-<restart>.txt`` in ``--out``; at
step ``--pause-at`` of the first run it writes its pid to ``paused`` and blocks there (mid-epoch), for the
test to SIGKILL it.
"""

from __future__ import annotations

import argparse
import os
import threading
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from streamrover.trainers.hf import FlashTrainer  # streamrover
from tests.trainers.fingerprint import fingerprint


class StepLog(TrainerCallback):
    def __init__(self, out: Path, pause_at: int) -> None:
        self.out, self.pause_at = out, pause_at
        self.file = out / f"steps-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}.txt"

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        with open(self.file, "a") as f:
            f.write(f"{state.global_step} {fingerprint(kwargs['model'], kwargs['optimizer'])}\n")
        if state.global_step == self.pause_at and not (self.out / "paused").exists():
            (self.out / "paused").write_text(str(os.getpid()))
            threading.Event().wait()  # killed here


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--pause-at", type=int, default=-1)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)
    )
    tokens = torch.randint(0, 64, (256, 16))
    train = [{"input_ids": t, "labels": t} for t in tokens]
    training_args = TrainingArguments(
        output_dir=str(args.out / "hf"),
        max_steps=args.max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        logging_steps=5,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = FlashTrainer(  # streamrover: was Trainer(
        model=model,
        args=training_args,
        train_dataset=train,
        callbacks=[StepLog(args.out, args.pause_at)],
        flash_every_n_steps=5,  # streamrover
        flash_persist_every=2,
    )
    trainer.train()


if __name__ == "__main__":
    main()
