"""DLRover flash checkpoint (its DdpCheckpointer, standalone) timed on the same state as bench_ckpt.py.

Run with the Python of a venv that has ``dlrover[torch]`` (it pins its own dependencies, so it is
kept apart from the project's venv); prints one JSON line of timings in seconds.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    import torch
    from dlrover.trainer.torch.flash_checkpoint.checkpointer import StorageType
    from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer

    n = args.bytes // 4 // args.tensors
    state = {f"layer{i}.weight": torch.randn(n) for i in range(args.tensors)}
    out: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="dlrover-bench-") as tmp:
        ckpt = DdpCheckpointer(tmp)
        t = time.perf_counter()
        ckpt.save_checkpoint(1, state, storage_type=StorageType.MEMORY)
        out["first_memory_save"] = time.perf_counter() - t
        times = []
        for step in range(2, 2 + args.repeats):
            t = time.perf_counter()
            ckpt.save_checkpoint(step, state, storage_type=StorageType.MEMORY)
            times.append(time.perf_counter() - t)
        out["memory_save"] = sorted(times)[len(times) // 2]
        step = 2 + args.repeats
        t = time.perf_counter()
        ckpt.save_checkpoint(step, state, os.path.join(tmp, f"{step}.pt"), storage_type=StorageType.DISK)
        out["disk_save_blocking"] = time.perf_counter() - t
        # its own wait_latest_checkpoint polls every 3 s and fails before the tracker file exists: poll finely
        tracker = os.path.join(tmp, "dlrover_latest.txt")
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if os.path.exists(tracker) and open(tracker).read().strip() == str(step):
                break
            time.sleep(0.01)
        out["disk_save_persisted"] = time.perf_counter() - t
        t = time.perf_counter()
        loaded = ckpt.load_checkpoint()
        out["memory_load_in_process"] = time.perf_counter() - t
        out["loaded_keys"] = len(loaded) if loaded else 0
    print(json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)  # its saver threads and shared memory handlers do not all stop on their own


if __name__ == "__main__":
    sys.exit(main())
