"""A DDP training script with a per-record ledger in the model, run under dlrover-run by the tests.

Records are ``{id, x, y}`` with ``y = 3x + 1``: a linear model learns it (the loss falls).
The model's state holds, besides the weights, ``ledger``: how often each record id was
applied. Each step all-reduces the step's id counts, so every rank holds the same ledger
and checkpointing one copy suffices. Training stops when the ledger holds every record;
rank 0 then writes ``ledger.npy`` and appends losses to ``loss.txt``.

For the autoscaling runs: ``--step-seconds T`` makes each step take at least T seconds (the
compute time of a real model's step, which on this machine's 2 shared cores cannot be real: a
node's throughput is then batch/T, and a second node adds throughput as it would on its own
machine). ``--until-file F``: an open-ended stream; ``--records`` is the ledger's capacity, and
training stops once the ledger holds the number of records written into F (the producer writes
it, atomically, when it has produced its last record; every rank learns that it exists through
the step's all-reduce, so all ranks stop at the same step). ``--step-log``: each rank saves
``steps-rank{R}.npy``, one row per step (monotonic time after the step, this rank's records, the step's
records on all ranks). ``--check-grads K``: every K steps each rank compares the gradient DDP reduced
with the gradient of the mean loss over the step's records of all ranks, computed locally on the
gathered batch (``grads-rank{R}.npy``: step, records, relative error). ``--hold-node N``: on node N, a worker
of a group larger than one rank stops before ``init_process_group`` until it is signalled (a node
that leaves while its group is still forming). ``--step-cpu-ms C`` (with ``--step-seconds T``): each step computes
C ms of CPU, then waits out the rest of T: a node whose CPU is throttled steps slower, a healthy one keeps the
period whatever the machine's load (while its share of a core exceeds C/T). ``--step-times``: rank 0 appends
``step unix-time`` to ``steps.txt`` after each step (rates per phase).
"""

from __future__ import annotations

import argparse
import copy
import os
import signal
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import streamrover.trainers.torch as srt


