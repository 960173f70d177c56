"""A master restarted after a long history (issue 32, piece 4): replay time and journal bytes against shards acked.

The core (``ShardCore`` over the master's own SQLite journal, in this process) is driven at full speed: a stream
dataset of ``--partitions`` partitions is extended poll after poll, one worker leases the new shards
(``LEASE_BATCH`` a call) and acks them to their ends in one batch, and a cut is taken and committed after every
poll, as a checkpoint would. At each milestone (a tenth of ``--shards`` and ``--shards``) the journal's bytes
(database and WAL) are read; at the end the journal is closed and a real ``streamrover master`` process is started
on that state dir: the row is the time from its start until a ``status`` call is answered (replayed and serving).
The peer, in the same run: the same restart of a master whose journal holds the same dataset with no history. Goal
(issue 32): <= 5 s at 10M shards; journal bytes per million shards flat (+-10 %) between 1M and 10M (a journal that
does not grow is flat at any count).

``restart_seconds(state_dir)`` is what ``python -m benchmarks scale`` calls for its restart row.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path

from benchmarks._common import environment, load, table

#: a stream the restarted master cannot reach (its poller retries with backoff): only replay is timed
URI = "kafka://127.0.0.1:9/history"
#: shards the driver leases (then acks in one batch) at a time. A poll's 8,192 in one call cost 58 us/shard, 1,024 39:
#: a pop walks the worker's leases when its affinity misses (a partition exhausted), so one worker holding 8,192
#: leases made each such pop walk thousands (lease_order._read_by_others). What is journalled is the same.
LEASE_BATCH = 1024


def journal_bytes(state_dir: Path) -> tuple[int, int]:
    """The journal's bytes on disk: (database, WAL) (the WAL is reused, not shrunk, after a checkpoint)."""
    wal = state_dir / "journal.db-wal"
    return (state_dir / "journal.db").stat().st_size, wal.stat().st_size if wal.exists() else 0


def drive(state_dir: Path, shards: int, partitions: int, milestones: list[int]) -> list[tuple[int, int, int, float,
                                                                                           float]]:
    """Ack ``shards`` shards through a core on ``state_dir``'s journal; per milestone: (shards, database bytes, WAL
    bytes, seconds since the start, max RSS MiB)."""
    from streamrover.shard_service.api import DatasetSpec
    from streamrover.shard_service.master.bookkeeping import AckItem
    from streamrover.shard_service.master.core import ShardCore
    from streamrover.shard_service.master.journal import Journal
    from streamrover.sources.api import Partition, SourceKind

    now = [1000.0]
    core = ShardCore(Journal(state_dir / "journal.db", exclusive=True), lease_ttl=60.0, clock=lambda: now[0])
    size, per_poll = 10, 8192
    spec = DatasetSpec("history", URI, options={"sr.max_pending_shards": str(per_poll)}, records_per_shard=size)
    core.register_dataset(spec, SourceKind.STREAM, [Partition(f"p{i}", 0, 0) for i in range(partitions)], "[]")
    if not shards:
        core.journal.close()
        return []
    w = core.join("driver").id
    done, end, t0, out = 0, 0, time.perf_counter(), []
    todo = sorted(milestones)
    while done < shards:
        end += size * max(1, per_poll // partitions)
        now[0] += 0.01
        core.extend_stream("history", [Partition(f"p{i}", 0, end) for i in range(partitions)])
        while True:
            leased = core.lease(w, "history", LEASE_BATCH).leases
            if not leased:
                break
            core.ack_batch([AckItem(w, g.shard_id, g.attempt, g.end) for g in leased])
            done += len(leased)
            if done // 1_000_000 != (done - len(leased)) // 1_000_000:
                print(f"  driven: {done:,} shards acked, {time.perf_counter() - t0:.0f} s", flush=True)
        core.cut_commit(core.cut_prepare().id)
        while todo and done >= todo[0]:
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            out.append((done, *journal_bytes(state_dir), time.perf_counter() - t0, rss))
            todo.pop(0)
    core.journal.close()
    return out


def restart_seconds(state_dir: Path) -> float:
    """Seconds from starting a ``streamrover master`` on ``state_dir`` until it answers ``status``."""
    from streamrover.shard_service import ShardClient
    from streamrover.testing.procs import MasterProcess

    master = MasterProcess(state_dir, log_path=state_dir.parent / f"{state_dir.name}.log")
    t0 = time.perf_counter()
    try:
        master.start(timeout=120)
        with ShardClient(master.address, token=master.token, heartbeat=False, session=False, timeout=60) as c:
            c.status()
        return time.perf_counter() - t0
    finally:
        master.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks restart", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke-sized run (20,000 shards)")
    p.add_argument("--shards", type=int, default=None, help="shards acked before the restart (default 10,000,000)")
    p.add_argument("--partitions", type=int, default=16, help="partitions of the stream (default 16)")
    args, _ = p.parse_known_args(argv)
    shards = args.shards or (20_000 if args.quick else 10_000_000)
    print(environment())
    print(load())
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp:
        empty, full = Path(tmp) / "empty", Path(tmp) / "full"
        drive(empty, 0, args.partitions, [])
        marks = drive(full, shards, args.partitions, [max(1, shards // 10), shards])
        rows = [[f"{n:,}", f"{b:,}", f"{wal:,}", f"{(b + wal) / (n / 1e6):,.0f}", f"{t:.0f}", f"{rss:.0f}"]
                for n, b, wal, t, rss in marks]  # fmt: skip
        print(table(["shards acked", "database bytes", "WAL bytes", "journal bytes per 1M shards", "drive s",
                     "driver max RSS MiB"], rows))  # fmt: skip
        if len(marks) == 2:
            (n1, d1, w1, *_), (n2, d2, w2, *_) = marks
            b1, b2 = d1 + w1, d2 + w2
            print(f"journal bytes {n2:,} / {n1:,} shards: {b2 / b1:.2f} (flat per million shards would be "
                  f"{n2 / n1:.0f}; <= 1.1 means it does not grow with history)")  # fmt: skip
        peer = restart_seconds(empty)
        after = restart_seconds(full)
        print(table(["restart (start -> status answered)", "seconds", "ratio to no history"],
                    [["no history", f"{peer:.2f}", "1.00"],
                     [f"{shards:,} shards acked", f"{after:.2f}", f"{after / peer:.2f}"]]))  # fmt: skip
        print(f"goal: <= 5 s after 10M shards: {'met' if after <= 5 else 'NOT met'} at {shards:,} shards "
              f"(pid {os.getpid()})")  # fmt: skip
    return 0
