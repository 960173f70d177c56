"""How a gRPC server in Python holds many bidirectional streams: the concurrency models, measured bare.

Three servers of the same echo stream (generic handlers, bytes in and out), each in its own process:

- ``threads``: the sync server with a thread pool of one thread per stream (plus 16): each stream's
  handler blocks in its request iterator, in its own thread, for the stream's life (what the master does).
- ``aio``: ``grpc.aio``, one event loop; each stream is a coroutine, its answer made on the loop.
- ``aio+pool``: ``grpc.aio`` for the streams, each message's answer made in a pool of 2 threads
  (``run_in_executor``): the callback style, a small pool shared by every stream.

Clients (``grpc.aio``, many streams per process, over loopback) offer the same total rate of messages at
every stream count, each stream sending one message at a time on its own clock, so that latency compares
the models at equal load (a closed loop would measure only W / throughput). Measured: the server's CPU per
message (user + system, all its threads) and the p50/p99 round trip.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from multiprocessing.connection import Connection, wait
from multiprocessing.synchronize import Event
from typing import Any

import grpc

from benchmarks._common import CTX, table
from benchmarks._servers import cpu_seconds

SERVICE = "streamrover.bench.Sessions"
METHOD = f"/{SERVICE}/Stream"
MODELS = ("threads", "aio", "aio+pool")


def _work(request: bytes) -> bytes:
    return request  # the answer's own cost is the same in every model: what differs is getting to it


def _threads(streams: int) -> tuple[Any, int]:
    def stream(requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
        for request in requests:
            yield _work(request)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=streams + 16), options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, {"Stream": grpc.stream_stream_rpc_method_handler(stream)}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


async def _aio(model: str, conn: Connection, stop: Event) -> None:
    pool = futures.ThreadPoolExecutor(max_workers=2)
    loop = asyncio.get_running_loop()

    async def inline(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for request in requests:
            yield _work(request)

    async def pooled(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for request in requests:
            yield await loop.run_in_executor(pool, _work, request)

    handler = inline if model == "aio" else pooled
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, {"Stream": grpc.stream_stream_rpc_method_handler(handler)}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    conn.send(port)
    await loop.run_in_executor(None, stop.wait)
    await server.stop(0.2)


def _serve(model: str, streams: int, conn: Connection, stop: Event) -> None:
    if model == "threads":
        server, port = _threads(streams)
        conn.send(port)
        stop.wait()
        server.stop(0.2).wait()
    else:
        asyncio.run(_aio(model, conn, stop))


async def _client(port: int, streams: int, interval: float, seconds: float, warmup: float) -> list[float]:
    """``streams`` streams, each sending a message every ``interval`` s (random phase); round trips after warm-up."""
    rtts: list[float] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(METHOD)
        start = time.monotonic()
        measure_from, end = start + warmup, start + warmup + seconds

        async def one() -> None:
            stream = call()
            await asyncio.sleep(random.random() * interval)
            due = time.monotonic()
            while due < end:
                sent = time.monotonic()
                await stream.write(b"x" * 64)
                await stream.read()
                if sent >= measure_from:
                    rtts.append(time.monotonic() - sent)
                due += interval
                await asyncio.sleep(max(due - time.monotonic(), 0))  # the offered rate's clock, not synchronisation
            await stream.done_writing()

        await asyncio.gather(*(one() for _ in range(streams)))
    return rtts


def _client_main(port: int, streams: int, interval: float, seconds: float, warmup: float, out: Any) -> None:
    out.put(asyncio.run(_client(port, streams, interval, seconds, warmup)))


def measure(model: str, streams: int, rate: float, seconds: float, clients: int = 2) -> dict[str, float]:
    """One model at ``streams`` streams offered ``rate`` messages/s in total: CPU/message, p50 and p99 (ms)."""
    parent, child = CTX.Pipe()
    stop = CTX.Event()
    server = CTX.Process(target=_serve, args=(model, streams, child, stop), name=f"model-{model}")
    server.start()
    try:
        if not wait([parent, server.sentinel], timeout=60) or not parent.poll():
            raise RuntimeError(f"the {model} server did not start")
        port = parent.recv()
        out = CTX.Queue()
        warmup = 2.0
        per = [streams // clients + (i < streams % clients) for i in range(clients)]
        procs = [
            CTX.Process(target=_client_main, args=(port, n, n / (rate * n / streams), seconds, warmup, out))
            for n in per
            if n
        ]
        for p in procs:
            p.start()
        time.sleep(warmup + 0.5)  # the clients' own warm-up clock: CPU is counted over their measured window
        cpu0, t0 = cpu_seconds(server.pid or 0), time.monotonic()
        rtts = [r for _ in procs for r in out.get(timeout=seconds + 120)]
        cpu, wall = cpu_seconds(server.pid or 0) - cpu0, time.monotonic() - t0
        for p in procs:
            p.join(timeout=10)
    finally:
        stop.set()
        server.join(timeout=10)
        if server.is_alive():
            server.kill()
            server.join()
    rtts.sort()
    n = len(rtts)
    return {
        "messages": n,
        "cpu_us": cpu / max(n, 1) * 1e6 * min(1.0, seconds / max(wall, 1e-9)),
        "p50_ms": statistics.median(rtts) * 1e3 if n else float("nan"),
        "p99_ms": rtts[min(n - 1, int(n * 0.99))] * 1e3 if n else float("nan"),
    }


def run(stream_counts: tuple[int, ...], rate: float, seconds: float) -> None:
    rows = []
    base: dict[str, float] = {}
    for streams in stream_counts:
        for model in MODELS:
            m = measure(model, streams, rate, seconds)
            if model == "threads" and streams == stream_counts[0]:
                base = m
            rows.append([
                model, streams, int(m["messages"]), m["cpu_us"], m["p50_ms"], m["p99_ms"],
                m["cpu_us"] / base["cpu_us"], m["p99_ms"] / base["p99_ms"],
            ])  # fmt: skip
            print(f"  {model} at {streams} streams: {m}", flush=True)
    print(f"\nconcurrency models, {rate:,.0f} messages/s offered in total, {seconds:.0f} s each (pid {os.getpid()})")
    print(table(
        ["model", "streams", "messages", "server CPU us/msg", "p50 ms", "p99 ms", "CPU vs threads@first",
         "p99 vs threads@first"], rows,
    ))  # fmt: skip


__all__ = ["MODELS", "measure", "run"]
