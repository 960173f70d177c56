"""Shared plumbing of the benchmarks: environment report, tables, child processes.

Every child process is started with the ``spawn`` method: gRPC's core does not
survive ``fork`` once a channel or server exists in the parent.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import platform
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib import metadata
from multiprocessing.context import SpawnProcess
from typing import Any

CTX = mp.get_context("spawn")


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment() -> str:
    versions = []
    for dist in ("grpcio", "protobuf", "pyarrow", "numpy"):
        try:
            versions.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{dist} -")
    try:
        from google.protobuf.internal import api_implementation

        versions.append(f"protobuf backend {api_implementation.Type()}")
    except ImportError:
        pass
    return (
        f"cores: {cores()} usable of {os.cpu_count()} ({_cpu_model()}); "
        f"python {platform.python_version()} on {platform.system()} {platform.release()}\n"
        f"{', '.join(versions)}\n"
        f"GRPC_EXPERIMENTS={os.environ.get('GRPC_EXPERIMENTS', '(unset)')} (in every process of the run, peers too)"
    )


def load() -> str:
    """The 1, 5 and 15 minute load averages: other work on the machine skews every number here."""
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "unknown"
    busy = "  (busy: other processes compete for the cores)" if one > 0.5 * cores() else ""
    return f"{one:.2f} {five:.2f} {fifteen:.2f}{busy}"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table, numbers right-aligned."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    numeric = [all(isinstance(row[i], (int, float)) for row in rows) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    out = [line(list(headers)), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    return "\n".join(out)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value >= 100:
            return f"{value:,.0f}"
        return f"{value:.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


@contextmanager
def processes(procs: list[SpawnProcess], grace: float = 10.0) -> Iterator[list[SpawnProcess]]:
    """Start ``procs``; on the way out, join them, then terminate and kill whatever is left."""
    ok = False
    try:
        for p in procs:
            p.start()
        yield procs
        ok = True
    finally:
        for p in procs:
            if p.pid is not None:
                p.join(timeout=grace if ok else 0.1)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=3)
            if p.is_alive():
                p.kill()
                p.join()


def flush() -> None:
    sys.stdout.flush()
