"""tests/trainers/ledger_train.py, plus a memory hog: once ``HOG_FILE`` exists, rank 0 holds ``HOG_MB`` MiB.

The test creates the file mid-run. Under a node memory limit below the hog, the kernel's
OOM killer kills the worker; the supervisor relaunches the node with more memory, where
the hog (allocated again at once, the file still exists) fits and training goes on.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.trainers import ledger_train

_held: list[np.ndarray] = []


def _hog(flag: Path, mib: int, stop: threading.Event) -> None:
    while not flag.exists():
        if stop.wait(0.1):  # the test's trigger is a file: poll it
            return
    block = np.ones(mib * 2**20 // 8)  # touched: resident, charged to the node's cgroup
    _held.append(block)
    print(f"hog: holding {mib} MiB (node memory limit {os.environ.get('STREAMROVER_NODE_MEMORY')})", flush=True)


if __name__ == "__main__":
    stop = threading.Event()
    if os.environ.get("HOG_FILE") and os.environ.get("RANK") == "0":
        threading.Thread(target=_hog, args=(Path(os.environ["HOG_FILE"]), int(os.environ["HOG_MB"]), stop),
                         daemon=True).start()  # fmt: skip
    try:
        ledger_train.main()
    finally:
        stop.set()
