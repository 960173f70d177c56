"""What the pool processes run: a raw Kafka consumer's pass and a shard-path worker's pass, with the sizes and
constants both sides share."""

from __future__ import annotations

import contextlib
import cProfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from benchmarks.bench_streams.pool import Result

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
