"""A training loop that checkpoints: the time the trainer really loses per checkpoint."""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.bench_ckpt.measure import drop_cache, install_signal_handlers, summary

TRAIN_WIDTH = 2048
TRAIN_BATCH = 64


def train_model(nbytes: int) -> Any:
    """An MLP whose parameters plus Adam's two moments are about ``nbytes`` (a BatchNorm adds buffers)."""
    import torch

    layers = max(2, round(nbytes / 3 / (TRAIN_WIDTH * TRAIN_WIDTH * 4)))
    mods: list[Any] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(TRAIN_WIDTH, TRAIN_WIDTH), torch.nn.ReLU()]
    mods[-1] = torch.nn.BatchNorm1d(TRAIN_WIDTH)
    return torch.nn.Sequential(*mods)


def train_variants(model: Any, optim: Any, work: Path, root: str) -> dict[str, tuple[Callable[[int], None], Any]]:
    """name -> (checkpoint(step), after(): untimed, waits for what the variant left running). As users run each."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from streamrover.ckpt import Checkpointer, RetentionPolicy, TorchCheckpoint

    # saver="agent": the node's saver the parent started, as dlrover-run's agent hosts it. Both adapters share
    # it; the overlapped one's step hook stays installed for every variant (a no-op call when nothing is pending).
    cp = Checkpointer(root, saver="agent", retention=RetentionPolicy(keep_last=1), persist_on_exit=False)
    ckpts = {"overlap": TorchCheckpoint(cp, model, optim, overlap=True), "blocking": TorchCheckpoint(cp, model, optim)}
    path = work / "train-torch.pt"
    dcp_dir = work / "train-dcp"
    futures: list[Any] = []

    def ours(kind: str, persist: bool) -> Callable[[int], None]:
        return lambda step: ckpts[kind].save(step, persist=persist)

    def torch_save(fsync: bool) -> Callable[[int], None]:
        def run(step: int) -> None:
            with open(path, "wb") as fh:
                torch.save({"model": model.state_dict(), "optimizer": optim.state_dict(), "step": step}, fh)
                if fsync:
                    fh.flush()
                    os.fsync(fh.fileno())

        return run

    def dcp_async(step: int) -> None:
        if futures:  # DCP's documented pattern: the previous async save must be done before the next
            futures.pop().result()
        model_sd, optim_sd = get_state_dict(model, optim)
        futures.append(dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(dcp_dir)))

    def after_ours(kind: str) -> Callable[[], None]:
        def run() -> None:
            ckpts[kind].checkpointer.wait()

        return run

    def after_file() -> None:
        if path.exists():
            drop_cache(path)

    def after_dcp() -> None:
        while futures:
            fut = futures.pop()
            (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
        if dcp_dir.exists():
            drop_cache(dcp_dir)

    return {
        "ours_overlap": (ours("overlap", False), after_ours("overlap")),
        "ours_overlap_persist": (ours("overlap", True), after_ours("overlap")),
        "ours_blocking": (ours("blocking", False), after_ours("blocking")),
        "torch_save_fsync": (torch_save(True), after_file),
        "torch_save": (torch_save(False), after_file),
        "dcp_async": (dcp_async, after_dcp),
    }


def train_main(a: argparse.Namespace) -> int:
    """The training-loop rows, in a fresh process: extra seconds per checkpoint over a step without one."""
    import torch
    import torch.distributed as dist

    from streamrover.ckpt import namespace_for, purge_shared_memory

    install_signal_handlers()
    work = Path(a.work)
    root = str(work / "train")
    dist.init_process_group("gloo", init_method=f"file://{work}/train-pg", rank=0, world_size=1)
    out: dict[str, Any] = {}
    try:
        torch.manual_seed(0)
        model = train_model(a.bytes)
        optim = torch.optim.Adam(model.parameters(), lr=1e-4)
        x = torch.randn(TRAIN_BATCH, TRAIN_WIDTH)

        def step() -> None:
            optim.zero_grad()
            model(x).pow(2).mean().backward()
            optim.step()

        step()  # Adam's state exists from here on: the state has its full size
        state_bytes = sum(t.nbytes for t in model.state_dict().values())
        state_bytes += sum(t.nbytes for s in optim.state.values() for t in s.values() if torch.is_tensor(t))
        out["state_bytes"] = state_bytes
        variants = train_variants(model, optim, work, root)
        src = [t for t in model.state_dict().values()] + [
            t for s in optim.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0
        ]
        dst = [torch.empty_like(t) for t in src]

        def memcpy() -> None:  # the same bytes into pre-touched memory, libc memmove (the faster peer here)
            for d, s_ in zip(dst, src):
                ctypes.memmove(d.data_ptr(), s_.data_ptr(), s_.nbytes)

        memcpy()
        every = a.train_every
        windows = max(3, a.train_steps // every)
        # A run is `windows` windows of `every` steps with a checkpoint after each window but the last. A sample
        # is one steady window plus its checkpoint (windows 2..W-1): it includes the wait, in its first
        # optimizer step, for the previous overlapped save's copy, and the slowdown that copy caused. The
        # figure is median(sample) - median(the same windows without checkpoints): medians resist the spikes
        # other engineers' jobs cause on this shared 2-core machine.
        samples: dict[str, list[float]] = {"none": [], "memcpy": [], **{name: [] for name in variants}}
        for r in range(a.train_rounds + 1):  # round 0 warms everything up (first saves allocate, DCP plans)
            for name in ["none", "memcpy", *variants]:
                if name == "memcpy":
                    t = time.perf_counter()
                    memcpy()
                    if r:
                        samples[name].append(time.perf_counter() - t)
                    continue
                ckpt, after = variants.get(name, (None, None))
                for w in range(1, windows + 1):
                    t = time.perf_counter()
                    for _ in range(every):
                        step()
                    if ckpt is not None and w < windows:
                        ckpt(w + 1000 * r)
                    if r and 1 < w < windows:
                        samples[name].append(time.perf_counter() - t)
                if after is not None:
                    after()
                os.sync()
        base = statistics.median(samples["none"])
        out["step"] = summary([v / every for v in samples["none"]])
        out["memcpy"] = summary(samples["memcpy"])
        out["samples"] = len(samples["none"])
        for name in variants:
            out[name] = summary([v - base for v in samples[name]])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        purge_shared_memory(namespace_for(root))
    print(json.dumps(out), flush=True)
    return 0
