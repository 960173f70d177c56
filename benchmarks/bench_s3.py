"""Checkpoint persist throughput to a real S3 server (SeaweedFS, built by scripts/build-seaweedfs.sh), against
s3fs's own ``put`` of the same bytes in the same run.

Ours: ``Checkpointer.save`` of a numpy state into shared memory, then its persist to ``s3://`` (the safetensors
file streamed from shared memory, the part document, the manifest); the figure is the persist alone (save's
return to ``wait``'s). The peer: the same bytes, in a file on /dev/shm, uploaded by ``S3FileSystem.put_file``
(concurrent multipart). Runs alternate, the median of each is reported, and the ratio ours / put (higher is
better, 1.0 is s3fs's speed).

``python -m benchmarks s3 [--mib 256] [--runs 3]`` (``--quick``: 32 MiB, 2 runs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from benchmarks._common import environment, load, table
from streamrover.ckpt import Checkpointer, namespace_for, purge_shared_memory


def _state(mib: int) -> dict[str, np.ndarray]:
    n = mib * (1 << 20) // 4 // 8
    rng = np.random.default_rng(0)
    return {f"layer{i}": rng.random(n, dtype=np.float32) for i in range(8)}


def run(mib: int, runs: int) -> int:
    from tests.s3.seaweed import SeaweedS3, weed_binary

    print(environment())
    print(f"load: {load()}")
    with tempfile.TemporaryDirectory(prefix="bench-s3-") as tmp:
        server = SeaweedS3(Path(tmp), weed_binary())
        server.start()
        try:
            fs = server.filesystem()
            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            fs.mkdir(bucket)
            state = _state(mib)
            nbytes = sum(a.nbytes for a in state.values())
            blob = f"/dev/shm/bench-s3-{os.getpid()}"
            with open(blob, "wb") as fh:
                for a in state.values():
                    fh.write(a.tobytes())
            url = f"s3://{bucket}/ckpt"
            ckpt = Checkpointer(url, saver="thread", storage_options=server.storage_options())
            ours: list[float] = []
            puts: list[float] = []
            blocking: list[float] = []
            try:
                ckpt.save(0, state, persist=False)  # first-save allocation, out of the measurement
                for i in range(1, runs + 1):
                    t0 = time.perf_counter()
                    ckpt.save(i, state)
                    t1 = time.perf_counter()
                    ckpt.wait(timeout=600)
                    t2 = time.perf_counter()
                    blocking.append(t1 - t0)
                    ours.append(t2 - t1)
                    t3 = time.perf_counter()
                    fs.put_file(blob, f"{bucket}/put/blob-{i}")
                    puts.append(time.perf_counter() - t3)
                    fs.rm(f"{bucket}/put/blob-{i}")
            finally:
                ckpt.close(unlink=True)
                purge_shared_memory(namespace_for(url))
                os.unlink(blob)
        finally:
            server.stop()
    mb = nbytes / 1e6
    ours_s, put_s = statistics.median(ours), statistics.median(puts)
    rows = [
        ["streamrover persist to s3://", mib, ours_s, mb / ours_s],
        ["s3fs put_file (same bytes)", mib, put_s, mb / put_s],
    ]
    print(table(["what", "MiB", "median s", "MB/s"], rows))
    print(f"save (blocking, memcpy into shared memory): median {statistics.median(blocking) * 1e3:.0f} ms")
    print(f"persist throughput / s3fs put: {put_s / ours_s:.2f}x  (runs: ours {[round(x, 2) for x in ours]}, "
          f"put {[round(x, 2) for x in puts]})")  # fmt: skip
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks s3", description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="32 MiB, 2 runs")
    args, _ = parser.parse_known_args(argv)
    return run(32 if args.quick else args.mib, 2 if args.quick else args.runs)
