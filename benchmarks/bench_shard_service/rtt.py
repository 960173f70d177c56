"""The round-trip bench's client processes (bench [1] of ``python -m benchmarks shard_service``).

A client loops cycles for a fixed time after a barrier (:func:`rtt_client`), or, as bench [1] runs them,
in short slices of each kind in turn against servers that all stay up (:func:`sliced_client`), so that
a ratio compares slices a second apart, not runs a minute apart on a machine whose speed drifts. One
cycle is one bare RPC for the echo kinds and one shard leased and acked for the shard kinds, which
differ in how many round trips that takes:

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
from typing import Any, NamedTuple

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


def _cycle(kind: str, address: str, dataset: str, index: int) -> Any:
    """One cycle of ``kind`` (:data:`KINDS`) as a function returning the RPCs or messages it made."""
    return _echo_cycle(kind, address) if kind.startswith("echo") else _shard_cycle(kind, address, dataset, index)


def _loop(cycle: Any, seconds: float) -> tuple[int, int, float]:
    """Run ``cycle`` for ``seconds``: (RPCs or messages, cycles, seconds taken)."""
    rpcs = made = 0
    t0 = time.perf_counter()
    stop = t0 + seconds
    while time.perf_counter() < stop:
        rpcs += cycle()
        made += 1
    return rpcs, made, time.perf_counter() - t0


def rtt_client(
    kind: str, address: str, dataset: str, duration: float, warmup: int, barrier: Barrier, out: Queue[Any], index: int
) -> None:
    """Loop cycles of ``kind`` (:data:`KINDS`) for ``duration`` seconds after the barrier.

    Puts (RPCs or messages, seconds, error, cycles).
    """
    try:
        cycle = _cycle(kind, address, dataset, index)
        for _ in range(warmup):
            cycle()
        barrier.wait(BARRIER_TIMEOUT)
        rpcs, cycles, seconds = _loop(cycle, duration)
        out.put((rpcs, seconds, "", cycles))
    except BaseException as exc:
        barrier.abort()
        out.put((0, 0.0, f"client {index}: {type(exc).__name__}: {exc}", 0))


def sliced_client(
    kinds: list[tuple[str, str, str]],
    seconds: float,
    rounds: int,
    warmup: int,
    barrier: Barrier,
    out: Queue[Any],
    index: int,
) -> None:
    """Slices of ``seconds`` of each (kind, address, dataset) in turn, ``rounds`` times; each slice starts at the
    barrier (every client and the parent), and one more barrier follows the last.

    The order of the kinds reverses every other round (A B C, C B A, ...), so that none always follows
    the same one. Puts ([(kind index, RPCs or messages, cycles, seconds)] per slice in order, error).
    """
    try:
        cycles = [_cycle(kind, address, dataset, index) for kind, address, dataset in kinds]
        for cycle in cycles:
            for _ in range(warmup):
                cycle()
        slices: list[tuple[int, int, int, float]] = []
        for i in slice_order(len(kinds), rounds):
            barrier.wait(BARRIER_TIMEOUT)
            slices.append((i, *_loop(cycles[i], seconds)))
        barrier.wait(BARRIER_TIMEOUT)
        out.put((slices, ""))
    except BaseException as exc:
        barrier.abort()
        out.put(([], f"client {index}: {type(exc).__name__}: {exc}"))


def slice_order(kinds: int, rounds: int) -> list[int]:
    """The kind of each slice: 0..k-1, then k-1..0, and so on for ``rounds`` rounds."""
    order: list[int] = []
    for r in range(rounds):
        order += list(range(kinds)) if r % 2 == 0 else list(reversed(range(kinds)))
    return order


class Turn(NamedTuple):
    """One kind's slice of one round, summed over the clients."""

    rpcs: float    # RPCs (or messages) per second
    cycles: float  # cycles per second
    cpu: float     # CPU seconds the watched processes used during it
    made: int      # cycles made


def run_sliced(
    kinds: list[tuple[str, str, str]], n: int, seconds: float, rounds: int, warmup: int, pids: list[int]
) -> list[list[Turn]]:
    """``n`` :func:`sliced_client` processes; per kind, its :class:`Turn` of each round (CPU: of ``pids``)."""
    from benchmarks._servers import cpu_seconds

    barrier = CTX.Barrier(n + 1)
    out: Queue[Any] = CTX.Queue()
    procs = [
        CTX.Process(
            target=sliced_client, args=(kinds, seconds, rounds, warmup, barrier, out, i), name=f"bench-rtt-client-{i}"
        )
        for i in range(n)
    ]
    order = slice_order(len(kinds), rounds)
    cpu: list[float] = []
    with processes(procs, grace=60):
        for _ in range(len(order) + 1):  # each slice's start, and the end of the last
            barrier.wait(BARRIER_TIMEOUT + seconds)
            cpu.append(sum(cpu_seconds(pid) for pid in pids))
        results = [out.get(timeout=BARRIER_TIMEOUT) for _ in procs]
    errors = [r[1] for r in results if r[1]]
    if errors:
        raise RuntimeError("; ".join(errors))
    per_kind: list[list[Turn]] = [[] for _ in kinds]
    for k, kind in enumerate(order):
        mine = [r[0][k] for r in results]  # (kind index, rpcs, cycles, seconds) of each client
        per_kind[kind].append(Turn(sum(m[1] / m[3] for m in mine), sum(m[2] / m[3] for m in mine),
                                   cpu[k + 1] - cpu[k], sum(m[2] for m in mine)))  # fmt: skip
    return per_kind


def write_rtt_file(path: Path, rows: int) -> None:
    """A parquet file of ``rows`` ids in one row group (one-record shards of it)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": pa.array(range(rows), pa.int64())}), str(path), row_group_size=rows)


__all__ = ["KINDS", "TOKEN", "Turn", "rtt_client", "run_sliced", "slice_order", "sliced_client", "write_rtt_file"]
