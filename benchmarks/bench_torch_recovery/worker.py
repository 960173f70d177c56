"""The training script both sides of bench_torch_recovery run (one model, one step loop).

``--mode streamrover``: a StreamSession on a parquet dataset, flash checkpoints every
``--ckpt-every`` steps (memory snapshot; the agent's saver persists). ``--mode torchrun``:
synthetic batches of the same shape, ``torch.save`` from rank 0 every ``--ckpt-every``
steps and ``torch.load`` on restart (what a torchrun ``--max-restarts`` job does).
Rank 0 appends ``<unix time> <step> <pid>`` to ``--step-log`` after every optimizer step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import psutil
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

STARTED = psutil.Process().create_time()  # the process's start, before the imports above


def build(hidden: int, layers: int) -> nn.Module:
    mods: list[nn.Module] = [nn.Linear(1, hidden), nn.Tanh()]
    for _ in range(layers):
        mods += [nn.Linear(hidden, hidden), nn.Tanh()]
    return nn.Sequential(*mods, nn.Linear(hidden, 1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["streamrover", "torchrun"], required=True)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--ckpt-every", type=int, default=20)
    parser.add_argument("--ckpt-file", default="")
    parser.add_argument("--step-log", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    phases = [("imports", time.time())]
    dist.init_process_group("gloo")
    phases.append(("init_process_group", time.time()))
    rank = dist.get_rank()
    with open(f"{args.step_log}.pid{rank}", "w") as f:  # the benchmark finds the workers to kill by these
        f.write(str(os.getpid()))
    torch.manual_seed(0)
    net = build(args.hidden, args.layers)
    model = DDP(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    phases.append(("model (build, DDP: its first broadcast)", time.time()))
    log = open(args.step_log, "a") if rank == 0 else None
    step = 0
    if args.mode == "streamrover":
        import streamrover.trainers.torch as srt

        phases.append(("import streamrover", time.time()))
        session = srt.attach(net, opt, ckpt_every=args.ckpt_every)
        step = session.step
        phases.append(("attach (restore + cursor reset)", time.time()))
        timings = ", ".join(f"{k} {v:.2f} s" for k, v in session.timings.items())
        sys.stderr.write(f"rank {rank} attach: {timings}\n")
        batches = DataLoader(session.dataset("bench", args.batch_size, columns=["x", "y"]), batch_size=None)
        source = ((b["x"].float().unsqueeze(1), b["y"].float().unsqueeze(1)) for b in batches)
    else:
        if os.path.exists(args.ckpt_file):
            state = torch.load(args.ckpt_file, weights_only=True)
            net.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            step = int(state["step"])
        phases.append(("torch.load", time.time()))
        gen = torch.Generator().manual_seed(rank)

        def synthetic():  # type: ignore[no-untyped-def]
            while True:
                x = torch.rand(args.batch_size, 1, generator=gen) * 2 - 1
                yield x, 3 * x + 1

        source = synthetic()
    for x, y in source:
        if phases:
            phases.append(("batch (the first one read)", time.time()))
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if args.mode == "streamrover":
            step = session.step_done()
        else:
            step += 1
            if rank == 0 and step % args.ckpt_every == 0:
                torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "step": step}, args.ckpt_file + ".tmp")
                os.replace(args.ckpt_file + ".tmp", args.ckpt_file)
        if phases:
            phases.append(("first step", time.time()))
            last = STARTED
            parts = []
            for name, t in phases:
                parts.append(f"{name} {t - last:.2f} s")
                last = t
            # one write per line: both ranks write to the launcher's log at the same moment (print writes the
            # text and its newline apart, and the lines interleaved)
            sys.stderr.write(f"rank {rank} start-up phases: " + ", ".join(parts) + "\n")
            stamps = ",".join(f"{name.split(' ')[0]}={t:.4f}" for name, t in phases)
            sys.stderr.write(f"phase-times rank {rank} pid {os.getpid()}: {stamps}\n")
            sys.stderr.flush()
            phases = []
        if log is not None:
            log.write(f"{time.time():.4f} {step} {os.getpid()}\n")
            log.flush()


if __name__ == "__main__":
    main()
