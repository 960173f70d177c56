"""The shard service against its peers (issue 2's acceptance benches).

1. Lease+ack round trips with 1, 4 and 16 client processes over loopback, against
   a real master (its own process, SQLite journal in a temporary directory, shards
   of 1 record so that only the lease+ack cycle is measured), as a ratio to a bare
   gRPC echo service (generic handlers, bytes in and out) with the same server
   thread pool and the same number of client processes. Two worker patterns
   (:mod:`benchmarks.bench_shard_service.rtt`): lease() then ack(), two RPCs, the ratio RPC for RPC;
   and a worker leasing one shard ahead (the ack that finishes a shard brings the
   next lease, as ``ShardClient.shards()`` does), one message per cycle, the ratio
   a whole cycle against one bare RPC. Goal: >= 0.8. The echo server and the master stay up
   together and the kinds take turns of half a second, round after round, so that each ratio
   compares turns a second apart: on these VMs a machine's speed drifts by 2-3x within a minute
   (steal time), and runs of seconds each, one kind after another, put 0.5-1.3 in one column.
2. Records per second through ``ShardClient`` (lease, ``shard.batches()``, ack at
   the shard's end) against pyarrow reading the same parquet row groups directly,
   the same per-batch work in both, with 1 and 2 worker processes. Goal (issue 14): >= 0.9 with
   10,000-record shards at 1 and 2 workers; >= 0.95 / 0.9 with one row group per shard.
   Acks are queued (``ShardClient(async_acks=True)``; ``--acks sync``, the client's
   default, waits for each); a pass ends when the master has recorded the last ack,
   not when ``ack()`` returned. Each side makes one warm-up pass per configuration first
   (not counted): the processes' first pass pays imports and first touches on both sides. The two
   alternate pass by pass, and which of them goes first alternates too.

Every client process is started before its clock starts and waits on a barrier;
process start-up and imports are outside the measurement.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

from benchmarks._common import CTX, cores, environment, load, processes, table
from benchmarks._servers import MASTER_THREADS, cpu_seconds, served, server_process
from benchmarks.bench_shard_service.rtt import BARRIER_TIMEOUT, TOKEN, run_sliced, write_rtt_file

RECORDS_WARMUP = 1  # records bench: passes per configuration, both sides, made before the measured ones


@dataclass(frozen=True)
class Sizes:
    clients: tuple[int, ...]
    slice_seconds: float     # round trips: each kind's turn, per round
    rtt_rounds: int          # rounds of turns (echo, stream echo, lease+ack, ack+next) per client count
    warmup: int              # cycles of each kind each client runs before the first turn
    rtt_shards: int          # one-record shards planned per round-trip dataset (100 epochs of them)
    files: int
    rows: int                # total rows over all files
    row_group: int
    batch_size: int
    shard_sizes: tuple[int, ...]
    repeats: int


FULL = Sizes((1, 4, 16), 0.5, 12, 50, 20_000, 8, 4_000_000, 128 * 1024, 4096, (10_000, 128 * 1024), 15)
QUICK = Sizes((1, 4), 0.25, 2, 10, 5_000, 4, 200_000, 16 * 1024, 4096, (10_000,), 1)


# --------------------------------------------------------------------------- round trips
def bench_round_trips(tmp: Path, sizes: Sizes, session: bool = True) -> list[tuple[Any, ...]]:
    """Per client count: echo, stream echo, the master (lease, ack), the master (ack leasing the next), in turns.

    Both servers (the echo and a fresh master) stay up through the count's rounds; each round gives every kind
    one slice of ``sizes.slice_seconds`` in turn (:func:`benchmarks.bench_shard_service.rtt.run_sliced`), and a
    ratio is taken per round, between slices a second apart. The master's CPU (all its threads, from /proc) is
    summed over its kind's slices: per acked shard.
    """
    from streamrover.shard_service import DatasetSpec, ShardClient

    data = tmp / "rtt.parquet"
    write_rtt_file(data, sizes.rtt_shards)
    rows = []
    for n in sizes.clients:
        state = tempfile.mkdtemp(prefix=f"master-{n}-", dir=tmp)
        with server_process("echo", max_workers=MASTER_THREADS) as echo_address, served(
            "master", state, TOKEN, MASTER_THREADS
        ) as (address, pid):
            admin = ShardClient(address, token=TOKEN, heartbeat=False)
            for name in ("rtt", "rtt-ahead"):  # epochs > 1 only as a margin: a faster machine plans more epochs
                admin.register_dataset(DatasetSpec(name, str(data), records_per_shard=1, epochs=100))
            admin.close()
            kinds = [
                ("echo", echo_address, ""),
                ("echo-stream", echo_address, ""),
                ("shard" if session else "shard-unary", address, "rtt"),
                ("shard-ahead", address, "rtt-ahead"),
            ]
            echo, stream, shard, ahead = run_sliced(kinds, n, sizes.slice_seconds, sizes.rtt_rounds, sizes.warmup,
                                                    [pid])  # fmt: skip
        med = statistics.median
        ratios = [b.rpcs / a.rpcs for a, b in zip(echo, shard)]
        ahead_ratios = [b.cycles / a.rpcs for a, b in zip(echo, ahead)]
        cpu = sum(t.cpu for t in shard) / sum(t.made for t in shard)
        cpu_ahead = sum(t.cpu for t in ahead) / sum(t.made for t in ahead)
        print(
            f"  {n:>2} clients, {len(echo)} rounds: lease+ack {med(t.rpcs for t in shard):,.0f} RPC/s, "
            f"echo {med(t.rpcs for t in echo):,.0f} RPC/s, stream echo {med(t.rpcs for t in stream):,.0f} msg/s; "
            f"ratio per round {' '.join(f'{r:.2f}' for r in ratios)}; ack+next per round "
            f"{' '.join(f'{r:.2f}' for r in ahead_ratios)}; load {load()}",
            flush=True,
        )
        rows.append((
            n, med(t.rpcs for t in shard) / 2, med(t.rpcs for t in echo), med(ratios),
            f"{min(ratios):.2f}-{max(ratios):.2f}", med(b.rpcs / a.rpcs for a, b in zip(stream, shard)), cpu * 1e6,
            med(t.cycles for t in ahead), med(t.rpcs / t.cycles for t in ahead), med(ahead_ratios),
            f"{min(ahead_ratios):.2f}-{max(ahead_ratios):.2f}", med(b.cycles / a.rpcs for a, b in zip(stream, ahead)),
            cpu_ahead * 1e6,
        ))  # fmt: skip
    return rows


# --------------------------------------------------------------------------- records
def _touch(batch: Any) -> tuple[int, float]:
    """The per-batch work both readers do: count the rows and sum a float column in numpy."""
    return batch.num_rows, float(batch.column(2).to_numpy().sum())


def _pyarrow_reader(
    parts: list[tuple[str, int]], batch_size: int, repeats: int, barrier: Barrier, out: Queue[Any]
) -> None:
    """Read ``parts`` (path, row group) directly, once per pass; a pass starts at the barrier."""
    import pyarrow.parquet as pq

    try:
        for _ in range(repeats):
            barrier.wait(BARRIER_TIMEOUT)
            t0 = time.monotonic()
            rows, total = 0, 0.0
            files: dict[str, Any] = {}
            for path, rg in parts:
                pf = files.get(path)
                if pf is None:
                    pf = files[path] = pq.ParquetFile(path)
                for batch in pf.read_row_group(rg).to_batches(max_chunksize=batch_size):
                    n, s = _touch(batch)
                    rows, total = rows + n, total + s
            end = time.monotonic()
            out.put((rows, total, t0, end, end, ""))
    except BaseException as exc:
        barrier.abort()
        out.put((0, 0.0, 0.0, 0.0, 0.0, f"pyarrow reader: {type(exc).__name__}: {exc}"))


def _shard_reader(
    address: str,
    datasets: list[str],
    batch_size: int,
    async_acks: bool,
    session: bool,
    index: int,
    barrier: Barrier,
    out: Queue[Any],
) -> None:
    """Consume one dataset per pass through ShardClient, acking each shard at its end."""
    from streamrover.shard_service import ShardClient

    try:
        for dataset in datasets:
            # Connecting and joining happen once per worker in a real job: outside the clock, like the
            # pyarrow reader's process start. The clock covers leasing, reading and acking every shard.
            name = f"bench-reader-{index}"
            with ShardClient(address, token=TOKEN, name=name, async_acks=async_acks, session=session) as client:
                client.join()
                barrier.wait(BARRIER_TIMEOUT)
                t0 = time.monotonic()
                rows, total = 0, 0.0
                for shard in client.shards(dataset, wait=5.0):
                    for batch in shard.batches(batch_size):
                        n, s = _touch(batch.records)
                        rows, total = rows + n, total + s
                    shard.ack()
                client.flush()  # already done: shards() waits for queued acks before asking for more
                # the clock stops when the master recorded this worker's last ack, not when it learnt of END
                last_ack = client.last_ack_answered
            out.put((rows, total, t0, last_ack, time.monotonic(), ""))
    except BaseException as exc:
        barrier.abort()
        out.put((0, 0.0, 0.0, 0.0, 0.0, f"shard reader {index}: {type(exc).__name__}: {exc}"))


def _write_files(root: Path, sizes: Sizes) -> list[tuple[str, int]]:
    """``sizes.files`` parquet files; returns every (path, row group)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(7)
    per_file = sizes.rows // sizes.files
    parts = []
    for f in range(sizes.files):
        ids = np.arange(f * per_file, (f + 1) * per_file, dtype=np.int64)
        t = pa.table(
            {
                "id": ids,
                "user": rng.integers(0, 1 << 20, per_file, dtype=np.int64),
                "x": rng.random(per_file, dtype=np.float32),
                "y": rng.random(per_file, dtype=np.float32),
            }
        )
        path = root / f"part-{f:03d}.parquet"
        pq.write_table(t, str(path), row_group_size=sizes.row_group)
        parts += [(str(path), rg) for rg in range(pq.ParquetFile(str(path)).num_row_groups)]
    return parts


