"""A standard torchrun DDP script that knows nothing of streamrover (the kind found in tutorials).

Trains a small model on synthetic data for a fixed number of steps, saves a
``torch.save`` checkpoint from rank 0 and resumes from it when restarted (torchrun
``--max-restarts``), and writes ``done-<rank>`` files with the final loss.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def huge_page_advised(tensor: torch.Tensor) -> int:
    """``THPeligible`` of the mapping that holds ``tensor`` (1: the kernel may back it with 2 MB pages)."""
    address, inside = tensor.data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= address < high
            elif inside and head == "THPeligible:":
                return int(line.split()[1])
    return -1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ckpt = os.path.join(args.out, "ckpt.pt")
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
    gen = torch.Generator().manual_seed(rank)
    w = torch.arange(8, dtype=torch.float32)
    loss = torch.tensor(0.0)
    for step in range(start, args.steps):
        x = torch.randn(64, 8, generator=gen)
        loss = ((model(x).squeeze(1) - x @ w) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and step % 10 == 9:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step + 1}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
    with open(os.path.join(args.out, f"done-{rank}"), "w") as f:
        f.write(f"{world} {local_rank} {os.environ['TORCHELASTIC_RESTART_COUNT']} {loss.item()}\n")
    with open(os.path.join(args.out, f"malloc-{rank}"), "w") as f:  # for the test: how malloc maps a big tensor
        f.write(f"{os.environ.get('GLIBC_TUNABLES', '-')} {huge_page_advised(torch.ones(2**22))}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
