"""A Hugging Face Trainer script with flash checkpoints: ``Trainer`` became ``FlashTrainer`` (marked ``# streamrover``).

    dlrover-run --standalone --nproc-per-node 1 --max-restarts 3 --ckpt-dir /tmp/ckpt examples/hf_trainer/train.py

A small GPT-2 built from a config (nothing is downloaded) learns random token sequences. Kill the worker
(``kill -9``) while it trains: the agent restarts it and it resumes from shared memory at the newest snapshot's
step, the learning-rate schedule and the data order going on. tests/trainers/test_frameworks.py runs a script
of this shape with a SIGKILLed worker.
"""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from streamrover.trainers.hf import FlashTrainer  # streamrover


def main() -> None:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)
    tokens = torch.randint(0, 128, (2_048, 32))
    train = [{"input_ids": t, "labels": t} for t in tokens]
    args = TrainingArguments(
        output_dir="/tmp/hf-example",
        max_steps=500,
        per_device_train_batch_size=8,
        learning_rate=5e-4,
        logging_steps=25,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
    )
    trainer = FlashTrainer(  # streamrover: was Trainer(
        model=GPT2LMHeadModel(config), args=args, train_dataset=train, flash_every_n_steps=50
    )
    trainer.train()


if __name__ == "__main__":
    main()
