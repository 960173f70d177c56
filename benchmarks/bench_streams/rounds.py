"""The parent's side of a pass: topics and producers, the master process, a shard-path round, the CPU meter, the
throughput table (used by the Kafka and Pulsar benches)."""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks._common import table
from benchmarks._servers import server_process
from benchmarks.bench_streams.passes import MAX_PENDING_SHARDS, TOKEN, WARM_UP_KEY, Sizes
from benchmarks.bench_streams.pool import Pass, Pool


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


# --------------------------------------------------------------------------- the master, a round, the table
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
