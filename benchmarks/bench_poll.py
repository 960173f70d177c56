"""A stream poll costs what moved, not the partition count (issue 32, piece 3): ``python -m benchmarks poll``.

The master's work per poll of a stream of ``--partitions`` partitions (default 10,000), in this process: the core
(``ShardCore`` over its own SQLite journal) is handed each poll as the poller hands it (``StreamPlanner.changed``,
``Upstream.check``, ``extend_stream`` with its journal write), and a worker leases and acks what was planned
between polls (not timed). Rows, each a ratio against a peer of the same run:

1. planning, polls made up: CPU per poll with 1% of the partitions moved by a shard vs with all of them moved.
2. with ``--kafka`` (default; ``--no-kafka`` to skip): a real Kafka topic of P partitions (created 2,000 at a time:
   Kafka refuses one CreateTopics of 10,000 as "an excessively large batch operation"), 1% or all of them given a
   record between polls; CPU per poll of the whole master side (the source's poll: batched ListOffsets requests
   of the partitions that moved lately and of a share of the idle ones, ``sources/kafka_poll.py``, then the
   planning), 1% vs all, and the source's poll alone.

Before issue 32's changes (main at 3e6f640) row 1 was 51 ms vs 235 ms at 10,000 partitions (0.22): every poll
walked every partition and journalled the whole partition list. With that fixed and the source unchanged, row 2
was 1,022 ms vs 1,387 ms (0.74): the source's poll alone took 1,016 ms of CPU, two admin ListOffsets requests of
10,000 partitions each (librdkafka's cost grows faster than a request: one of 10,000 took 311-485 ms, forty of
250 took 21.5 ms); it now asks in requests of 250 (``kafka_client.watermarks``). Then (a loaded 2-core machine):
row 1 3.4 ms vs 224.4 ms (0.015), row 2 63.5 ms vs 395.5 ms (0.16), the source's poll alone 57.4 ms. With
the earliest offsets asked with the listing only and idle partitions' ends in turn (``sources/kafka_poll.py``;
load 3.8): row 1 2.6 ms vs 157.9 ms, row 2 8.8 ms vs 216.3 ms (0.041), the source's poll alone 4.0 ms.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import environment, load, table

POLLS = 5


def _core(state: Path, name: str, uri: str, partitions: list[Any]) -> tuple[Any, str]:
    from streamrover.shard_service.api import DatasetSpec
    from streamrover.shard_service.master.core import ShardCore
    from streamrover.shard_service.master.journal import Journal
    from streamrover.sources.api import SourceKind

    core = ShardCore(Journal(state / "journal.db", exclusive=True), lease_ttl=600.0)
    spec = DatasetSpec(name, uri, options={"sr.max_pending_shards": "1000000"}, records_per_shard=1)
    core.register_dataset(spec, SourceKind.STREAM, partitions, "[]")
    return core, core.join("driver").id


def _plan(core: Any, name: str, polled: list[Any]) -> int:
    """What the poller does under the lock with a poll (poller.StreamPoller._poll_once)."""
    looked = core.streams.changed(name, polled)
    core.streams.upstream.check(name, polled if looked is None else looked, core.acked_cursor)
    return int(core.extend_stream(name, polled))


def _drain(core: Any, worker: str, name: str) -> None:
    while True:
        out = core.lease(worker, name, 10_000)
        if not out.leases:
            return
        for g in out.leases:
            core.ack(worker, g.shard_id, g.attempt, g.end)


def made_up(partitions: int) -> tuple[float, float]:
    """Row 1: (CPU seconds per poll with 1% moved, with all moved)."""
    from streamrover.sources.api import Partition

    with tempfile.TemporaryDirectory() as tmp:
        ids = [f"t-{i}" for i in range(partitions)]
        core, worker = _core(Path(tmp), "t", "kafka://127.0.0.1:9/t", [Partition(i, 0, 0) for i in ids])
        ends = [0] * partitions

        def poll(every: int) -> float:
            for i in range(0, partitions, every):
                ends[i] += 1
            polled = [Partition(pid, 0, end, earliest=0) for pid, end in zip(ids, ends)]
            t0 = time.process_time()
            _plan(core, "t", polled)
            spent = time.process_time() - t0
            _drain(core, worker, "t")
            return spent

        _plan(core, "t", [Partition(pid, 0, 0, earliest=0) for pid in ids])
        out = []
        for every in (100, 1):
            poll(every)  # warm
            out.append(min(poll(every) for _ in range(POLLS)))
        core.journal.close()
        return out[0], out[1]


def kafka(partitions: int) -> tuple[float, float, float, float]:
    """Row 2: (topic creation s, CPU per poll 1% moved, all moved, the source's poll alone)."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewPartitions, NewTopic

    from streamrover.sources.kafka import KafkaSource
    from tests.brokers.kafka import KafkaBroker

    with tempfile.TemporaryDirectory() as tmp:
        broker = KafkaBroker(Path(tmp) / "kafka", heap="1g")
        broker.start()
        try:
            admin = AdminClient({"bootstrap.servers": broker.bootstrap})
            t0, step = time.perf_counter(), 2000
            for f in admin.create_topics([NewTopic("big", min(partitions, step), 1)]).values():
                f.result(600)
            for n in range(2 * step, partitions + step, step):
                for f in admin.create_partitions([NewPartitions("big", min(n, partitions))]).values():
                    f.result(600)
            created = time.perf_counter() - t0
            source = KafkaSource(f"kafka://{broker.bootstrap}/big")
            deadline = time.monotonic() + 300
            while True:  # every partition has a leader once the poll answers for all of them
                try:
                    first = source.poll()
                    if len(first) == partitions:
                        break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                time.sleep(0.5)  # waiting for the broker's leaders (not a synchronisation between our threads)
            producer = Producer({"bootstrap.servers": broker.bootstrap, "linger.ms": 5})
            core, worker = _core(Path(tmp), "big", f"kafka://{broker.bootstrap}/big", first)
            _plan(core, "big", first)

            def poll(every: int) -> tuple[float, float]:
                for i in range(0, partitions, every):
                    producer.produce("big", b"x", partition=i)
                assert producer.flush(120) == 0
                t0 = time.process_time()
                polled = source.poll()
                t1 = time.process_time()
                _plan(core, "big", polled)
                spent = time.process_time() - t0
                _drain(core, worker, "big")
                return spent, t1 - t0

            rows = []
            for every in (100, 1):
                poll(every)  # warm
                rows.append(min(poll(every) for _ in range(POLLS)))
            source.close()
            core.journal.close()
            return created, rows[0][0], rows[1][0], min(rows[0][1], rows[1][1])
        finally:
            broker.stop()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks poll", description=__doc__.split("\n")[0])
    parser.add_argument("--partitions", type=int, default=10_000)
    parser.add_argument("--kafka", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--quick", action="store_true", help="1,000 partitions")
    args, _ = parser.parse_known_args(argv)
    p = 1_000 if args.quick else args.partitions
    print(environment(), flush=True)
    print(load(), flush=True)
    one, every = made_up(p)
    rows = [("planning, polls made up", f"{one * 1000:.1f}", f"{every * 1000:.1f}", f"{one / every:.3f}")]
    if args.kafka:
        created, k_one, k_every, source = kafka(p)
        print(f"Kafka topic of {p:,} partitions created in {created:.0f}s; the source's poll alone: "
              f"{source * 1000:.1f} ms CPU", flush=True)  # fmt: skip
        rows.append(("Kafka: source poll + planning", f"{k_one * 1000:.1f}", f"{k_every * 1000:.1f}",
                     f"{k_one / k_every:.3f}"))  # fmt: skip
    print(f"\nmaster CPU per poll of a stream of {p:,} partitions (min of {POLLS} polls)")
    print(table(("", "1% moved (ms)", "all moved (ms)", "ratio"), rows))
    return 0
