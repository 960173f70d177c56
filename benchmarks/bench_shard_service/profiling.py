"""Where a lease+ack cycle spends its time (a tool for whoever tunes the shard service, not a benchmark).

    python -m benchmarks.bench_shard_service.profiling core [W] [A]
        # ShardCore + Journal alone, no gRPC, cProfile (W workers, each holding A leases; default 1 1)
    python -m benchmarks.bench_shard_service.profiling server [N]
        # a master in this process under yappi, N client processes
    python -m benchmarks.bench_shard_service.profiling client
        # one ShardClient in this process under cProfile

``server`` needs yappi (it profiles every thread of the gRPC pool); it is not a
project dependency: install it in a separate virtualenv and put that on PYTHONPATH.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

from benchmarks._common import CTX, processes
from benchmarks._servers import MASTER_THREADS, server_process
from benchmarks.bench_shard_service.rtt import TOKEN, rtt_client, write_rtt_file

CYCLES = 20_000


def _dataset(tmp: Path, rows: int) -> Any:
    from streamrover.shard_service import DatasetSpec

    data = tmp / "rtt.parquet"
    write_rtt_file(data, rows)
    return DatasetSpec("rtt", str(data), records_per_shard=1)


def profile_core(tmp: Path, workers: int = 1, ahead: int = 1) -> None:
    """Lease+ack cycles straight on ShardCore: the cost of the state machine and the journal.

    ``workers`` workers each hold ``ahead`` leases (as readers leasing ahead do); in turn each acks
    its oldest lease and leases one more, so the master has ``workers * ahead`` leases out throughout.
    """
    from streamrover.shard_service.master.core import ShardCore
    from streamrover.shard_service.master.journal import Journal
    from streamrover.sources.api import open_source

    spec = _dataset(tmp, CYCLES + workers * ahead)
    source = open_source(spec.uri, "", {})
    core = ShardCore(Journal(tmp / "journal.db"))
    core.register_dataset(spec, source.kind, source.partitions(), "[]")
    held: dict[str, deque[Any]] = {core.join(f"bench-{i}").id: deque() for i in range(workers)}
    for wid, queue in held.items():
        queue.extend(core.lease(wid, "rtt", ahead - 1).leases if ahead > 1 else [])

    def run(n: int) -> None:
        ids = list(held)
        for i in range(n):
            wid = ids[i % len(ids)]
            queue = held[wid]
            queue.append(core.lease(wid, "rtt", 1).leases[0])
            grant = queue.popleft()
            core.ack(wid, grant.shard_id, grant.attempt, grant.end)

    best_wall, best_cpu, n = float("inf"), float("inf"), CYCLES // 8
    for _ in range(4):  # best of 4: other processes on the machine only ever make a round slower
        w0, c0 = time.perf_counter(), time.process_time()
        run(n)
        best_wall = min(best_wall, time.perf_counter() - w0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    print(
        f"core alone: {n / best_wall:,.0f} lease+ack cycles/s; per cycle {best_wall / n * 1e6:.0f} us wall, "
        f"{best_cpu / n * 1e6:.0f} us CPU (best of 4 rounds of {n}; {workers} workers x {ahead} leases held)"
    )
    prof = cProfile.Profile()
    prof.runcall(run, CYCLES // 2 - 10)
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def profile_server(tmp: Path, clients: int) -> None:
    import yappi  # type: ignore[import-not-found]

    from streamrover.shard_service import MasterServer, ShardClient

    spec = _dataset(tmp, 60_000)
    yappi.set_clock_type("cpu")
    yappi.start(profile_threads=True)
    master = MasterServer(tmp / "state", TOKEN, port=0, max_workers=MASTER_THREADS)
    try:
        admin = ShardClient(master.address, token=TOKEN, heartbeat=False)
        admin.register_dataset(spec)
        admin.close()
        barrier = CTX.Barrier(clients + 1)  # this process joins it: the profile starts after the warm-up
        out: Any = CTX.Queue()
        procs = [
            CTX.Process(target=rtt_client, args=("shard", master.address, "rtt", 5.0, 20, barrier, out, i))
            for i in range(clients)
        ]
        with processes(procs, grace=60):
            barrier.wait(120)
            yappi.clear_stats()
            results = [out.get(timeout=120) for _ in procs]
        yappi.stop()
    finally:
        master.stop(0.5)
    print(
        f"{clients} clients: {sum(r[0] / r[1] for r in results):,.0f} RPC/s (under yappi); errors: "
        f"{[r[2] for r in results if r[2]]}"
    )
    stats = yappi.get_func_stats()
    rpcs = sum(r[0] for r in results)
    by_area: dict[str, float] = {}
    for f in stats:
        by_area[_area(f.module)] = by_area.get(_area(f.module), 0.0) + f.tsub
    total = sum(by_area.values())
    print(f"server CPU (own time, yappi, callees' C code included in the caller) over {rpcs} RPCs: {total:.2f}s")
    for area, secs in sorted(by_area.items(), key=lambda kv: -kv[1]):
        print(f"  {area:<28} {secs:6.2f}s  {secs / total:6.1%}  {secs / rpcs * 1e6:6.0f} us/RPC")
    stats.sort("tsub").print_all(
        out=sys.stdout, columns={0: ("name", 60), 1: ("ncall", 9), 2: ("tsub", 8), 3: ("ttot", 8), 4: ("tavg", 8)}
    )


def _area(module: str) -> str:
    if "streamrover/" in module:
        return "streamrover/" + module.split("streamrover/", 1)[1]
    for key in ("grpc", "concurrent", "threading", "json", "enum", "contextlib", "protobuf"):
        if f"/{key}" in module:
            return key
    return "other"


def profile_client(tmp: Path) -> None:
    from streamrover.shard_service import ShardClient

    spec = _dataset(tmp, 20_000)
    with server_process("master", str(tmp / "state"), TOKEN, MASTER_THREADS) as address:
        client = ShardClient(address, token=TOKEN, heartbeat=False)
        client.register_dataset(spec)

        def run(n: int) -> None:
            for _ in range(n):
                _, leased = client.lease("rtt", 1)
                leased[0].ack(leased[0].lease.end)

        run(50)
        prof = cProfile.Profile()
        prof.runcall(run, 3000)
        client.close()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main(argv: list[str]) -> int:
    what = argv[0] if argv else "core"
    with tempfile.TemporaryDirectory(prefix="bench-profile-") as tmpdir:
        tmp = Path(tmpdir)
        if what == "core":
            profile_core(tmp, *(int(a) for a in argv[1:3]))
        elif what == "server":
            profile_server(tmp, int(argv[1]) if len(argv) > 1 else 4)
        elif what == "client":
            profile_client(tmp)
        else:
            print(__doc__)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
