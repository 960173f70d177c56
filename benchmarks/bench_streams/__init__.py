"""Stream sources through the shard path against raw broker clients (issue 3's acceptance benches).

1. Kafka records/s: a topic of 1 KB records over 4 partitions, read (a) by raw
   confluent-kafka consumers (assign + consume, 1 process reading every partition
   and 2 processes reading half the partitions each) and (b) through the shard path:
   a master (its own process, fresh each pass) with a stream dataset on the topic
   (``sr.format=raw``) and 2 worker processes leasing shards with ``ShardClient``,
   reading them from Kafka and acking every batch. The clock runs from the workers'
   start to the last record acked (raw: consumed). The same per-batch work on both
   sides: count the records and the bytes of their values. Goal: ratio >= 0.8.
2. The same for Pulsar (pulsar-lite broker, a partitioned topic) against a raw
   pulsar-client reader of the topic, when ``streamrover.sources.pulsar`` is there.
3. Freshness: records produced at a steady rate into a 4-partition Kafka topic, each
   carrying its produce time (the Kafka CreateTime, set by the producer when the
   record is handed to it); 2 workers consume through the shard path at default
   settings and note when each batch's ack returned. Per record: ack time minus
   produce time (p50/p99/max; goal p99 <= 2 s); a raw consumer's produce->consume
   latency of the same records, in the same run, for comparison.

Raw passes and shard-path passes alternate (order reversed every other round); a
ratio is the median over rounds of the per-round ratio. Brokers are real: Apache
Kafka 4.x (KRaft, tests/brokers/kafka.py) and pulsar-lite (tests/brokers/pulsar.py),
bound to 127.0.0.1 and stopped at the end. Producers: acks=1, linger.ms=5, no
compression.

Modules: ``passes`` (what the pool processes run, sizes, constants), ``rounds`` (topics, producers, the
master process, a shard-path round, the throughput table), ``pool`` (the worker processes), ``pulsar``.
"""

from __future__ import annotations

import argparse
import dataclasses
import pstats
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import CTX, cores, environment, load, processes, table
from benchmarks.bench_streams.passes import (
    FULL,
    KAFKA_IMPORTS,
    PASS_DEADLINE,
    QUICK,
    SHARD_IMPORTS,
    Sizes,
    _ack_mode,
    _percentiles,
    kafka_raw_pass,
    shard_pass,
)
from benchmarks.bench_streams.pool import Pass, Pool
from benchmarks.bench_streams.rounds import (
    CpuMeter,
    _acked,
    _check,
    _create_topic,
    _produce_all,
    _produce_paced,
    _register,
    _shard_consumer_settings,
    _shard_round,
    _throughput_table,
    master_process,
)


# --------------------------------------------------------------------------- helpers
def _versions() -> str:
    from importlib import metadata

    out = []
    for dist in ("confluent-kafka", "pulsar-client", "pulsar-lite"):
        try:
            out.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            out.append(f"{dist} -")
    try:
        import confluent_kafka

        out.append(f"librdkafka {confluent_kafka.libversion()[0]}")
    except ImportError:
        pass
    return ", ".join(out)


