"""Simulated workers for scale tests and benches: many worker sessions per process, over real gRPC.

A real worker is one :class:`~streamrover.shard_service.ShardClient` per process; a thousand of them would
need a thousand processes. A swarm process runs ``sessions`` workers on one ``grpc.aio`` event loop and one
channel: each joins (``Join``), opens its own ``WorkerSession`` stream and sends on it exactly what a client
sends (a lease of one shard, an ack of its end: the records are not read), one message at a time.

The parent drives the swarm in two steps: every session first answers a heartbeat on its stream (the
process then reports ``("ready", n)``: the master serves ``n`` streams of it); at ``go`` they lease and
ack until the dataset ends (a batch dataset's END) or ``seconds`` pass. Each process then reports its
ledger (the ``(shard id, attempt)`` of every ack the master recorded, duplicates apart), the lease and
ack round trips (a lease answered WAIT on the stream then waits with the unary long poll, as
:meth:`ShardClient.lease` does: not counted as a round trip) and the errors. ``think`` seconds between a
lease and its ack pace a worker (its "training"; each starts at a random phase of it); 0 runs the loop flat out.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import random
import time
from dataclasses import dataclass, field
from typing import Any

from streamrover.shard_service.v1 import shard_service_pb2 as pb
from streamrover.shard_service.v1 import shard_service_pb2_grpc as pb_grpc

CTX = mp.get_context("spawn")  # gRPC does not survive fork once a channel exists


@dataclass
class SwarmResult:
    """What one swarm process saw: acks recorded, round trips (seconds), errors."""

    acked: list[tuple[str, int]] = field(default_factory=list)  # (shard id, attempt) the master recorded
    duplicates: int = 0
    lease_rtt: list[float] = field(default_factory=list)
    ack_rtt: list[float] = field(default_factory=list)
    waits: int = 0  # leases answered WAIT (nothing to lease now)
    errors: list[str] = field(default_factory=list)


class _Refused(Exception):
    pass


class _Session:
    def __init__(self, stub: Any, metadata: tuple[tuple[str, str], ...], worker_id: str) -> None:
        self.call = stub.WorkerSession(metadata=metadata)
        self.worker_id = worker_id
        self.seq = 0

    async def ask(self, **kind: Any) -> pb.SessionResponse:
        self.seq += 1
        await self.call.write(pb.SessionRequest(seq=self.seq, **kind))
        answer = await self.call.read()
        if not isinstance(answer, pb.SessionResponse):
            raise _Refused(f"the master ended the stream ({await self.call.code()}: {await self.call.details()})")
        if answer.error_code:
            raise _Refused(f"{answer.error_code}: {answer.error}")
        if answer.seq != self.seq:
            raise _Refused(f"answer {answer.seq} to message {self.seq}")
        return answer


async def _swarm(
    address: str, token: str, dataset: str, sessions: int, name: str, ready: Any, go: Any, seconds: float,
    think: float,
) -> SwarmResult:  # fmt: skip
    import grpc

    result = SwarmResult()
    metadata = (("authorization", f"Bearer {token}"),)
    loop = asyncio.get_running_loop()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.ShardServiceStub(channel)

        async def open_one(i: int) -> _Session:
            request = pb.JoinRequest(name=f"{name}-{i}")
            joined = await stub.Join(request, metadata=metadata, wait_for_ready=True)  # type: ignore[misc]
            session = _Session(stub, metadata, joined.worker_id)
            await session.ask(heartbeat=pb.HeartbeatRequest(worker_id=joined.worker_id))  # served: counted
            return session

        opened = await asyncio.gather(*(open_one(i) for i in range(sessions)), return_exceptions=True)
        live = [s for s in opened if isinstance(s, _Session)]
        result.errors += [f"opening a session: {e!r}" for e in opened if not isinstance(e, _Session)]
        ready.put(("ready", len(live)))
        await loop.run_in_executor(None, go.wait)
        end = time.monotonic() + seconds

        async def work(s: _Session) -> None:
            request_id = 0
            await asyncio.sleep(random.random() * think)  # each its own phase: workers do not start in step
            while time.monotonic() < end:
                request_id += 1
                t0 = time.monotonic()
                lease = (await s.ask(lease=pb.LeaseRequest(
                    worker_id=s.worker_id, dataset=dataset, max_shards=1, request_id=request_id))).lease  # fmt: skip
                result.lease_rtt.append(time.monotonic() - t0)
                if lease.status == pb.LEASE_STATUS_END:
                    return
                if lease.status == pb.LEASE_STATUS_WAIT:  # as ShardClient.lease(): wait with the unary long poll
                    result.waits += 1
                    request_id += 1
                    lease = await stub.LeaseShards(pb.LeaseRequest(  # type: ignore[misc]
                        worker_id=s.worker_id, dataset=dataset, max_shards=1, request_id=request_id,
                        wait_seconds=min(max(end - time.monotonic(), 0.0), 1.0)), metadata=metadata)  # fmt: skip
                    if lease.status == pb.LEASE_STATUS_END:
                        return
                if think:
                    await asyncio.sleep(think)  # the worker's "training" of the shard
                for granted in lease.leases:
                    t0 = time.monotonic()
                    ack = (await s.ask(ack=pb.AckRequest(
                        worker_id=s.worker_id, shard_id=granted.shard_id, attempt=granted.attempt,
                        position=granted.end))).ack  # fmt: skip
                    result.ack_rtt.append(time.monotonic() - t0)
                    if ack.duplicate:
                        result.duplicates += 1
                    else:
                        result.acked.append((granted.shard_id, granted.attempt))

        outcomes = await asyncio.gather(*(work(s) for s in live), return_exceptions=True)
        result.errors += [repr(e) for e in outcomes if isinstance(e, BaseException)]
        for s in live:
            await s.call.done_writing()
    return result


def _main(
    address: str, token: str, dataset: str, sessions: int, name: str, ready: Any, go: Any, seconds: float,
    think: float,
) -> None:  # fmt: skip
    try:
        result = asyncio.run(_swarm(address, token, dataset, sessions, name, ready, go, seconds, think))
    except BaseException as exc:  # reported, not lost: the parent waits for a result from every process
        result = SwarmResult(errors=[f"swarm process {name}: {exc!r}"])
        ready.put(("ready", 0))
    ready.put(("result", result))


class Swarm:
    """``processes`` swarm processes of ``sessions`` simulated workers in all, on ``dataset`` of the master."""

    def __init__(
        self, address: str, token: str, dataset: str, sessions: int, processes: int = 4, seconds: float = 3600.0,
        think: float = 0.0,
    ) -> None:  # fmt: skip
        self._queue: Any = CTX.Queue()
        self._go = CTX.Event()
        counts = [sessions // processes + (i < sessions % processes) for i in range(processes)]
        self._procs = [
            CTX.Process(
                target=_main,
                args=(address, token, dataset, n, f"swarm{i}", self._queue, self._go, seconds, think),
                name=f"swarm{i}",
                daemon=True,
            )
            for i, n in enumerate(counts)
            if n
        ]
        self._results: list[SwarmResult] = []
        self._ready = 0

    def start(self, timeout: float = 120.0) -> int:
        """Start the processes; returns once each has opened its sessions: how many answered on their stream."""
        for p in self._procs:
            p.start()
        ready = 0
        for _ in self._procs:
            kind, value = self._queue.get(timeout=timeout)
            if kind == "result":  # a process failed before it was ready
                self._results.append(value)
                continue
            ready += value
        self._ready = ready
        return ready

    def run(self, timeout: float = 600.0) -> SwarmResult:
        """Let every session work; returns once every process has reported: their results merged."""
        self._go.set()
        deadline = time.monotonic() + timeout
        while len(self._results) < len(self._procs):
            kind, value = self._queue.get(timeout=max(deadline - time.monotonic(), 0.1))
            if kind == "result":
                self._results.append(value)
        merged = SwarmResult()
        for r in self._results:
            merged.acked += r.acked
            merged.duplicates += r.duplicates
            merged.lease_rtt += r.lease_rtt
            merged.ack_rtt += r.ack_rtt
            merged.waits += r.waits
            merged.errors += r.errors
        return merged

    def close(self) -> None:
        """Join the processes (kill what is left)."""
        self._go.set()
        for p in self._procs:
            if p.pid is None:
                continue
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()

    def __enter__(self) -> Swarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Swarm", "SwarmResult"]
