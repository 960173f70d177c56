"""Pulsar streams end to end, against pulsar-lite (4 partitions per topic).

Records with unique ids are produced across the partitions while ledger worker
processes consume them through shards; workers and the master are SIGKILLed at
random moments. The ledger must be exact and the subscription cursor the master
acknowledged must equal the committed cursor. pulsar-lite cannot open a reader on
one partition, so the source selects its ``routed`` partition reads here
(streamrover/sources/pulsar.py); ``direct`` reads are not exercised.
"""

from __future__ import annotations

import json
import random
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streamrover.cursor import IntervalSet, PartitionKey
from streamrover.sources.pulsar import PositionCodec, PulsarSource
from tests.brokers.pulsar import PulsarLiteBroker
from tests.helpers import wait_until
from tests.sources.stream_job import StreamJob

pulsar = pytest.importorskip("pulsar")
# pulsar-lite (the embedded test broker) occasionally times out a subscribe under load: one rerun, not more.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.flaky(reruns=1)]
PARTITIONS = 4  # the pulsar_broker fixture's default_partitions


@pytest.fixture(scope="module")
def unpartitioned_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PulsarLiteBroker]:
    """pulsar-lite whose topics are not partitioned: a topic is one partition, read ``direct``."""
    broker = PulsarLiteBroker(tmp_path_factory.mktemp("pulsar-unpartitioned"), default_partitions=0)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def client(pulsar_broker: Any) -> Iterator[Any]:
    c = pulsar.Client(pulsar_broker.service_url, operation_timeout_seconds=10, logger=_quiet_logger())
    try:
        yield c
    finally:
        c.close()


def _quiet_logger() -> Any:
    import logging

    return logging.getLogger("tests.pulsar-client")


def _topic() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


def _client(broker: Any) -> Any:
    return pulsar.Client(broker.service_url, operation_timeout_seconds=10, logger=_quiet_logger())


def _produce(client: Any, topic: str, ids: range, poison: set[int] | None = None) -> None:
    """Non-batched (pulsar-lite does not persist acks of batched messages), round robin over the partitions."""
    producer = client.create_producer(
        f"persistent://public/default/{topic}", batching_enabled=False, block_if_queue_full=True
    )
    failed: list[str] = []

    def sent(result: Any, _msg_id: Any) -> None:
        if result != pulsar.Result.Ok:
            failed.append(str(result))

    try:
        for i in ids:
            value = b"\x00not json" if poison and i in poison else json.dumps({"id": i}).encode()
            producer.send_async(value, sent)
        producer.flush()
    finally:
        producer.close()
    assert not failed, f"{len(failed)} sends failed: {failed[:3]}"


def _job(tmp_path: Path, broker: Any, topic: str, **options: str) -> StreamJob:
    opts = {"sr.format": "json", "sr.schema": "id:int64", "sr.max_delay_ms": "200", **options}
    return StreamJob(tmp_path, f"{broker.service_url}/{topic}", opts, records_per_shard=500)


def _read_mode(job: StreamJob) -> str:
    """Which partition reads the source selects for this broker (``auto``)."""
    source = PulsarSource(job.uri, "", job.options)
    try:
        source.partitions()
        return source.mode
    finally:
        source.close()


def _available(job: StreamJob) -> dict[str, int]:
    with job.admin() as admin:
        return {p.id: p.available_end for p in admin.describe_dataset("stream").partitions}


def _first_positions(client: Any, topic: str, subscription: str, want: int) -> dict[str, int]:
    """Per partition, the position of the first message a consumer of ``subscription`` gets: its cursor."""
    codec = PositionCodec()
    consumer = client.subscribe(
        f"persistent://public/default/{topic}",
        subscription,
        consumer_type=pulsar.ConsumerType.Failover,
        initial_position=pulsar.InitialPosition.Earliest,
    )
    first: dict[str, int] = {}
    try:
        while len(first) < want:
            msg = consumer.receive(30_000)
            mid = msg.message_id()
            first.setdefault(msg.topic_name().rsplit("/", 1)[1], codec.encode(mid.ledger_id(), mid.entry_id()))
    finally:
        consumer.close()
    return first


