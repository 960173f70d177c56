"""One master under a thousand workers and ten thousand partitions (issue 32): ``python -m benchmarks scale``.

W simulated workers (:mod:`streamrover.testing.swarm`: many worker sessions per client process, each its own
``WorkerSession`` stream over real gRPC) lease a shard, read nothing and ack it, against one master holding a
real Kafka topic of P partitions and a staged dataset of F committed files (:mod:`.run`). The sweep is W = 16,
128, 512, 1,000 by P = 16, 1,000, 10,000 (``--quick``: W = 16, 128 by P = 16, 1,000), each point a fresh master
on the same topics, all workers together offering ``--rate`` shards a second (so that latency compares the
points at the same load; a closed loop would only measure W / throughput). The master's ceiling in shards a
second is one core's worth of its CPU per shard (its work holds the GIL).

Printed per point, and as ratios to the W = 16 / P = 16 point of the same run: master CPU per acked shard,
p50/p99 lease and ack round trips, master RSS, journal bytes per million shards, the time of ``status``,
``/metrics`` and the dashboard's JSON (``/api/v1/metrics``; best of 3), and a restart's time to serving
(journal replay included). The journal column is the growth of the journal's files over the measured window
scaled to a million shards: over the few thousand shards of a point it is SQLite's page allocation as much as
the shards' (the journal's growth over millions of shards is measured where it is compacted). The acceptance
(issue 32) at W = 1,000 / P = 10,000: CPU per shard <= 2x the W = 16 figure, p99 lease <= 100 ms, RSS <= 1 GiB,
status <= 1 s.

``--reps N`` runs every point N times, the rounds interleaved (a round is every point once), and prints the
medians, the ratios as medians of each round's ratio to its own W = 16 / P = 16 point, and each round's CPU
ratio with the master's CPU share: the machine's other load moves single points by a third.

``--models`` first measures the gRPC concurrency models bare (:mod:`.models`): a thread per stream,
``grpc.aio``, and ``grpc.aio`` with the work in a small pool, at 16 and 1,000 streams.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks._common import environment, load, table
from benchmarks.bench_scale.models import run as run_models
from benchmarks.bench_scale.run import Point, run_point, stage_files

COLUMNS = [
    ("cpu_per_shard_us", "CPU us/shard"), ("lease_p50_ms", "lease p50 ms"), ("lease_p99_ms", "lease p99 ms"),
    ("ack_p50_ms", "ack p50 ms"), ("ack_p99_ms", "ack p99 ms"), ("rss_mib", "RSS MiB"),
    ("journal_per_m_shards_mib", "journal MiB/M shards"), ("status_ms", "status ms"), ("metrics_ms", "/metrics ms"),
    ("dashboard_ms", "JSON ms"), ("restart_s", "restart s"),
]  # fmt: skip


def _topic(bootstrap: str, partitions: int, records: int) -> str:
    """A topic of ``partitions`` partitions holding ``records`` records spread evenly over them."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewPartitions, NewTopic

    name = f"scale-{partitions}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    step = 4000  # KRaft refuses a single request creating more than 10,000 records (partitions)
    admin.create_topics([NewTopic(name, min(partitions, step), 1)])[name].result(300)
    for n in range(2 * step, partitions + step, step):
        admin.create_partitions([NewPartitions(name, min(n, partitions))])[name].result(300)
    deadline = time.monotonic() + 300
    while True:  # a partition the producer's metadata does not know yet is refused (UNKNOWN_PARTITION)
        meta = admin.list_topics(name, timeout=60).topics[name].partitions
        if len(meta) == partitions and all(p.leader >= 0 for p in meta.values()):
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: {len(meta)} of {partitions} partitions with a leader after 300 s")
        time.sleep(0.5)  # polling the broker's metadata, not synchronisation
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20})
    producer.list_topics(name, timeout=60)  # its metadata holds every partition before the first record
    for i in range(records):
        while True:
            try:
                producer.produce(name, value=b"r%d" % i, partition=i % partitions)
                break
            except BufferError:  # the producer's queue is full: let it drain
                producer.poll(0.1)
        producer.poll(0)
    if producer.flush(600):
        raise RuntimeError(f"records for {name} not delivered")
    return name