@dataclass(frozen=True)
class Run:
    wall: float      # seconds from the first worker's start to the last record acked (pyarrow: read)
    rows: int
    checksum: float
    tail: float      # seconds from the last ack until every worker has left (learnt that the dataset ended)

    @property
    def rate(self) -> float:
        return self.rows / self.wall


class _Readers:
    """Reader processes, one per argument tuple, that make one pass each time :meth:`run` is called."""

    def __init__(self, target: Any, args: list[tuple[Any, ...]]) -> None:
        self.workers = len(args)
        self.barrier = CTX.Barrier(self.workers + 1)  # this process releases every pass
        self.out: Queue[Any] = CTX.Queue()
        self.procs = [CTX.Process(target=target, args=(*a, self.barrier, self.out)) for a in args]

    def run(self) -> Run:
        """One pass: from the first worker's start to the last record acked (pyarrow: read)."""
        self.barrier.wait(BARRIER_TIMEOUT)
        results = [self.out.get(timeout=300) for _ in range(self.workers)]
        errors = [r[-1] for r in results if r[-1]]
        if errors:
            raise RuntimeError("; ".join(errors))
        last = max(r[3] for r in results)
        return Run(
            last - min(r[2] for r in results),
            sum(r[0] for r in results),
            sum(r[1] for r in results),
            max(r[4] for r in results) - last,
        )


