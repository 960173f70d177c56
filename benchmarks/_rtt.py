"""The round-trip bench's client processes (bench [1] of ``python -m benchmarks shard_service``).

A client loops cycles for a fixed time after a barrier. One cycle is one bare RPC for the echo kinds
and one shard leased and acked for the shard kinds, which differ in how many round trips that takes:

- ``shard``: ``lease()`` then ``ack()``, two worker-session messages (``shard-unary``: two unary RPCs);
- ``shard-ahead``: the steady state of a worker that leases one shard ahead, as ``ShardClient.shards()``
  does: the ack that finishes a shard asks for the next one (``lease_more=1``) and its answer brings it,
  so a cycle is one message; when no lease came back (never in this bench unless the master ran dry) the
  cycle makes a ``lease()`` first and counts two.
"""

from __future__ import annotations

import os
import time
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

from benchmarks._common import CTX, processes
from benchmarks._servers import ECHO_METHOD, ECHO_STREAM_METHOD

TOKEN = "bench-token"
ECHO_PAYLOAD = 160  # bytes each way; about a LeaseResponse for a one-record shard
BARRIER_TIMEOUT = 120.0
KINDS = ("echo", "echo-stream", "shard", "shard-unary", "shard-ahead")


def _echo_cycle(kind: str, address: str) -> Any:
    import grpc

    channel = grpc.insecure_channel(address)
    payload = os.urandom(ECHO_PAYLOAD)
    if kind == "echo":
        echo = channel.unary_unary(ECHO_METHOD)

        def cycle() -> int:
            echo(payload, timeout=30)
            return 1

        return cycle
    import queue

    sent: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    answers = channel.stream_stream(ECHO_STREAM_METHOD)(iter(sent.get, None))

    def stream_cycle() -> int:
        sent.put(payload)
        next(answers)
        return 1

    return stream_cycle


def _shard_cycle(kind: str, address: str, dataset: str, index: int) -> Any:
    from streamrover.shard_service import ShardClient

    client = ShardClient(address, token=TOKEN, name=f"bench-rtt-{index}", session=kind != "shard-unary")
    client.join()

    def lease_one() -> Any:
        _, leased = client.lease(dataset, 1, wait=5.0)
        if not leased:
            raise RuntimeError(f"dataset {dataset!r} ran out of shards: plan more (rtt_shards)")
        return leased[0]

    if kind != "shard-ahead":

        def cycle() -> int:
            shard = lease_one()
            shard.ack(shard.lease.end)
            return 2

        return cycle
    ahead = client.leases.waiting(dataset)  # where the leases an ack's answer brings are kept (as for shards())

    def ahead_cycle() -> int:
        rpcs = 1
        if not ahead:
            ahead.append(lease_one())
            rpcs += 1
        shard = ahead.popleft()
        client.send_ack(shard.lease, shard, shard.lease.end, None, 0, 1, True)  # lease_more=1, waiting for it
        return rpcs

    return ahead_cycle


def rtt_client(
    kind: str, address: str, dataset: str, duration: float, warmup: int, barrier: Barrier, out: Queue[Any], index: int
) -> None:
    """Loop cycles of ``kind`` (:data:`KINDS`) for ``duration`` seconds after the barrier.

    Puts (RPCs or messages, seconds, error, cycles).
    """
    try:
        cycle = _echo_cycle(kind, address) if kind.startswith("echo") else _shard_cycle(kind, address, dataset, index)
        for _ in range(warmup):
            cycle()
        barrier.wait(BARRIER_TIMEOUT)
        rpcs = cycles = 0
        t0 = time.perf_counter()
        stop = t0 + duration
        while time.perf_counter() < stop:
            rpcs += cycle()
            cycles += 1
        out.put((rpcs, time.perf_counter() - t0, "", cycles))
    except BaseException as exc:
        barrier.abort()
        out.put((0, 0.0, f"client {index}: {type(exc).__name__}: {exc}", 0))


def write_rtt_file(path: Path, rows: int) -> None:
    """A parquet file of ``rows`` ids in one row group (one-record shards of it)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": pa.array(range(rows), pa.int64())}), str(path), row_group_size=rows)


def run_rtt(kind: str, address: str, dataset: str, n: int, duration: float, warmup: int) -> tuple[float, float, int]:
    """(RPCs per second, cycles per second, both summed over ``n`` client processes; cycles made)."""
    barrier = CTX.Barrier(n)
    out: Queue[Any] = CTX.Queue()
    procs = [
        CTX.Process(
            target=rtt_client,
            args=(kind, address, dataset, duration, warmup, barrier, out, i),
            name=f"bench-{kind}-client-{i}",
        )
        for i in range(n)
    ]
    with processes(procs, grace=duration + 60):
        results = [out.get(timeout=BARRIER_TIMEOUT + duration + 60) for _ in procs]
    errors = [r[2] for r in results if r[2]]
    if errors:
        raise RuntimeError("; ".join(errors))
    rpcs = sum(r[0] / r[1] for r in results)
    cycles = sum(r[3] / r[1] for r in results)
    return rpcs, cycles, sum(r[3] for r in results)


__all__ = ["KINDS", "TOKEN", "rtt_client", "run_rtt", "write_rtt_file"]
