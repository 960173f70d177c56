"""A Lightning script fed by a streamrover dataset, with a per-record ledger in the model (run by the tests).

Records are ``{id, x, y}`` (``y = 3x + 1``). The module's ``ledger`` buffer counts how often each
record id was applied; it is part of the state, so a checkpoint holds exactly the records of its
cut. One epoch reads the bounded dataset to its end; rank 0 then writes ``ledger.npy``. At global
step ``--pause-at`` of the first run the worker writes its pid to ``paused`` and blocks, for the
test to SIGKILL it.
"""

from __future__ import annotations

import argparse
import os
import threading
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from streamrover.trainers.lightning import FlashCheckpoint


class LedgerRegressor(L.LightningModule):
    def __init__(self, records: int, out: Path, pause_at: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
        self.register_buffer("ledger", torch.zeros(records, dtype=torch.int32))
        self.out, self.pause_at = out, pause_at

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        if len(batch["id"]) == 0:
            return None  # the stream is idle (or at its end): nothing to train on
        if self.global_step == self.pause_at and not (self.out / "paused").exists():
            (self.out / "paused").write_text(str(os.getpid()))
            threading.Event().wait()  # killed here
        self.ledger.index_add_(0, batch["id"].long(), torch.ones(len(batch["id"]), dtype=torch.int32))
        x, y = batch["x"].float().unsqueeze(1), batch["y"].float().unsqueeze(1)
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--records", type=int, required=True)
    parser.add_argument("--pause-at", type=int, default=-1)
    args = parser.parse_args()
    flash = FlashCheckpoint(every_n_steps=5)
    loader = DataLoader(
        flash.dataset("stream", batch_size=64, columns=["id", "x", "y"], idle_timeout=0.5), batch_size=None
    )
    model = LedgerRegressor(args.records, args.out, args.pause_at)
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, callbacks=[flash])  # fmt: skip
    trainer.fit(model, loader)
    if trainer.is_global_zero:
        np.save(args.out / "ledger.npy", model.ledger.numpy())


if __name__ == "__main__":
    main()
