"""The servers the benchmarks talk to, each in its own process: the real master and a bare gRPC echo."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from multiprocessing.connection import Connection, wait
from multiprocessing.synchronize import Event
from typing import Any

import grpc

from benchmarks._common import CTX

ECHO_SERVICE = "streamrover.bench.Echo"
ECHO_METHOD = f"/{ECHO_SERVICE}/Echo"
ECHO_STREAM_METHOD = f"/{ECHO_SERVICE}/Stream"
MASTER_THREADS = 64  # MasterServer's default max_workers; the echo server gets the same pool


def _echo(request: bytes, context: grpc.ServicerContext) -> bytes:
    return request


def _echo_stream(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
    yield from requests


def start_echo_server(max_workers: int) -> tuple[grpc.Server, str]:
    """An echo service built from generic handlers (unary, and a stream of messages): bytes in, the same out."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
        options=[("grpc.so_reuseport", 0)],
    )
    handler = grpc.method_handlers_generic_handler(
        ECHO_SERVICE,
        {
            "Echo": grpc.unary_unary_rpc_method_handler(_echo, request_deserializer=None, response_serializer=None),
            "Stream": grpc.stream_stream_rpc_method_handler(_echo_stream),
        },
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    if port == 0:
        raise OSError("cannot listen on 127.0.0.1")
    server.start()
    return server, f"127.0.0.1:{port}"


def _serve(
    kind: str, conn: Connection, stop: Event, state_dir: str, token: str, max_workers: int
) -> None:
    try:
        if kind == "echo":
            server, address = start_echo_server(max_workers)
            conn.send(address)
            stop.wait()
            server.stop(0.5).wait()
        else:
            from streamrover.shard_service import MasterServer

            master = MasterServer(state_dir, token, host="127.0.0.1", port=0, max_workers=max_workers)
            conn.send(master.address)
            stop.wait()
            master.stop(0.5)
    except BaseException as exc:  # report to the parent instead of leaving it waiting for an address
        conn.send(f"error: {type(exc).__name__}: {exc}")
        raise


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used so far (all its threads; Linux /proc)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def server_process(
    kind: str, state_dir: str = "", token: str = "", max_workers: int = MASTER_THREADS
) -> Iterator[str]:
    """Run an ``echo`` server or a ``master`` in a child process; yields its address; stops it on exit."""
    with served(kind, state_dir, token, max_workers) as (address, _):
        yield address


@contextmanager
def served(
    kind: str, state_dir: str = "", token: str = "", max_workers: int = MASTER_THREADS
) -> Iterator[tuple[str, int]]:
    """As :func:`server_process`, yielding (address, process id) (for :func:`cpu_seconds`)."""
    if kind not in ("echo", "master"):
        raise ValueError(f"unknown server kind {kind!r}")
    parent, child = CTX.Pipe()
    stop = CTX.Event()
    proc = CTX.Process(
        target=_serve, args=(kind, child, stop, state_dir, token, max_workers), name=f"bench-{kind}"
    )
    proc.start()
    try:
        if not wait([parent, proc.sentinel], timeout=60):
            raise TimeoutError(f"the {kind} server did not start within 60s")
        if not parent.poll():
            raise RuntimeError(f"the {kind} server process exited with code {proc.exitcode} before listening")
        address: Any = parent.recv()
        if str(address).startswith("error:"):
            raise RuntimeError(f"the {kind} server failed: {address}")
        yield str(address), int(proc.pid or 0)
    finally:
        stop.set()
        proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=3)
        if proc.is_alive():
            proc.kill()
            proc.join()
