"""A plain DDP training script that trains on a stream, exactly once, under dlrover-run.

The lines marked ``# streamrover`` are all it takes to adopt streamrover; everything
else is an ordinary torchrun script. Records are ``{x, y}`` rows of a registered
dataset (a Kafka topic or parquet files); the model learns ``y`` from ``x``.

    dlrover-run --nnodes 1:2 --nproc-per-node 2 --max-restarts 3 --rdzv-backend streamrover --rdzv-id demo \
        --shard-service 127.0.0.1:7070 --token "$TOKEN" --ckpt-dir /tmp/demo-ckpt \
        examples/torch_ddp/train.py --dataset clicks --steps 500

(``python examples/torch_ddp/run_demo.py`` starts a master, registers a parquet dataset and runs the line above.)
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import streamrover.trainers.torch as srt  # streamrover


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dataset", default="clicks")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: at the dataset's end)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    model = DDP(nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 1)))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

    session = srt.attach(model, optimizer, ckpt_every=50)  # streamrover: restore the newest checkpoint + cursor
    data = session.dataset(args.dataset, args.batch_size, columns=["x", "y"], idle_timeout=1.0)  # streamrover
    for batch in DataLoader(data, batch_size=None):
        x, y = batch["x"].float().unsqueeze(1), batch["y"].float().unsqueeze(1)
        loss = ((model(x) - y) ** 2).sum() / max(len(x), 1)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step = session.step_done()  # streamrover: ack this step's records; checkpoint every 50 steps
        if dist.get_rank() == 0 and step % 50 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        if (args.steps and step >= args.steps) or (step % 20 == 0 and session.all_ended()):
            break
    session.close()  # streamrover: final checkpoint, its cut committed
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
