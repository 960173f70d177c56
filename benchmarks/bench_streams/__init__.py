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
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import os
import pstats
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._common import CTX, cores, environment, load, processes, table
from benchmarks._servers import server_process
from benchmarks.bench_streams.pool import Pass, Pool, Result

TOKEN = "bench-token"
# what the pool processes import before their first pass (the clock must not time module loading)
KAFKA_IMPORTS = ("confluent_kafka", "numpy")
# (streamrover.sources.files too: opening any source imports it, see sources/api.py load_builtin_backends)
SHARD_IMPORTS = (
    "numpy", "pyarrow.compute", "streamrover.shard_service", "streamrover.sources.kafka", "streamrover.sources.files"
)
PASS_DEADLINE = 240.0  # a pass that has not seen every record by then fails (a broker or master problem)
MAX_PENDING_SHARDS = 64  # the master's default sr.max_pending_shards (shard_service/streams.py)
WARM_UP_KEY = b"warm-up"  # freshness: the key of records produced before the measured ones (those have none)


@dataclass(frozen=True)
class Sizes:
    partitions: int
    records: int            # Kafka throughput topic
    record_bytes: int
    records_per_shard: int  # throughput passes (freshness uses the default)
    batch_size: int
    rounds: int
    rate: int               # freshness: records/s produced
    duration: float         # freshness: seconds of producing, measured
    warmup: float           # freshness: seconds of producing before that (a new topic's first seconds are slow)
    pulsar_records: int
    pulsar_records_per_shard: int


FULL = Sizes(4, 1_600_000, 1024, 50_000, 4096, 3, 2000, 20.0, 5.0, 40_000, 5_000)
QUICK = Sizes(4, 60_000, 1024, 15_000, 4096, 1, 2000, 4.0, 3.0, 10_000, 2_500)


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


@contextlib.contextmanager
def _profiled(path: str) -> Iterator[None]:
    """cProfile the block into ``path`` (nothing when ``path`` is empty)."""
    if not path:
        yield
        return
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        prof.dump_stats(path)


def _percentiles(latencies_ms: Any) -> tuple[float, float, float, float]:
    import numpy as np

    arr = np.asarray(latencies_ms, dtype=np.float64)
    if arr.size == 0:
        return (float("nan"),) * 4
    p50, p99 = np.percentile(arr, [50, 99])
    return float(p50), float(p99), float(arr.max()), float(arr.mean())


def _value_bytes(column: Any) -> int:
    import pyarrow.compute as pc

    return int(pc.sum(pc.binary_length(column)).as_py() or 0)


# --------------------------------------------------------------------------- Kafka: raw
def kafka_raw_pass(job: tuple[Any, ...], shared: Any) -> Result:
    """Assign ``partitions`` from offset 0 and consume until ``expected`` records arrived.

    ``conf``: librdkafka settings beyond bootstrap/group/no auto commit (the shard path's
    consumer settings, for a like-for-like peer, or nothing: librdkafka's defaults).

    ``latency``: consume with ``poll`` (returns at the first record) and note each record's
    produce->consume latency; otherwise ``consume(batch_size)`` like a throughput reader.
    """
    from confluent_kafka import Consumer, KafkaException, TopicPartition

    bootstrap, topic, partitions, expected, batch_size, latency, conf = job
    t0, c0 = time.monotonic(), time.process_time()
    deadline = t0 + PASS_DEADLINE
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"bench-raw-{topic}", "enable.auto.commit": False, **conf}
    )
    consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
    records = nbytes = 0
    last = t0
    lat: list[tuple[int, float]] = []  # (produce time ms, latency ms)
    try:
        while records < expected:
            if time.monotonic() > deadline:
                raise TimeoutError(f"raw consumer saw {records} of {expected} records in {PASS_DEADLINE:.0f}s")
            if latency:
                first = consumer.poll(0.1)
                msgs = [] if first is None else [first, *consumer.consume(batch_size - 1, timeout=0)]
            else:
                # never ask for more than is left: consume() waits for a full batch or the timeout
                msgs = consumer.consume(min(batch_size, expected - records), timeout=0.5)
            if not msgs:
                continue
            now_ms = time.time() * 1000.0
            for m in msgs:
                if m.error() is not None:
                    raise KafkaException(m.error())
            records += len(msgs)
            nbytes += sum(len(m.value() or b"") for m in msgs)
            if latency:
                lat.extend((m.timestamp()[1], now_ms - m.timestamp()[1]) for m in msgs if m.key() is None)
            last = time.monotonic()
    finally:
        end, cpu = time.monotonic(), time.process_time() - c0
        consumer.close()
    return Result(records, nbytes, t0, last, end, cpu, lat if latency else None)