def test_stream_ledger_exact_under_worker_and_master_kills(tmp_path: Path, pulsar_broker: Any, client: Any) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    total = 12_000
    topic = _topic()
    _produce(client, topic, range(0, total // 2))
    job = _job(tmp_path, pulsar_broker, topic)
    try:
        job.start()
        later = threading.Thread(target=_produce, args=(client, topic, range(total // 2, total)))
        later.start()  # the second half arrives while the job runs
        job.run_chaos(total, [lambda: job.kill_worker(rng), lambda: job.kill_worker(rng), job.kill_master], rng)
        later.join()
        report, cursor, finished = job.finish(total)
        info: Any = finished
        assert report.exact, f"seed {seed}, {job.events}: {report}\n{job.logs()}"
        assert report.conflicts == 0
        assert len(info.partitions) == PARTITIONS
        # The committed cursor covers each partition from its first message to its end, once.
        ends = {p.id: p.available_end for p in info.partitions}
        for part in info.partitions:
            assert cursor.get(PartitionKey("stream", 0, part.id)) == IntervalSet([(part.start, part.end)])
            assert part.end == ends[part.id] and part.committed_end == part.end
        assert info.lag == 0 and info.records_committed == info.total_records == total  # records, not positions
        # Two rounds of one marker per partition, each seen by the master's poller: the poll round that saw
        # the first markers started after the final cut's commit and acknowledged it upstream before ending.
        for extra in (1, 2):
            expected = {p: e + extra for p, e in ends.items()}
            _produce(client, topic, range(total + (extra - 1) * PARTITIONS, total + extra * PARTITIONS))
            wait_until(lambda: _available(job) == expected, 30, f"marker round {extra} polled")  # noqa: B023
    finally:
        job.stop()
    # Nothing holds the subscription now (pulsar-lite times out a second Failover consumer).
    assert _read_mode(job) == "routed"  # pulsar-lite cannot open a reader on one partition
    # The subscription's first undelivered message per partition is the first marker.
    got = _first_positions(client, topic, f"streamrover-{topic}", PARTITIONS)
    assert got == ends, f"subscription cursor {got} != committed cursor ends {ends}"


def test_poison_records_go_to_dead_letters(tmp_path: Path, pulsar_broker: Any, client: Any) -> None:
    total = 3_000
    poison = set(range(7, total, 97))
    topic = _topic()
    _produce(client, topic, range(total), poison)
    dead_dir = tmp_path / "dead"
    job = _job(tmp_path, pulsar_broker, topic, **{"sr.dead_letter_dir": str(dead_dir)})
    try:
        job.start()
        wait_until(lambda: job.applied() >= total - len(poison), 120, "every good record applied")
        with job.admin() as admin:
            wait_until(lambda: admin.describe_dataset("stream").dead_letters == len(poison), 30, "dead letters")
            info = admin.describe_dataset("stream")
        assert info.records_acked == total  # poison records are acked past, the partitions never stall
    finally:
        job.stop()
    files = sorted(dead_dir.glob("*.json"))
    assert len(files) == len(poison) == info.dead_letters
    assert all(bytes.fromhex(json.loads(f.read_text())["value"]) == b"\x00not json" for f in files)


def test_unpartitioned_topic_is_one_partition_read_direct(tmp_path: Path, unpartitioned_broker: Any) -> None:
    """A non-partitioned topic: the source reads it ``direct`` (a reader and a consumer on the topic itself)."""
    rng = random.Random()
    total, topic = 4_000, _topic()
    client = _client(unpartitioned_broker)
    try:
        _produce(client, topic, range(total))
        job = _job(tmp_path, unpartitioned_broker, topic)
        try:
            job.start()
            job.run_chaos(total, [lambda: job.kill_worker(rng), job.kill_master], rng)
            report, cursor, finished = job.finish(total)
            info: Any = finished
            assert report.exact, f"{job.events}: {report}\n{job.logs()}"
            [part] = info.partitions
            assert part.id == topic
            assert cursor.get(PartitionKey("stream", 0, topic)) == IntervalSet([(part.start, part.end)])
            for extra in (1, 2):  # as above: two polled marker rounds make sure the final commit went upstream
                _produce(client, topic, range(total + extra - 1, total + extra))
                wait_until(lambda: _available(job) == {topic: part.end + extra}, 30, "marker polled")  # noqa: B023
        finally:
            job.stop()
        assert _read_mode(job) == "direct"
        assert _first_positions(client, topic, f"streamrover-{topic}", 1) == {topic: part.end}
    finally:
        client.close()
