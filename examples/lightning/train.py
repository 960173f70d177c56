"""A Lightning script with flash checkpoints: two lines added to an ordinary one (marked ``# streamrover``).

    dlrover-run --standalone --nproc-per-node 1 --max-restarts 3 --ckpt-dir /tmp/ckpt examples/lightning/train.py

Kill the worker (``kill -9``) while it trains: the agent restarts it and it resumes from shared memory at the
newest snapshot's step. tests/trainers/test_frameworks.py runs a script of this shape with a SIGKILLed worker.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from streamrover.trainers.lightning import FlashCheckpoint  # streamrover


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(1), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def main() -> None:
    L.seed_everything(0)
    x = torch.randn(20_000, 8)
    data = DataLoader(TensorDataset(x, x @ torch.arange(8.0)), batch_size=32, shuffle=True)
    trainer = L.Trainer(
        max_steps=5_000,
        accelerator="cpu",
        logger=False,
        callbacks=[FlashCheckpoint(every_n_steps=100)],  # streamrover
    )
    trainer.fit(Regressor(), data)


if __name__ == "__main__":
    main()