class LedgerModel(nn.Module):
    def __init__(self, records: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.register_buffer("ledger", torch.zeros(records, dtype=torch.int32))


def _grad_error(net: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int, step: int) -> tuple[int, int, float]:
    """(step, all ranks' records, relative error) of ``net``'s reduced gradient against the global batch's mean loss."""
    local = torch.full((batch_size, 3), float("nan"))
    local[: len(x), 0], local[: len(x), 1], local[: len(x), 2] = x[:, 0], y[:, 0], 1.0
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    rows = torch.cat(gathered)
    rows = rows[rows[:, 2] == 1.0]
    reference = copy.deepcopy(net)  # the weights before this step's update, no hooks
    reference.zero_grad()
    ((reference(rows[:, :1]) - rows[:, 1:2]) ** 2).sum().div(max(len(rows), 1)).backward()
    error = 0.0
    for mine, want in zip(net.parameters(), reference.parameters(), strict=True):
        got = mine.grad if mine.grad is not None else torch.zeros_like(mine)
        scale = float(want.grad.abs().max()) + 1e-12
        error = max(error, float((got - want.grad).abs().max()) / scale)
    return step, len(rows), error


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dataset", default="stream")
    parser.add_argument("--records", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--out", required=True)
    parser.add_argument("--step-seconds", type=float, default=0.0)
    parser.add_argument("--until-file", default=None)
    parser.add_argument("--hold-node", default=None, help="this node's workers of a 2-node group never join it")
    parser.add_argument("--step-log", action="store_true")
    parser.add_argument("--check-grads", type=int, default=0)
    parser.add_argument("--step-cpu-ms", type=float, default=0.0,
                        help="each step also computes this many ms of this thread's CPU time (a model's compute)")
    parser.add_argument("--step-times", action="store_true", help="rank 0 appends 'step unix-time' to steps.txt")
    args = parser.parse_args()
    if args.hold_node and os.environ.get("STREAMROVER_NODE_ID") == args.hold_node and os.environ["WORLD_SIZE"] != "1":
        (Path(args.out) / f"held-{args.hold_node}-rank{os.environ['RANK']}").write_text(str(os.getpid()))  # test waits
        signal.pause()  # until the node leaves: SIGTERM ends it (no handler yet); a SIGKILLed agent leaves it
    up = time.time()  # this worker's start (its imports done); the attempt line says where its start-up went
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    gloo = time.time() - up
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = LedgerModel(args.records, args.hidden)
    ddp = DDP(model.net)
    optimizer = torch.optim.Adam(model.net.parameters(), lr=0.01)

    ddp_s = time.time() - up - gloo
    session = srt.attach(model, optimizer, ckpt_every=args.ckpt_every)
    dataset = session.dataset(args.dataset, batch_size=args.batch_size, idle_timeout=0.5, columns=["id", "x", "y"])
    out = Path(args.out)
    log = open(out / "loss.txt", "a") if rank == 0 else None
    stamps = open(out / "steps.txt", "a") if rank == 0 and args.step_times else None
    if log is not None:
        timings = " ".join(f"{k} {v:.2f}" for k, v in {"gloo": gloo, "ddp": ddp_s, **session.timings}.items())
        log.write(f"# attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT')} world {dist.get_world_size()} "
                  f"resumed at {session.step} from {session.restored_from} via {session.state_via}; up {up:.3f} "
                  f"{timings} at {time.time():.3f}\n")  # fmt: skip
    until = Path(args.until_file) if args.until_file else None
    target = args.records if until is None else None  # None: not known yet (the producer has not finished)
    done = target is not None and bool(model.ledger.sum() >= target)
    first = True
    step_rows: list[tuple[float, int, int]] = []
    grad_errors: list[tuple[int, int, float]] = []
    for batch in DataLoader(dataset, batch_size=None):
        if done:
            break
        started = time.monotonic()
        ids = batch["id"].long()
        x = batch["x"].float().unsqueeze(1)
        y = batch["y"].float().unsqueeze(1)
        loss = ((ddp(x) - y) ** 2).sum() / max(len(ids), 1)
        optimizer.zero_grad()
        loss.backward()
        if args.check_grads and (session.step + 1) % args.check_grads == 0:  # the step number is the same on all ranks
            grad_errors.append(_grad_error(model.net, x, y, args.batch_size, session.step + 1))
        optimizer.step()
        counts = torch.zeros(args.records + 1, dtype=torch.int32)  # the last slot: ranks that saw --until-file
        counts.index_add_(0, ids, torch.ones(len(ids), dtype=torch.int32))
        counts[-1] = int(until is not None and until.exists())
        dist.all_reduce(counts)
        model.ledger += counts[:-1]
        if target is None and counts[-1] > 0:  # written once, atomically, before any rank saw it
            target = int(until.read_text()) if until is not None else args.records
        if args.step_cpu_ms:
            spin = time.thread_time() + args.step_cpu_ms / 1000
            while time.thread_time() < spin:
                pass
        if args.step_seconds:
            time.sleep(max(0.0, args.step_seconds - (time.monotonic() - started)))  # the step's modelled compute
        step = session.step_done()
        if stamps is not None:
            stamps.write(f"{step} {time.time():.4f}\n")
            stamps.flush()
        if args.step_log:
            step_rows.append((time.monotonic(), len(ids), int(counts[:-1].sum())))
        if log is not None and len(ids):
            if first:  # when this attempt's group trained its first step (the scale-out phases read it)
                log.write(f"# first step at {time.time():.3f}\n")
                first = False
            log.write(f"{step} {loss.item():.6f}\n")
            log.flush()
        done = target is not None and bool(model.ledger.sum() >= target)
    session.close()
    if args.step_log:
        np.save(out / f"steps-rank{rank}.npy", np.array(step_rows, dtype=np.float64).reshape(-1, 3))
    if args.check_grads:
        np.save(out / f"grads-rank{rank}.npy", np.array(grad_errors, dtype=np.float64).reshape(-1, 3))
    if rank == 0:
        np.save(out / "ledger.npy", model.ledger.numpy())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
