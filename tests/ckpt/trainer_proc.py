"""A stand-in trainer process for the failure tests (run as a script; SIGKILLed by the tests).

It saves ``--steps`` snapshots whose every value equals the step, persisting those listed
in ``--persist``, reports each save on stdout (``saved STEP``) and, at the end, the saver
pid (``saver PID``), then blocks on stdin until killed. With ``--load`` it instead loads
the newest checkpoint and prints it as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import numpy as np

from streamrover.ckpt import Checkpointer
from streamrover.cursor import DataCursor, PartitionKey


def state_at(step: int, mib: float) -> dict[str, object]:
    n = max(1, int(mib * (1 << 20) / 4 / 4))
    return {f"w{i}": np.full(n, step, dtype=np.float32) for i in range(4)} | {"step": step}


def cursor_at(step: int) -> DataCursor:
    cursor = DataCursor()
    cursor.add(PartitionKey("clicks", 0, "p0"), 0, 10 * step)
    return cursor


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--persist", default="", help="comma-separated steps to persist (and wait for)")
    parser.add_argument("--mib", type=float, default=1.0)
    parser.add_argument("--saver", default="auto")
    parser.add_argument("--linger", type=float, default=60.0)
    parser.add_argument("--load", action="store_true")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--fork-child", action="store_true", help="fork a child that outlives us (a DataLoader worker)")
    args = parser.parse_args()
    ckpt = Checkpointer(args.root, saver=args.saver, linger=args.linger, rank=args.rank, world_size=args.world_size)
    if args.load:
        loaded = ckpt.load()
        values = {float(np.unique(v)[0]) for k, v in loaded.state.items() if k.startswith("w")}
        print(
            json.dumps(
                {
                    "step": loaded.step,
                    "source": loaded.source.value,
                    "values": sorted(values),
                    "cursor": loaded.cursor.to_json(),
                    "state_step": loaded.state["step"],
                }
            ),
            flush=True,
        )
        return 0
    persist = {int(s) for s in args.persist.split(",") if s}
    for step in range(1, args.steps + 1):
        cursor = cursor_at(step) if args.rank == 0 else None  # the manifest cursor is the union of the parts'
        ckpt.save(step, state_at(step + args.rank * 1000, args.mib), cursor=cursor, persist=step in persist)
        if step in persist:
            ckpt.wait(timeout=120)
        print(f"saved {step}", flush=True)
    if args.fork_child:
        pid = os.fork()
        if pid == 0:
            os.close(0)
            signal.pause()  # holds every inherited descriptor until killed
            os._exit(0)
        print(f"child {pid}", flush=True)
    print(f"saver {ckpt.saver_pid or 0}", flush=True)
    sys.stdin.read()  # hang until killed (the test holds our stdin open)
    return 0


if __name__ == "__main__":
    sys.exit(main())
