"""A plain Lightning script, with the two lines the README adds (marked ``# streamrover``).

Fits a tiny regressor for ``--max-steps`` steps. Each training step appends the global step and a
fingerprint of the weights, the optimizer state and the learning rate to ``steps-<restart>.txt`` in
``--out``; at step ``--pause-at`` of the first run it writes its pid to ``paused`` and blocks there
(mid-epoch), for the test to SIGKILL it.
"""

from __future__ import annotations

import argparse
import os
import threading
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from streamrover.trainers.lightning import FlashCheckpoint  # streamrover
from tests.trainers.fingerprint import fingerprint


class Regressor(L.LightningModule):
    def __init__(self, out: Path, pause_at: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.out, self.pause_at = out, pause_at
        self.log_file = out / f"steps-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}.txt"

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        with open(self.log_file, "a") as f:
            f.write(f"{self.global_step} {fingerprint(self, self.trainer.optimizers[0])}\n")
        if self.global_step == self.pause_at and not (self.out / "paused").exists():
            (self.out / "paused").write_text(str(os.getpid()))
            threading.Event().wait()  # killed here
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(1), y)

    def configure_optimizers(self) -> dict[str, object]:
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--pause-at", type=int, default=-1)
    args = parser.parse_args()
    L.seed_everything(0)
    x = torch.randn(256, 8)
    data = DataLoader(TensorDataset(x, x @ torch.arange(8.0)), batch_size=4, shuffle=True)
    trainer = L.Trainer(
        max_steps=args.max_steps,
        accelerator="cpu",
        devices=1,
        default_root_dir=args.out,
        enable_progress_bar=False,
        logger=False,  # TensorBoard (the default when installed) fails to import beside tensorflow-cpu here
        callbacks=[FlashCheckpoint(every_n_steps=5, persist_every=2)],  # streamrover
    )
    trainer.fit(Regressor(args.out, args.pause_at), data)


if __name__ == "__main__":
    main()