# --------------------------------------------------------------------------- [1] Kafka throughput
def bench_kafka_throughput(
    tmp: Path, bootstrap: str, broker_pid: int | None, sizes: Sizes, profile_dir: str, extra: dict[str, str]
) -> None:
    n, parts = sizes.records, list(range(sizes.partitions))
    topic = "bench-throughput"
    _create_topic(bootstrap, topic, sizes.partitions)
    rate = _produce_all(bootstrap, topic, n, sizes.partitions, sizes.record_bytes)
    print(f"  produced {n:,} records of {sizes.record_bytes} bytes over {sizes.partitions} partitions "
          f"({rate:,.0f} records/s)", flush=True)
    counter = CTX.Value("q", 0)
    raw1 = Pool(kafka_raw_pass, 1, "raw1", imports=KAFKA_IMPORTS)
    raw2 = Pool(kafka_raw_pass, 2, "raw2", imports=KAFKA_IMPORTS)
    ours = Pool(shard_pass, 2, "worker", shared=counter, imports=SHARD_IMPORTS)
    uri = f"kafka://{bootstrap}/{topic}"
    meter = CpuMeter(broker=broker_pid)
    tuning = _shard_consumer_settings()
    runs: list[dict[str, Pass]] = []
    with processes(raw1.procs + raw2.procs + ours.procs, grace=30):
        try:
            for r in range(sizes.rounds):
                order = ["raw1", "raw2", "shard", "raw1-defaults"]
                if r % 2:
                    order.reverse()
                got: dict[str, Pass] = {}
                for kind in order:
                    if kind.startswith("raw1"):
                        conf = {} if kind == "raw1-defaults" else tuning
                        meter.start()
                        got[kind] = meter.stop(raw1.run([(bootstrap, topic, parts, n, sizes.batch_size, False, conf)]))
                    elif kind == "raw2":
                        half = [parts[i::2] for i in range(2)]
                        jobs = [
                            (bootstrap, topic, h, n * len(h) // len(parts), sizes.batch_size, False, tuning)
                            for h in half
                        ]
                        meter.start()
                        got[kind] = meter.stop(raw2.run(jobs))
                    else:
                        options = {"sr.format": "raw", **extra}
                        got[kind] = _shard_round(tmp, ours, counter, meter, uri, r, sizes, options,
                                                 sizes.records_per_shard, n, profile_dir)
                    _check(got[kind], n, sizes.record_bytes, f"round {r + 1} {kind}")
                runs.append(got)
                print(
                    f"  round {r + 1}: shard path {got['shard'].rate:,.0f} rec/s, raw 1 process "
                    f"{got['raw1'].rate:,.0f}, raw 2 processes {got['raw2'].rate:,.0f}, raw 1 process with "
                    f"librdkafka defaults {got['raw1-defaults'].rate:,.0f}; ratios "
                    f"{got['shard'].rate / got['raw1'].rate:.2f} / {got['shard'].rate / got['raw2'].rate:.2f} / "
                    f"{got['shard'].rate / got['raw1-defaults'].rate:.2f}",
                    flush=True,
                )
        finally:
            for pool in (raw1, raw2, ours):
                pool.close()
    _throughput_table(runs, sizes.record_bytes, {
        "raw1": "raw confluent-kafka, 1 process x 4 partitions",
        "raw2": "raw confluent-kafka, 2 processes x 2 partitions",
        "raw1-defaults": "raw, 1 process, librdkafka defaults",
        "shard": "shard path: master + 2 workers",
    })
    print(f"raw consumers use the shard path's consumer settings {tuning} except the 'librdkafka defaults' row")
    print(f"shard-path workers' ShardClient: {_ack_mode() or 'synchronous acks'}")


# --------------------------------------------------------------------------- [3] freshness
def bench_freshness(tmp: Path, bootstrap: str, sizes: Sizes, extra: dict[str, str]) -> None:
    n = int(sizes.rate * sizes.duration)
    warm = int(sizes.rate * sizes.warmup)
    total = warm + n
    topic = "bench-freshness"
    _create_topic(bootstrap, topic, sizes.partitions)
    counter = CTX.Value("q", 0)
    ours = Pool(shard_pass, 2, "fresh-worker", shared=counter, imports=SHARD_IMPORTS)
    raw = Pool(kafka_raw_pass, 1, "fresh-raw", imports=KAFKA_IMPORTS)
    uri = f"kafka://{bootstrap}/{topic}"
    with processes(ours.procs + raw.procs, grace=30):
        try:
            state = tempfile.mkdtemp(prefix="master-fresh-", dir=tmp)
            with master_process(state) as (address, _):
                _register(address, "fresh", uri, {"sr.format": "raw", **extra}, 0, 0)  # default settings
                counter.value = 0
                ours.start([(address, "fresh", total, sizes.batch_size, i, True, "") for i in range(ours.size)])
                raw.start([(bootstrap, topic, list(range(sizes.partitions)), total, sizes.batch_size, True,
                            _shard_consumer_settings())])
                time.sleep(1.0)  # workers joined, consumers assigned
                achieved, start_ms = _produce_paced(
                    bootstrap, topic, warm, n, sizes.partitions, sizes.record_bytes, sizes.rate
                )
                shard_pass_result = ours.collect(timeout=PASS_DEADLINE + 30)
                raw_pass_result = raw.collect(timeout=PASS_DEADLINE + 30)
                acked, shards = _acked(address, "fresh")
        finally:
            ours.close()
            raw.close()
    _check(shard_pass_result, total, sizes.record_bytes, "freshness, shard path")
    _check(raw_pass_result, total, sizes.record_bytes, "freshness, raw consumer")
    print(f"  produced {n:,} records at {achieved:,.0f} records/s over {sizes.partitions} partitions, after "
          f"{sizes.warmup:.0f}s of warm-up at that rate (not in the figures);\n  the master planned {shards} shards "
          f"({total / max(shards, 1):,.0f} records each on average), acked {acked:,}")
    import numpy as np

    shard_lat = np.array([x for e in shard_pass_result.extras for x in e], dtype=np.float64).reshape(-1, 2)
    raw_lat = np.array([x for e in raw_pass_result.extras for x in e], dtype=np.float64).reshape(-1, 2)
    rows = []
    for label, lat in (("shard path (produce -> ack)", shard_lat), ("raw consumer (produce -> consume)", raw_lat)):
        p50, p99, worst, mean = _percentiles(lat[:, 1])
        rows.append((label, len(lat), p50, p99, worst, mean))
    print(table(["reader", "records", "p50 ms", "p99 ms", "max ms", "mean ms"], rows))
    # the same over time: a tail that sits in one slice is a stall (or start-up), not the steady state
    first = start_ms
    width = sizes.duration * 1000.0 / 10
    timeline = []
    for k in range(10):
        row: list[Any] = [f"{k * width / 1000:.0f}-{(k + 1) * width / 1000:.0f}"]
        for lat in (shard_lat, raw_lat):
            rel = lat[:, 0] - first
            p50, p99, worst, _ = _percentiles(lat[(rel >= k * width) & (rel < (k + 1) * width), 1])
            row += [p50, p99, worst]
        timeline.append(row)
    print(table(["produced at s", "shard p50", "shard p99", "shard max", "raw p50", "raw p99", "raw max"], timeline))
    if extra:
        print(f"NOTE: not default settings: {extra}")
    print("goal: shard path p99 <= 2000 ms at default settings (sr.max_delay_ms=500, sr.poll_interval_ms=100, "
          "records_per_shard=10000)")


# --------------------------------------------------------------------------- profiles
def _print_profiles(profile_dir: str, top: int = 25) -> None:
    files = sorted(str(p) for p in Path(profile_dir).glob("*.prof"))
    if not files:
        return
    stats = pstats.Stats(files[0])
    for f in files[1:]:
        stats.add(f)
    print(f"\ncProfile of the shard-path workers ({len(files)} passes merged), by own time:")
    stats.sort_stats("tottime").print_stats(top)
    print("by cumulative time:")
    stats.sort_stats("cumulative").print_stats(top)


# --------------------------------------------------------------------------- main
def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks streams", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a smoke-sized run (about a minute)")
    parser.add_argument("--only", choices=["kafka", "pulsar", "freshness"], help="run one of the benches")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="add a dataset option for the shard path (sr.* or librdkafka), e.g. sr.max_delay_ms=100")
    parser.add_argument("--rounds", type=int, default=0,
                        help="rounds of the throughput benches (default 3, --quick 1): more rounds, steadier medians")
    parser.add_argument("--records-per-shard", type=int, default=-1, metavar="N",
                        help="shard size of the Kafka throughput passes (default 50,000, --quick 15,000; "
                             "0: the service's default for streams)")
    parser.add_argument("--profile", metavar="DIR", default="",
                        help="cProfile the shard-path workers into DIR/*.prof and print the merged top functions")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    if args.rounds > 0:
        sizes = dataclasses.replace(sizes, rounds=args.rounds)
    if args.records_per_shard >= 0:
        sizes = dataclasses.replace(sizes, records_per_shard=args.records_per_shard)
    extra = dict(o.split("=", 1) for o in args.option)
    status = 0
    print(environment())
    print(_versions())
    print(f"load average at start: {load()}")
    if cores() < 4:
        print(f"note: {cores()} cores: broker, master, workers and raw consumers share them")
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    from tests.brokers.kafka import KafkaBroker

    with tempfile.TemporaryDirectory(prefix="bench-streams-") as tmpdir:
        tmp = Path(tmpdir)
        if args.only in (None, "kafka", "freshness"):
            broker = KafkaBroker(tmp / "kafka")
            broker.start()
            try:
                print(f"Kafka {broker.bootstrap} started in {broker.startup_seconds:.1f}s", flush=True)
                if args.only in (None, "kafka"):
                    print(f"\n[1] Kafka records/s: {sizes.records:,} records of {sizes.record_bytes} bytes, "
                          f"{sizes.partitions} partitions, {sizes.records_per_shard:,} records/shard, batches of "
                          f"{sizes.batch_size}, {sizes.rounds} round(s)", flush=True)
                    bench_kafka_throughput(tmp, broker.bootstrap, broker.pid, sizes, args.profile, extra)
                    print("shard path / this = median over rounds of the per-round ratio; goal >= 0.8; CPU = "
                          "user+system seconds\nof the reader processes (all threads), the broker JVM and the "
                          "master during the pass, per record (medians)")
                if args.only in (None, "freshness"):
                    print(f"\n[3] freshness: {sizes.rate:,} records/s for {sizes.duration:.0f}s into "
                          f"{sizes.partitions} partitions, 2 workers at default settings", flush=True)
                    bench_freshness(tmp, broker.bootstrap, sizes, extra)
            finally:
                broker.stop()
        if args.only in (None, "pulsar"):
            from benchmarks.bench_streams.pulsar import bench_pulsar

            print(f"\n[2] Pulsar records/s: {sizes.pulsar_records:,} records of {sizes.record_bytes} bytes", flush=True)
            try:
                bench_pulsar(tmp, sizes, args.profile, extra)
            except Exception as exc:  # the other benches' figures stand; say why this one has none
                print(f"pulsar: FAILED: {type(exc).__name__}: {exc}")
                status = 1
    if args.profile:
        _print_profiles(args.profile)
    print(f"\nload average at end: {load()}")
    return status
