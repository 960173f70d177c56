"""Reader processes for bench_streams: started once, one timed pass per job, results through a queue.

A pass: the parent puts one job per process, every process takes its job and waits on
a barrier with the parent; the clock of each process starts when the barrier releases.
Each process puts one :data:`Result` per pass. Process start-up and imports stay
outside every measurement.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from typing import Any, NamedTuple

from benchmarks._common import CTX

BARRIER_TIMEOUT = 180.0



class Result(NamedTuple):
    """One process's pass; times are ``time.monotonic()``, ``cpu`` is the process's CPU seconds (all threads)."""

    records: int
    value_bytes: int
    t0: float
    last: float          # the last record acked (raw: consumed)
    end: float           # the process finished its pass
    cpu: float
    extra: Any = None
    error: str = ""

Job = Callable[[Any, Any], Result]  # run(job, shared)


@dataclass(frozen=True)
class Pass:
    wall: float       # seconds from the first process's start to the last record acked (raw: consumed)
    records: int
    value_bytes: int
    tail: float       # seconds from the last ack until every process had finished its pass
    cpu: float        # CPU seconds of the reader processes (not the broker's, not the master's)
    extras: list[Any]
    others: dict[str, float] = field(default_factory=dict)  # CPU seconds of other processes during the pass

    @property
    def rate(self) -> float:
        return self.records / self.wall if self.wall > 0 else 0.0


def serve(
    run: Job, label: str, imports: tuple[str, ...], shared: Any, jobs: Queue[Any], barrier: Barrier, out: Queue[Any]
) -> None:
    """The body of a pool process: ``run(job, shared)`` once per job, after the barrier, until a ``None`` job.

    ``imports`` are imported first: module loading is process start-up, not part of any pass.
    """
    for module in imports:
        importlib.import_module(module)
    while True:
        job = jobs.get()
        if job is None:
            return
        try:
            barrier.wait(BARRIER_TIMEOUT)
            out.put(run(job, shared))
        except BaseException as exc:  # report instead of leaving the parent waiting
            barrier.abort()
            now = time.monotonic()
            out.put(Result(0, 0, now, now, now, 0.0, None, f"{label}: {type(exc).__name__}: {exc}"))
            if not isinstance(exc, Exception):
                raise


class Pool:
    """``size`` processes that each call ``run(job, shared)`` once per pass; :meth:`run` makes one pass.

    ``shared`` (a ``CTX.Value``...) is handed to the processes when they start: synchronised
    objects cannot travel in a job.
    """

    def __init__(self, run: Job, size: int, name: str, shared: Any = None, imports: tuple[str, ...] = ()) -> None:
        self.size = size
        self.barrier = CTX.Barrier(size + 1)  # this process releases every pass
        self.out: Queue[Any] = CTX.Queue()
        self.jobs: list[Queue[Any]] = [CTX.Queue() for _ in range(size)]
        self.procs = [
            CTX.Process(
                target=serve, args=(run, f"{name} {i}", imports, shared, q, self.barrier, self.out), name=f"{name}-{i}"
            )
            for i, q in enumerate(self.jobs)
        ]

    def run(self, jobs: list[Any], timeout: float = 300.0) -> Pass:
        """One pass: ``jobs[i]`` to process i; returns when every process has reported."""
        self.start(jobs)
        return self.collect(timeout)

    def start(self, jobs: list[Any]) -> None:
        """Hand out the jobs and release the barrier: the processes' clocks start now."""
        if len(jobs) != self.size:
            raise ValueError(f"{len(jobs)} jobs for {self.size} processes")
        for q, job in zip(self.jobs, jobs):
            q.put(job)
        self.barrier.wait(BARRIER_TIMEOUT)

    def collect(self, timeout: float = 300.0) -> Pass:
        """Wait for every process's result of the pass started last."""
        results: list[Result] = [self.out.get(timeout=timeout) for _ in range(self.size)]
        errors = [r.error for r in results if r.error]
        if errors:
            raise RuntimeError("; ".join(errors))
        last = max(r.last for r in results)
        return Pass(
            wall=last - min(r.t0 for r in results),
            records=sum(r.records for r in results),
            value_bytes=sum(r.value_bytes for r in results),
            tail=max(r.end for r in results) - last,
            cpu=sum(r.cpu for r in results),
            extras=[r.extra for r in results],
        )

    def close(self) -> None:
        """Tell every process to leave (after its current pass)."""
        for q in self.jobs:
            q.put(None)
