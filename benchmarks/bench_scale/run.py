"""One point of the scale sweep: a fresh master, W simulated workers, a Kafka topic of P partitions, F staged files.

The master is the real ``streamrover master`` process (:class:`~streamrover.testing.procs.MasterProcess`). It
holds two datasets: ``topic``, the Kafka topic (one record per shard, so every shard is one lease and one
ack), and ``files``, a staged dataset with F committed Parquet files (state it keeps and reports, not
leased here). The swarm's workers lease one shard of ``topic``, read nothing, and ack its end, paced so
that all W of them together offer ``rate`` shards a second (each waits W / rate seconds between its
lease and its ack: its "training"); ``rate`` 0 runs every worker flat out.
"""

from __future__ import annotations

import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil

from streamrover.shard_service import DatasetSpec, ShardClient
from streamrover.testing.procs import MasterProcess
from streamrover.testing.swarm import Swarm

FILES_PER_COMMIT = 500


@dataclass
class Point:
    workers: int
    partitions: int
    shards: int            # acked in the measured window
    seconds: float
    cpu_per_shard_us: float
    lease_p50_ms: float
    lease_p99_ms: float
    ack_p50_ms: float
    ack_p99_ms: float
    rss_mib: float
    journal_per_m_shards_mib: float
    status_ms: float
    metrics_ms: float
    dashboard_ms: float
    restart_s: float
    sessions: int           # the master's worker_sessions gauge with every worker connected (and the bench's own)
    errors: int
    master_cpu_share: float  # the master's CPU seconds per wall second in the window (the machine has 2 cores)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))] * 1e3


def _journal_bytes(state_dir: Path) -> int:
    return sum(p.stat().st_size for p in state_dir.glob("journal.db*"))


def _get(url: str, token: str) -> tuple[float, bytes]:
    req = urllib.request.Request(url)
    req.add_header("Authorization", f"Bearer {token}")
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as resp:
        body = resp.read()
    return time.perf_counter() - t0, body


def _best(fn: object, n: int = 3) -> float:
    """The best of ``n`` timings of ``fn()`` (seconds): the call's cost, not the machine's other load."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return min(times)


def _sessions(master: MasterProcess) -> int:
    _, body = _get(master.dashboard_url + "metrics", master.token)
    for line in body.decode().splitlines():
        if line.startswith("streamrover_worker_sessions "):
            return int(float(line.split()[1]))
    return -1


def stage_files(root: Path, count: int) -> list[tuple[str, int]]:
    """``count`` one-row Parquet files under ``root`` (made once, shared by the runs): (uri, records)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": [1]})
    out = []
    for i in range(count):
        path = root / f"f{i:05d}.parquet"
        if not path.exists():
            pq.write_table(table, path)
        out.append((str(path), 1))
    return out


def run_point(
    work: Path, bootstrap: str, topic: str, planned: int, files: list[tuple[str, int]], workers: int,
    partitions: int, seconds: float, rate: float, processes: int, tag: str = "",
) -> Point:  # fmt: skip
    """Measure one (W, P) point against a fresh master (see the module docstring)."""
    state = work / f"master-w{workers}-p{partitions}-r{int(rate)}{tag}"
    master = MasterProcess(state, lease_ttl=600.0)  # no lease expires in a run: every lease is acked
    master.start(timeout=120)
    try:
        with ShardClient(master.address, token=master.token, heartbeat=False, timeout=300) as admin:
            admin.register_dataset(DatasetSpec("files", "staged://files", "parquet", records_per_shard=1))
            for i in range(0, len(files), FILES_PER_COMMIT):
                admin.commit_staged("files", "bench", "0", i, files[i : i + FILES_PER_COMMIT])
            admin.register_dataset(DatasetSpec(
                "topic", f"kafka://{bootstrap}/{topic}", records_per_shard=1,
                options={"sr.max_delay_ms": "0", "sr.max_pending_shards": str(planned)},  # all planned before it starts
            ))  # fmt: skip
            deadline = time.monotonic() + 300
            while admin.describe_dataset("topic").total_records < planned:  # the poller plans every record
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{planned} records of {topic} not planned within 300 s")
                time.sleep(0.2)  # polling the master's planning progress, not synchronisation
            # a backlog's shards are leased once the poller has read their records' times (one read per shard)
            status, probe = admin.lease("topic", 1, wait=300)
            if not probe:
                raise TimeoutError(f"no shard of {topic} leasable within 300 s ({status})")
            admin.ack(probe[0].lease, probe[0].lease.end, wait=True)
            proc = psutil.Process(master.proc.pid)  # type: ignore[union-attr]
            think = workers / rate if rate else 0.0
            with Swarm(master.address, master.token, "topic", workers, processes, seconds, think) as swarm:
                ready = swarm.start(timeout=600)
                sessions = _sessions(master)
                journal0, cpu0, t0 = _journal_bytes(state), proc.cpu_times(), time.monotonic()
                result = swarm.run(timeout=seconds + 600)
                cpu1, wall = proc.cpu_times(), time.monotonic() - t0
            journal1 = _journal_bytes(state)
            rss = proc.memory_info().rss
            shards = len(result.acked)
            status_s = _best(admin.status)
            metrics_s = _best(lambda: _get(master.dashboard_url + "metrics", master.token))
            dashboard_s = _best(lambda: _get(master.dashboard_url + "api/v1/metrics", master.token))
        cpu = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
        master.stop()
        t0 = time.perf_counter()
        master.start(timeout=600)  # replays the journal before it listens
        with ShardClient(master.address, token=master.token, heartbeat=False, timeout=300) as admin:
            admin.status()  # serving
        restart = time.perf_counter() - t0
    finally:
        master.stop()
    return Point(
        workers=workers, partitions=partitions, shards=shards, seconds=wall,
        cpu_per_shard_us=cpu / max(shards, 1) * 1e6,
        lease_p50_ms=_pct(result.lease_rtt, 0.5), lease_p99_ms=_pct(result.lease_rtt, 0.99),
        ack_p50_ms=_pct(result.ack_rtt, 0.5), ack_p99_ms=_pct(result.ack_rtt, 0.99),
        rss_mib=rss / 2**20, journal_per_m_shards_mib=(journal1 - journal0) / max(shards, 1) * 1e6 / 2**20,
        status_ms=status_s * 1e3, metrics_ms=metrics_s * 1e3, dashboard_ms=dashboard_s * 1e3, restart_s=restart,
        sessions=sessions if ready == workers else -ready, errors=len(result.errors),
        master_cpu_share=cpu / max(wall, 1e-9),
    )  # fmt: skip


__all__ = ["Point", "run_point", "stage_files"]