def bench_records(tmp: Path, sizes: Sizes, async_acks: bool = True, session: bool = True) -> list[tuple[Any, ...]]:
    """Per (workers, records per shard): passes of pyarrow and of ShardClient, alternating; ratio per pair."""
    from streamrover.shard_service import DatasetSpec, ShardClient

    root = tmp / "records"
    root.mkdir()
    parts = _write_files(root, sizes)
    rows_out: list[tuple[Any, ...]] = []
    expected: tuple[int, float] | None = None
    with served("master", str(tmp / "master-records"), TOKEN, MASTER_THREADS) as (address, pid):
        admin = ShardClient(address, token=TOKEN, heartbeat=False)
        for workers in (1, 2):
            for shard_size in sizes.shard_sizes:
                passes = sizes.repeats + RECORDS_WARMUP
                names = [f"rec-w{workers}-s{shard_size}-r{r}" for r in range(passes)]
                shards = 0
                for name in names:  # registration (planning) is job set-up, outside the clock
                    spec = DatasetSpec(name, str(root / "*.parquet"), records_per_shard=shard_size)
                    shards = admin.register_dataset(spec).dataset.shards.todo
                split = [(parts[i::workers], sizes.batch_size, passes) for i in range(workers)]
                peer = _Readers(_pyarrow_reader, split)
                ours = _Readers(
                    _shard_reader,
                    [(address, names, sizes.batch_size, async_acks, session, i) for i in range(workers)],
                )
                pairs: list[tuple[Run, Run]] = []
                master_cpu: list[float] = []
                with processes(peer.procs + ours.procs, grace=60):
                    for k in range(passes):  # alternate, so that both see the same machine; who goes first too
                        peer_run = peer.run() if k % 2 == 0 else None
                        cpu0 = cpu_seconds(pid)
                        our_run = ours.run()
                        master_cpu.append((cpu_seconds(pid) - cpu0) / shards)
                        pairs.append((peer.run() if peer_run is None else peer_run, our_run))
                for a, b in pairs:  # the same records, each once (the float sum only up to summation order)
                    expected = expected or (a.rows, a.checksum)
                    for run in (a, b):
                        if run.rows != expected[0] or abs(run.checksum - expected[1]) > 1e-6 * abs(expected[1]):
                            raise RuntimeError(f"a pass saw {run.rows} rows (sum {run.checksum}), expected {expected}")
                pairs = pairs[RECORDS_WARMUP:]  # each side's first pass in its processes: imports, first touches
                ratio = statistics.median(b.rate / a.rate for a, b in pairs)
                peer_rate = statistics.median(a.rate for a, _ in pairs)
                rate = statistics.median(b.rate for _, b in pairs)
                # worker time per shard beyond what pyarrow needs for the same records
                per_shard = statistics.median((b.wall - a.wall) * workers / shards for a, b in pairs)
                tail = statistics.median(b.tail for _, b in pairs)
                spread = f"{min(b.rate / a.rate for a, b in pairs):.2f}-{max(b.rate / a.rate for a, b in pairs):.2f}"
                cpu = statistics.fmean(master_cpu[RECORDS_WARMUP:]) * 1e6  # a mean: /proc counts 10 ms ticks
                rows_out.append((workers, shard_size, shards, rate, peer_rate, ratio, spread, per_shard * 1e3,
                                 tail * 1e3, cpu))
                print(
                    f"  {workers} worker(s), {shard_size} records/shard ({shards} shards): ShardClient {rate:,.0f} "
                    f"rec/s, pyarrow {peer_rate:,.0f} rec/s, ratio {ratio:.2f}; master CPU {cpu:,.0f} us/shard; "
                    f"load {load()}",
                    flush=True,
                )
        admin.close()
    return rows_out


