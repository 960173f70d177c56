"""Helpers shared by the tests (import as ``tests.helpers``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    """Wait for a condition to hold, failing the test with ``what`` if it does not within ``timeout``."""
    give_up = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def write_parquet_dataset(root: Path, rows: int, files: int, row_group_size: int, seed: int = 0) -> np.ndarray:
    """``files`` parquet files with unique int64 ids 0..rows-1 (shuffled across files); returns the ids."""
    rng = np.random.default_rng(seed)
    ids = rng.permutation(rows).astype(np.int64)
    root.mkdir(parents=True, exist_ok=True)
    for i, part in enumerate(np.array_split(ids, files)):
        table = pa.table(
            {"id": part, "x": rng.random(part.size, dtype=np.float32), "label": (part % 2).astype(np.int8)}
        )
        pq.write_table(table, root / f"part-{i:03d}.parquet", row_group_size=row_group_size)
    return ids


def end_processes_under(path: Path) -> list[int]:
    """SIGKILL every process whose command line names ``path`` (a Ray cluster in its own temp dir: ``ray stop``
    would stop every Ray of the user); the pids ended."""
    import psutil

    mine = [p for p in psutil.process_iter(["cmdline"]) if any(str(path) in a for a in p.info["cmdline"] or [])]
    for proc in mine:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(mine, timeout=30)
    return [p.pid for p in mine]