def _median(points: tuple[Point, ...]) -> Point:
    """The point whose every measured number is the median of those of ``points`` (rounds of the same W and P;
    counts such as shards and sessions are the first round's)."""
    out = {}
    for key, value in asdict(points[0]).items():
        values = [getattr(pt, key) for pt in points]
        out[key] = statistics.median(values) if isinstance(value, float) else value
    return Point(**out)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks scale", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="W = 16, 128 by P = 16, 1,000")
    parser.add_argument("--models", action="store_true", help="measure the gRPC concurrency models first")
    parser.add_argument("--models-only", action="store_true", help="only the concurrency models")
    parser.add_argument("--workers", default="", help="W values, comma-separated (overrides the sweep's)")
    parser.add_argument("--partitions", default="", help="P values, comma-separated (overrides the sweep's)")
    parser.add_argument("--rate", type=float, default=400.0, help="shards/s all workers offer together")
    parser.add_argument("--seconds", type=float, default=15.0, help="measured seconds per point")
    parser.add_argument("--files", type=int, default=1000, help="F: committed files of the staged dataset")
    parser.add_argument("--processes", type=int, default=4, help="swarm processes (simulated workers per: W / this)")
    parser.add_argument("--reps", type=int, default=1, help="rounds of every point, interleaved (ratios: medians of "
                        "each round's ratio to its own W=16/P=16 point)")
    args = parser.parse_args(argv)
    print(environment())
    print(f"load: {load()}")
    if args.models or args.models_only:
        run_models((16, 1000), 2000.0, 4.0 if args.quick else 8.0)
        if args.models_only:
            return 0
    ws = [16, 128] if args.quick else [16, 128, 512, 1000]
    ps = [16, 1000] if args.quick else [16, 1000, 10000]
    ws = [int(w) for w in args.workers.split(",")] if args.workers else ws
    ps = [int(p) for p in args.partitions.split(",")] if args.partitions else ps
    if ws[0] != 16 or ps[0] != 16:
        ws, ps = [16, *[w for w in ws if w != 16]], [16, *[p for p in ps if p != 16]]  # the base point first
    from tests.brokers.kafka import KafkaBroker

    rounds: list[list[Point]] = []
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        work = Path(tmp)
        files = stage_files(work / "staged", args.files)
        broker = KafkaBroker(work / "kafka", heap="1g")
        broker.start()
        try:
            records = int(args.rate * args.seconds * 1.3) + 100
            topics = {}
            for p in ps:
                t0 = time.perf_counter()
                topics[p] = _topic(broker.bootstrap, p, records)
                print(f"topic of {p:,} partitions, {records:,} records: {time.perf_counter() - t0:.1f}s", flush=True)
            for rep in range(args.reps):
                rounds.append([])
                for p in ps:
                    for w in ws:
                        point = run_point(work, broker.bootstrap, topics[p], records, files, w, p, args.seconds,
                                          args.rate, args.processes, tag=f"-{rep}")  # fmt: skip
                        print(f"  round {rep + 1} W={w} P={p} (load {load()}): {asdict(point)}", flush=True)
                        rounds[-1].append(point)
        finally:
            broker.stop(timeout=30)
    points = [_median(same) for same in zip(*rounds)]
    base = points[0]
    head = ["W", "P", "shards", "sessions", *[h for _, h in COLUMNS]]
    rows = [[pt.workers, pt.partitions, pt.shards, pt.sessions, *[getattr(pt, k) for k, _ in COLUMNS]]
            for pt in points]  # fmt: skip
    print(f"\nscale: {args.rate:,.0f} shards/s offered by all workers together, {args.seconds:.0f} s per point, "
          f"F = {args.files:,} staged files, {args.processes} swarm processes; load now: {load()}")  # fmt: skip
    print(table(head, rows))
    rounds_said = f" (medians of {args.reps} rounds' ratios)" if args.reps > 1 else ""
    print(f"\nas ratios to W=16/P=16 of this run{rounds_said}")
    ratios = [[pt.workers, pt.partitions, *[statistics.median(getattr(r[i], k) / max(getattr(r[0], k), 1e-9)
                                                              for r in rounds) for k, _ in COLUMNS]]
              for i, pt in enumerate(points)]  # fmt: skip
    print(table(["W", "P", *[h for _, h in COLUMNS]], ratios))
    if args.reps > 1:
        print("\nmaster CPU per shard, each round's ratio to its W=16/P=16 point (master's CPU share in the window)")
        print(table(["W", "P", *[f"round {i + 1}" for i in range(args.reps)]], [
            [pt.workers, pt.partitions, *[f"{r[i].cpu_per_shard_us / r[0].cpu_per_shard_us:.2f} "
                                          f"({r[i].master_cpu_share:.2f})" for r in rounds]]
            for i, pt in enumerate(points)]))  # fmt: skip
    print(f"\nthe master's ceiling (one core, the GIL): about {1e6 / base.cpu_per_shard_us:,.0f} shards/s at W=16, "
          f"{1e6 / points[-1].cpu_per_shard_us:,.0f} at W={points[-1].workers}/P={points[-1].partitions}")  # fmt: skip
    worst = [pt for pt in points if pt.workers == max(ws) and pt.partitions == max(ps)]
    if worst:
        pt = worst[0]
        checks = [
            ("CPU per shard <= 2x W=16", pt.cpu_per_shard_us <= 2 * base.cpu_per_shard_us),
            ("p99 lease <= 100 ms", pt.lease_p99_ms <= 100),
            ("RSS <= 1 GiB", pt.rss_mib <= 1024),
            ("status <= 1 s", pt.status_ms <= 1000),
            ("every worker holds a session", pt.sessions >= pt.workers),
        ]
        print(f"\nacceptance at W={pt.workers}/P={pt.partitions}: "
              + "; ".join(f"{name}: {'yes' if ok else 'NO'}" for name, ok in checks))  # fmt: skip
    return 0
