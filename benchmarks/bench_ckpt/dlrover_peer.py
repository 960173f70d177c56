"""DLRover flash checkpoint (its DdpCheckpointer, standalone) timed on the same state as bench_ckpt.py.

Run with the Python of a venv that has ``dlrover[torch]`` (it pins its own dependencies, so it is
kept apart from the project's venv); prints one JSON line of timings in seconds, each timed operation
after ``--warmups`` untimed runs, as the median (min, max) of ``--repeats``. Set ``TORCHELASTIC_RUN_ID``
to a unique name: DLRover names its shared memory and socket directory after it, so the caller can
remove exactly what this run created (its forked saver is killed with this process's group).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time


def summary(times: list[float]) -> dict[str, float]:
    return {"median": statistics.median(times), "min": min(times), "max": max(times), "n": len(times)}


def drop_cache(path: str) -> None:
    for dirpath, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--warmups", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where its checkpoints go (a temp dir inside it)")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    import torch
    from dlrover.trainer.torch.flash_checkpoint.checkpointer import StorageType
    from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer

    n = args.bytes // 4 // args.tensors
    state = {f"layer{i}.weight": torch.randn(n) for i in range(args.tensors)}
    out: dict[str, object] = {}
    tmp = tempfile.mkdtemp(prefix="dlrover-bench-", dir=args.dir)
    ckpt = DdpCheckpointer(tmp)
    step = 1
    t = time.perf_counter()
    ckpt.save_checkpoint(step, state, storage_type=StorageType.MEMORY)
    out["first_memory_save"] = time.perf_counter() - t
    times = []
    for i in range(args.warmups + args.repeats):
        step += 1
        t = time.perf_counter()
        ckpt.save_checkpoint(step, state, storage_type=StorageType.MEMORY)
        if i >= args.warmups:
            times.append(time.perf_counter() - t)
    out["memory_save"] = summary(times)
    # its own wait_latest_checkpoint polls every 3 s and fails before the tracker file exists: poll finely
    tracker = os.path.join(tmp, "dlrover_latest.txt")
    blocking, persisted = [], []
    for i in range(args.warmups + args.repeats):
        step += 1
        drop_cache(tmp)
        os.sync()
        t = time.perf_counter()
        ckpt.save_checkpoint(step, state, os.path.join(tmp, f"{step}.pt"), storage_type=StorageType.DISK)
        block = time.perf_counter() - t
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if os.path.exists(tracker) and open(tracker).read().strip() == str(step):
                break
            time.sleep(0.01)
        else:
            raise TimeoutError(f"DLRover did not persist step {step} in 900 s")
        done = time.perf_counter() - t
        if i >= args.warmups:
            blocking.append(block)
            persisted.append(done)
        for name in os.listdir(tmp):  # keep one checkpoint on disk, like the bench's retention for ours
            if name.endswith(".pt") and name != f"{step}.pt":
                old = os.path.join(tmp, name)
                shutil.rmtree(old) if os.path.isdir(old) else os.unlink(old)
    out["disk_save_blocking"] = summary(blocking)
    out["persisted"] = summary(persisted)
    t = time.perf_counter()
    loaded = ckpt.load_checkpoint()
    out["memory_load_in_process"] = time.perf_counter() - t
    out["loaded_keys"] = len(loaded) if loaded else 0
    print(json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)  # its saver threads and shared memory handlers do not all stop on their own; the caller cleans


if __name__ == "__main__":
    sys.exit(main())