# --------------------------------------------------------------------------- shard path
def _ack_mode() -> dict[str, Any]:
    """``async_acks=True`` where ShardClient has it (acks queued, sent by a thread), else nothing (synchronous)."""
    import inspect

    from streamrover.shard_service import ShardClient

    return {"async_acks": True} if "async_acks" in inspect.signature(ShardClient).parameters else {}


def shard_pass(job: tuple[Any, ...], counter: Any) -> Result:
    """Lease shards of ``dataset`` and ack every batch until ``counter`` (all workers) reaches ``expected``.

    Leases two shards per round trip, like ``ShardClient.shards`` (which cannot be left
    while it waits for a stream's next shard), one at a time in the last eighth of the
    pass. Where acks are queued (asynchronous acks) the pass ends when the master has
    recorded the last ones: ``flush()`` then.
    ``latency``: note, per record, the time its batch's ack was recorded (flushed after
    each batch) minus the record's produce time (the raw ``timestamp`` column), except for
    warm-up records (they have a key).
    ``profile``: cProfile into that path.
    """
    import numpy as np
    import pyarrow.compute as pc

    from streamrover.shard_service import ShardClient

    address, dataset, expected, batch_size, index, latency, profile = job
    t0, c0 = time.monotonic(), time.process_time()
    deadline = t0 + PASS_DEADLINE
    records = nbytes = 0
    last = t0
    lat: list[Any] = []
    with _profiled(profile), ShardClient(address, token=TOKEN, name=f"bench-worker-{index}", **_ack_mode()) as client:
        flush = getattr(client, "flush", None)  # acks are queued: wait until the master has them
        while counter.value < expected:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the workers acked {counter.value} of {expected} records in {PASS_DEADLINE:.0f}s")
            # two shards per round trip, one near the end of the pass: two shards held by one worker
            # there would leave the other idle while it reads both (a finite pass's tail; a stream has none)
            _, leased = client.lease(dataset, 2 if expected - counter.value > expected // 8 else 1, wait=0.25)
            for shard in leased:
                for batch in shard.batches(batch_size):
                    n = batch.num_records
                    b = _value_bytes(batch.records.column("value"))
                    shard.ack(batch.end)
                    if latency and flush is not None:
                        flush()  # the latency of a record ends when the master has its ack
                    last = time.monotonic()
                    if latency and n:
                        measured = pc.is_null(batch.records.column("key"))  # warm-up records have a key
                        produced = batch.records.column("timestamp").filter(measured).to_numpy()
                        lat.append(np.stack([produced, time.time() * 1000.0 - produced], axis=1))
                    records, nbytes = records + n, nbytes + b
                    with counter.get_lock():
                        counter.value += n
            if flush is not None and leased and counter.value >= expected:
                flush()  # the pass ends when the master has the last acks
                last = time.monotonic()
    end, cpu = time.monotonic(), time.process_time() - c0
    extra = [(int(t), float(x)) for t, x in np.concatenate(lat)] if lat else []  # (produce time ms, latency ms)
    return Result(records, nbytes, t0, last, end, cpu, extra if latency else None)


# --------------------------------------------------------------------------- Kafka: set-up
def _create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        f.result(30)


def _kafka_producer(bootstrap: str) -> Any:
    from confluent_kafka import Producer

    return Producer({"bootstrap.servers": bootstrap, "acks": 1, "linger.ms": 5, "compression.type": "none"})


def _produce_all(bootstrap: str, topic: str, n: int, partitions: int, size: int) -> float:
    """``n`` records of ``size`` random bytes, round robin over the partitions; returns records/s."""
    producer = _kafka_producer(bootstrap)
    payload = os.urandom(size)
    t0 = time.perf_counter()
    for i in range(n):
        while True:
            try:
                producer.produce(topic, value=payload, partition=i % partitions)
                break
            except BufferError:
                producer.poll(0.05)
        if i % 1000 == 0:
            producer.poll(0)
    left = producer.flush(60)
    if left:
        raise RuntimeError(f"{left} records not delivered to {topic}")
    return n / (time.perf_counter() - t0)


def _produce_paced(
    bootstrap: str, topic: str, warm: int, n: int, partitions: int, size: int, rate: float
) -> tuple[float, float]:
    """``warm`` then ``n`` records at ``rate`` records/s, each handed to the producer at its due time.

    The ``warm`` records are the warm-up: a new topic on a fresh broker delivers with a
    second or more of latency for its first seconds, readers included or not.
    Returns (the achieved rate of the ``n`` records, the wall-clock ms at which they started).
    """
    producer = _kafka_producer(bootstrap)
    payload = os.urandom(size)
    interval = 1.0 / rate
    t0 = time.perf_counter()
    start_ms, t_measured = time.time() * 1000.0, t0
    for i in range(warm + n):
        delay = t0 + i * interval - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        if i == warm:
            start_ms, t_measured = time.time() * 1000.0, time.perf_counter()
        producer.produce(topic, value=payload, key=WARM_UP_KEY if i < warm else None, partition=i % partitions)
        producer.poll(0)
    elapsed = time.perf_counter() - t_measured
    left = producer.flush(60)
    if left:
        raise RuntimeError(f"{left} records not delivered to {topic}")
    return n / elapsed, start_ms


def _register(address: str, name: str, uri: str, options: dict[str, str], records_per_shard: int,
              expected: int, timeout: float = 120.0) -> None:
    """Register a stream dataset and wait until shards cover ``expected`` records (planning is set-up, not timed)."""
    from streamrover.shard_service import DatasetSpec, ShardClient

    admin = ShardClient(address, token=TOKEN, heartbeat=False)
    try:
        admin.register_dataset(DatasetSpec(name, uri, options=options, records_per_shard=records_per_shard))
        give_up = time.monotonic() + timeout
        while True:
            info = admin.describe_dataset(name)
            if info.total_records >= expected or not expected or info.shards.todo >= MAX_PENDING_SHARDS:
                return  # (or as much as the master plans ahead: the rest is planned as shards are leased)
            if info.error or time.monotonic() > give_up:
                raise RuntimeError(
                    f"dataset {name}: {info.total_records} of {expected} records planned; error: {info.error!r}"
                )
            time.sleep(0.1)
    finally:
        admin.close()


def _acked(address: str, name: str) -> tuple[int, int]:
    """(records acked, shards planned) as the master sees them."""
    from streamrover.shard_service import ShardClient

    admin = ShardClient(address, token=TOKEN, heartbeat=False)
    try:
        info = admin.describe_dataset(name)
        s = info.shards
        return int(info.records_acked), int(s.todo + s.leased + s.acked + s.committed)
    finally:
        admin.close()


def _check(p: Pass, records: int, size: int, what: str) -> None:
    if p.records != records or p.value_bytes != records * size:
        raise RuntimeError(
            f"{what}: {p.records} records / {p.value_bytes} bytes, expected {records} / {records * size}"
        )


# --------------------------------------------------------------------------- [1] Kafka throughput
def _shard_consumer_settings() -> dict[str, Any]:
    """The librdkafka settings the Kafka source gives its consumer beyond the user's (none in older versions)."""
    from streamrover.sources import kafka

    return dict(getattr(kafka, "SHARD_READ_DEFAULTS", {}))


class CpuMeter:
    """CPU seconds (user + system, all threads) that other processes spend during a pass: broker, master."""

    def __init__(self, **pids: int | None) -> None:
        import psutil

        self.procs = {name: psutil.Process(pid) for name, pid in pids.items() if pid}
        self._start: dict[str, float] = {}

    def add(self, name: str, pid: int) -> None:
        import psutil

        self.procs[name] = psutil.Process(pid)

    def _now(self) -> dict[str, float]:
        out = {}
        for name, proc in self.procs.items():
            t = proc.cpu_times()
            out[name] = t.user + t.system
        return out

    def start(self) -> None:
        self._start = self._now()

    def stop(self, p: Pass) -> Pass:
        """Note the CPU used since :meth:`start` into ``p.others``."""
        for name, t in self._now().items():
            p.others[name] = t - self._start.get(name, t)
        return p


@contextlib.contextmanager
def master_process(state: str) -> Iterator[tuple[str, int]]:
    """A master in its own process (benchmarks._servers); yields (address, pid)."""
    import psutil

    me = psutil.Process()
    before = {c.pid for c in me.children()}
    with server_process("master", state, TOKEN) as address:
        new = [c.pid for c in me.children() if c.pid not in before]
        if len(new) != 1:
            raise RuntimeError(f"cannot tell the master process among new children {new}")
        yield address, new[0]


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


def _shard_round(tmp: Path, ours: Pool, counter: Any, meter: CpuMeter, uri: str, r: int, sizes: Sizes,
                 options: dict[str, str], records_per_shard: int, n: int, profile_dir: str, tag: str = "kafka") -> Pass:
    """One shard-path pass against a fresh master (its journal and pollers start empty)."""
    state = tempfile.mkdtemp(prefix=f"master-{tag}-{r}-", dir=tmp)
    name = f"{tag}-{r}"
    with master_process(state) as (address, master_pid):
        _register(address, name, uri, options, records_per_shard, n)
        counter.value = 0
        jobs = [
            (address, name, n, sizes.batch_size, i, False,
             str(Path(profile_dir) / f"{tag}-worker{i}-round{r}.prof") if profile_dir else "")
            for i in range(ours.size)
        ]
        meter.add("master", master_pid)
        meter.start()
        result = meter.stop(ours.run(jobs))
        del meter.procs["master"]
        acked, _ = _acked(address, name)
    if acked != n:
        raise RuntimeError(f"round {r + 1}: the master counts {acked} records acked, expected {n}")
    return result


def _throughput_table(runs: list[dict[str, Pass]], size: int, labels: dict[str, str]) -> None:
    rows: list[tuple[Any, ...]] = []

    def us(kind: str, who: str) -> float | str:
        per = [(run[kind].cpu if who == "readers" else run[kind].others.get(who, float("nan"))) / run[kind].records
               for run in runs]
        value = statistics.median(per) * 1e6
        return "-" if value != value else value  # NaN: not measured

    for kind, label in labels.items():
        rate = statistics.median(run[kind].rate for run in runs)
        cpu = (us(kind, "readers"), us(kind, "broker"), us(kind, "master") if kind == "shard" else "-")
        if kind == "shard":
            rows.append((label, rate, rate * size / 1e6, "-", "-", *cpu))
            continue
        ratios = [run["shard"].rate / run[kind].rate for run in runs]
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
        rows.append((label, rate, rate * size / 1e6, statistics.median(ratios), spread, *cpu))
    print(table(["reader", "records/s", "MB/s", "shard path / this", "per round", "reader CPU us/rec",
                 "broker CPU us/rec", "master CPU us/rec"], rows))
    tail = statistics.median(run["shard"].tail for run in runs)
    print(f"shard path: {tail * 1e3:.0f} ms from the last ack until both workers noticed the end (not in the rates)")


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
