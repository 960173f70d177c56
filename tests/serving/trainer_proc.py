"""A small torch trainer with flash checkpoints and a serving exporter (run as a script by the serving tests).

It resumes from the newest checkpoint (``--from-storage``: storage only, as after a lost node), trains a
hashed-embedding model up to ``--steps`` with SGD on a deterministic stream (step s's batch depends on s
and ``--timeline``), checkpoints every ``--every`` steps with the cursor ``clicks/p0 [0, 10*s)``, waits
until each checkpoint is durable, and exports each durable checkpoint to ``--repo``. ``--kill-at S``: when
checkpoint S becomes durable the process SIGKILLs itself instead of exporting it (it prints ``durable S``
first). Prints ``saver PID``, ``started [versions exported at start]`` and, at the end, ``exported [...]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
import warnings

import torch
from torch import nn

from streamrover.ckpt import Checkpointer, NoCheckpointError, RetentionPolicy, load_torch_state
from streamrover.ckpt.torch_adapter import TorchCheckpoint
from streamrover.cursor import DataCursor, PartitionKey
from streamrover.serving import ExportConfig, RowTracker, TorchExporter
from streamrover.serving.tables import TOUCHED_KEY

ROWS, DIM, FIELDS, BATCH = 512, 4, 3, 16


class TinyCtr(nn.Module):
    """An embedding table (hashed ids) and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM)
        self.head = nn.Linear(DIM * FIELDS, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids % ROWS).flatten(1)).squeeze(1)


def batch_at(step: int, timeline: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch and labels: ids from a hot range of 64 rows that moves every 10 steps (a delta over
    the version 10 steps before holds at most 64 of the 512 rows)."""
    gen = torch.Generator().manual_seed(step * 7919 + timeline * 104729)
    ids = (torch.randint(0, 64, (BATCH, FIELDS), generator=gen) + 64 * ((step - 1) // 10)) % ROWS
    return ids, (torch.rand(BATCH, generator=gen) < 0.3).float()


def cursor_at(step: int) -> DataCursor:
    cursor = DataCursor()
    if step:
        cursor.add(PartitionKey("clicks", 0, "p0"), 0, 10 * step)
    return cursor


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--repo", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--base-every", type=int, default=4)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--timeline", type=int, default=0)
    p.add_argument("--from-storage", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    model = TinyCtr()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    tracker = RowTracker(model)
    tracker.check_optimizer(optimizer)
    example = (torch.zeros(2, FIELDS, dtype=torch.int64),)
    exporter = TorchExporter(ExportConfig(args.repo, name="tiny", keep_last=100, base_every=args.base_every),
                             args.ckpt, TinyCtr, example, input_names=["ids"], output_names=["logit"],
                             tables=tracker.params)  # fmt: skip

    def on_durable(step: int) -> None:
        print(f"durable_at {step} {time.time()}", flush=True)
        if step == args.kill_at:
            print(f"durable {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # between durability and export
        exporter.on_durable(step)

    checkpointer = Checkpointer(args.ckpt, retention=RetentionPolicy(keep_last=100), linger=30.0,
                                on_durable=on_durable)  # fmt: skip
    ckpt = TorchCheckpoint(checkpointer, model, optimizer)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = checkpointer.load(memory=not args.from_storage)
        extra = load_torch_state(loaded.state, model, optimizer)
        tracker.load_state(extra.get(TOUCHED_KEY))
        step = loaded.step
    except NoCheckpointError:
        step = 0
    print(f"resumed {step}", flush=True)
    print(f"started {json.dumps(exporter.start(step))}", flush=True)
    while step < args.steps:
        step += 1
        ids, labels = batch_at(step, args.timeline)
        loss = nn.functional.binary_cross_entropy_with_logits(model(ids), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        tracker.step_done(step)
        if step % args.every == 0:
            ckpt.save(step, extra={TOUCHED_KEY: tracker.state()}, cursor=cursor_at(step),
                      meta={"reported": {"loss": float(loss)}})  # fmt: skip
            checkpointer.wait(timeout=120)  # durable (and handed to the exporter) before training goes on
            print(f"saver {checkpointer.saver_pid or 0}", flush=True)
    exporter.close()
    checkpointer.close()
    print(f"exported {json.dumps(exporter.exported)}", flush=True)


if __name__ == "__main__":
    main()