# --------------------------------------------------------------------------- main
def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks shard_service", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a smoke-sized run (seconds, not minutes)")
    parser.add_argument("--only", choices=["rtt", "records"], help="run one of the two benches")
    parser.add_argument(
        "--acks", choices=["async", "sync"], default="async",
        help="records bench: queued acks (async_acks=True) or a synchronous ack per shard (ShardClient's default)",
    )  # fmt: skip
    parser.add_argument(
        "--session", choices=["on", "off"], default="on",
        help="worker calls on ShardClient's session stream (on, its default) or one unary call each (off)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    session = args.session == "on"
    sizes = QUICK if args.quick else FULL
    print(environment())
    print(f"load average at start: {load()}")
    if cores() < 4:
        print(f"note: {cores()} cores: server and client processes share them, so both sides of each ratio do too")
    with tempfile.TemporaryDirectory(prefix="bench-shard-") as tmpdir:
        tmp = Path(tmpdir)
        if args.only in (None, "rtt"):
            print(
                f"\n[1] lease+ack round trips: one-record shards, {sizes.rtt_rounds} rounds of a "
                f"{sizes.slice_seconds}s turn per kind, {MASTER_THREADS} server threads, one process per client, "
                "journal durability 'normal'"
            )
            rtt = bench_round_trips(tmp, sizes, session)
            print(
                table(
                    [
                        "clients", "lease+ack cycles/s", "echo RPCs/s", "ratio (RPC/RPC)", "per round",
                        "vs stream echo", "master CPU us/shard", "ack+next cycles/s", "msg/cycle",
                        "ratio (cycle/RPC)", "per round", "vs stream echo", "master CPU us/shard",
                    ],
                    rtt,
                )
            )
            how = "worker session messages" if session else "unary RPCs"
            print(
                f"lease+ack = lease(), then ack(): 2 round trips ({how}"
                "); ratio = its RPCs/s / echo RPCs/s;\nack+next = a worker leasing one shard ahead (as shards() does): "
                "the ack that finishes a shard\nbrings the next lease (lease_more=1), one session message per cycle; "
                "ratio = its cycles/s / echo RPCs/s\n(a whole cycle against one bare RPC); echo = one bare unary RPC; "
                "stream echo = one message each way on one bare\nstream; rates and ratios are medians over rounds "
                "(each kind a turn per round, both servers up); goal: >= 0.8\nmaster CPU = the master process's "
                "user+system CPU over its slices / shards acked"
            )
        if args.only in (None, "records"):
            print(
                f"\n[2] records/s: {sizes.files} parquet files, {sizes.rows:,} rows, row groups of "
                f"{sizes.row_group:,}, batches of {sizes.batch_size}, {sizes.repeats} passes each after "
                f"{RECORDS_WARMUP} warm-up pass, {args.acks} acks"
            )
            rec = bench_records(tmp, sizes, args.acks == "async", session)
            print(
                table(
                    [
                        "workers", "records/shard", "shards", "ShardClient rec/s", "pyarrow rec/s", "ratio",
                        "ratio per pass", "extra ms/shard", "END tail ms", "master CPU us/shard",
                    ],
                    rec,
                )
            )
            print(
                "pyarrow = the same row groups split over the same number of processes; goal: ratio >= 0.9 at "
                "10,000 records/shard (1 and 2 workers), >= 0.95 / 0.9 at one row group per shard\n"
                "ratio = median over passes of ShardClient rec/s / pyarrow rec/s, the two alternating pass by pass\n"
                "extra ms/shard = worker time per shard beyond pyarrow's reading; END tail = last ack until every "
                "worker has seen END (not in the rates)\nmaster CPU = the master process's user+system CPU over a pass "
                "(until its workers have left), mean over passes / planned shards"
            )
    print(f"\nload average at end: {load()}")
    return 0
