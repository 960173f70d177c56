"""Kafka-protocol streams end to end, against real Apache Kafka (KRaft) and tansu.

Records with unique ids are produced across partitions while worker processes
consume them through shards into the ledger; workers, the master and (Kafka)
the broker are SIGKILLed at random moments. The ledger must be exact and the
offsets committed to the consumer group must equal the committed cursor.
"""

from __future__ import annotations

import json
import random
import threading
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from streamrover.cursor import IntervalSet, PartitionKey
from streamrover.testing.ledger import Ledger
from tests.helpers import wait_until
from tests.sources.stream_job import StreamJob

pytestmark = pytest.mark.slow


@pytest.fixture(params=["kafka", "tansu"])
def broker(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(f"{request.param}_broker")


def _producer(broker: Any, **extra: Any) -> Any:
    from confluent_kafka import Producer

    if hasattr(broker, "producer_config"):  # tansu: one record per batch keeps its high watermark exact
        return Producer(broker.producer_config(**extra))
    return Producer(broker.client_config(**{"acks": "all", "enable.idempotence": True, **extra}))


def _create_topic(broker: Any, partitions: int, **config: str) -> str:
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = f"t-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    for f in admin.create_topics([NewTopic(topic, partitions, 1, config=config)]).values():
        f.result(30)
    return topic


def _produce(broker: Any, topic: str, ids: range, partitions: int, poison: set[int] | None = None) -> None:
    producer = _producer(broker)
    for i in ids:
        value = b"\x00not json" if poison and i in poison else json.dumps({"id": i}).encode()
        producer.produce(topic, value=value, partition=i % partitions)
        if i % 1000 == 0:
            producer.poll(0)
    assert producer.flush(60) == 0


def _group_offsets(broker: Any, topic: str, partitions: int) -> dict[str, int]:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": f"streamrover-{topic}"})
    try:
        got = consumer.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=10)
        return {f"{topic}-{tp.partition}": tp.offset for tp in got}
    finally:
        consumer.close()


def _job(tmp_path: Path, broker: Any, topic: str, **options: str) -> StreamJob:
    opts = {"sr.format": "json", "sr.schema": "id:int64", "sr.max_delay_ms": "200", **options}
    return StreamJob(tmp_path, f"kafka://{broker.bootstrap}/{topic}", opts, records_per_shard=500)


def test_stream_ledger_exact_under_worker_and_master_kills(tmp_path: Path, broker: Any) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    total, partitions = 20_000, 4
    topic = _create_topic(broker, partitions)
    _produce(broker, topic, range(0, total // 2), partitions)
    job = _job(tmp_path, broker, topic)
    try:
        job.start()
        later = threading.Thread(target=_produce, args=(broker, topic, range(total // 2, total), partitions))
        later.start()  # the second half arrives while the job runs
        job.run_chaos(total, [lambda: job.kill_worker(rng), lambda: job.kill_worker(rng), job.kill_master], rng)
        later.join()
        report, cursor, info = job.finish(total)
        assert report.exact, f"seed {seed}, {job.events}: {report}\n{job.logs()}"
        assert report.conflicts == 0
        # The committed cursor covers each partition from its start to its end, once.
        ends = {p.id: p.available_end for p in info.partitions}
        for part in info.partitions:
            assert cursor.get(PartitionKey("stream", 0, part.id)) == IntervalSet([(0, ends[part.id])])
        # ... and the offsets committed to the broker's consumer group equal it.
        wait_until(lambda: _group_offsets(broker, topic, partitions) == ends, 30, f"group offsets {ends}")
        assert info.lag == 0
    finally:
        job.stop()


def test_kafka_broker_restart_mid_run(tmp_path: Path, kafka_broker: Any) -> None:
    rng = random.Random()
    total, partitions = 12_000, 3
    topic = _create_topic(kafka_broker, partitions)
    _produce(kafka_broker, topic, range(total), partitions)
    job = _job(tmp_path, kafka_broker, topic)
    try:
        job.start()

        def broker_down_then_up() -> None:
            kafka_broker.kill()
            try:
                with job.admin() as admin:  # the master keeps retrying and says so in status
                    wait_until(
                        lambda: "Kafka" in admin.describe_dataset("stream").error, 60, "status to show the outage"
                    )
            finally:
                kafka_broker.start()  # also when the check failed: the broker is shared with later tests

        job.run_chaos(total, [broker_down_then_up], rng)
        report, _, info = job.finish(total)
        assert report.exact, f"{report}\n{job.logs()}"
        assert not info.failed and info.records_committed == total
        job.wait_outage_cleared()
    finally:
        job.stop()


def test_partition_added_mid_stream_is_picked_up(tmp_path: Path, kafka_broker: Any) -> None:
    from confluent_kafka.admin import AdminClient, NewPartitions

    topic = _create_topic(kafka_broker, 2)
    _produce(kafka_broker, topic, range(0, 2_000), 2)
    job = _job(tmp_path, kafka_broker, topic)
    try:
        job.start()
        wait_until(lambda: job.applied() >= 1_000, 60, "the job to be running")
        admin = AdminClient({"bootstrap.servers": kafka_broker.bootstrap})
        for f in admin.create_partitions([NewPartitions(topic, 3)]).values():
            f.result(30)
        producer = _producer(kafka_broker)
        for i in range(2_000, 3_000):
            producer.produce(topic, value=json.dumps({"id": i}).encode(), partition=2)
        assert producer.flush(30) == 0
        report, cursor, info = job.finish(3_000)
        assert report.exact, str(report)
        assert [p.id for p in info.partitions] == [f"{topic}-0", f"{topic}-1", f"{topic}-2"]
        assert cursor.get(PartitionKey("stream", 0, f"{topic}-2")) == IntervalSet([(0, 1_000)])
    finally:
        job.stop()


def test_offset_gaps_from_aborted_transactions(tmp_path: Path, kafka_broker: Any) -> None:
    """Aborted transactions leave records and markers (offset gaps) read_committed skips; each visible record once."""
    from confluent_kafka import Producer

    topic = _create_topic(kafka_broker, 2)
    producer = Producer(kafka_broker.client_config(**{"transactional.id": f"tx-{topic}", "acks": "all"}))
    producer.init_transactions(30)
    visible = []
    next_id = 0
    for round_no in range(20):
        producer.begin_transaction()
        for _ in range(50):
            producer.produce(topic, value=json.dumps({"id": next_id}).encode(), partition=next_id % 2)
            if round_no % 3 != 1:
                visible.append(next_id)
            next_id += 1
        if round_no % 3 == 1:
            assert producer.flush(30) == 0  # the aborted records reach the log (and take offsets) before the abort
            producer.abort_transaction(30)
        else:
            producer.commit_transaction(30)
    job = _job(tmp_path, kafka_broker, topic)
    try:
        job.start()
        wait_until(lambda: job.applied() >= len(visible), 120, "all committed transactional records")
        report = Ledger(job.ledger_path).verify(np.array(visible))
        assert report.exact, str(report)
        with job.admin() as admin:  # the shards covering the aborted records and markers were all completed
            info = admin.describe_dataset("stream")
            assert sum(p.available_end for p in info.partitions) == next_id + 2 * 20  # records, aborted ones, markers
            wait_until(lambda: admin.describe_dataset("stream").records_acked == next_id + 2 * 20, 30, "all acked")
    finally:
        job.stop()


def test_poison_records_go_to_the_dead_letter_dataset(tmp_path: Path, tansu_broker: Any) -> None:
    total, partitions = 3_000, 3
    poison = set(random.Random(5).sample(range(total), 37))
    topic = _create_topic(tansu_broker, partitions)
    _produce(tansu_broker, topic, range(total), partitions, poison=poison)
    dead_dir = tmp_path / "dead"
    job = _job(tmp_path, tansu_broker, topic, **{"sr.dead_letter_dir": str(dead_dir)})
    try:
        job.start()
        good = total - len(poison)
        wait_until(lambda: job.applied() >= good, 120, f"{good} good records applied")
        with job.admin() as admin:  # every position acked: the partitions did not stall on the poison
            wait_until(lambda: admin.describe_dataset("stream").records_acked == total, 60, "all positions acked")
            info = admin.describe_dataset("stream")
        report = Ledger(job.ledger_path).verify(np.array(sorted(set(range(total)) - poison)))
        assert report.exact, str(report)
        files = sorted(dead_dir.glob("*.json"))
        assert len(files) == len(poison)
        assert info.dead_letters == len(poison)
        sample = json.loads(files[0].read_text())
        assert bytes.fromhex(sample["value"]) == b"\x00not json" and sample["error"]
    finally:
        job.stop()


def test_poison_records_to_a_dead_letter_topic(tmp_path: Path, kafka_broker: Any) -> None:
    from confluent_kafka import Consumer, TopicPartition

    total, partitions = 1_000, 2
    poison = set(range(0, total, 97))
    topic = _create_topic(kafka_broker, partitions)
    dlq = _create_topic(kafka_broker, 1)
    _produce(kafka_broker, topic, range(total), partitions, poison=poison)
    job = _job(tmp_path, kafka_broker, topic, **{"sr.dead_letter_topic": dlq})
    try:
        job.start()
        with job.admin() as admin:
            wait_until(lambda: admin.describe_dataset("stream").records_acked == total, 120, "all positions acked")
            assert admin.describe_dataset("stream").dead_letters == len(poison)
        assert Ledger(job.ledger_path).verify(np.array(sorted(set(range(total)) - poison))).exact
        consumer = Consumer({"bootstrap.servers": kafka_broker.bootstrap, "group.id": "dlq-check"})
        consumer.assign([TopicPartition(dlq, 0, 0)])
        got = []
        while len(got) < len(poison):
            msg = consumer.poll(10)
            assert msg is not None, f"only {len(got)} dead letters in {dlq}"
            got.append(msg)
        consumer.close()
        assert {m.value() for m in got} == {b"\x00not json"}
        assert {dict(m.headers())["sr.offset"] for m in got} == {str(i // partitions).encode() for i in poison}
    finally:
        job.stop()


def _visible_ids(broker: Any, topic: str) -> list[int]:
    """Every record a read_committed consumer sees now, read to the end of partition 0."""
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    consumer = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": "peek", "enable.partition.eof": True})
    consumer.assign([TopicPartition(topic, 0, 0)])
    ids = []
    while True:
        msg = consumer.poll(10)
        assert msg is not None, "no end-of-partition event within 10 s"
        if msg.error() is not None:
            assert msg.error().code() == KafkaError._PARTITION_EOF, msg.error()
            break
        ids.append(json.loads(msg.value())["id"])
    consumer.close()
    return ids


def test_compacted_topic_trains_every_visible_record_once(tmp_path: Path, kafka_broker: Any) -> None:
    """The log cleaner removes superseded records: offsets get gaps; each surviving record is trained once."""
    config = {"cleanup.policy": "compact", "segment.bytes": "1048576", "min.cleanable.dirty.ratio": "0.01",
              "delete.retention.ms": "0", "min.compaction.lag.ms": "0", "segment.ms": "100"}  # fmt: skip
    topic = _create_topic(kafka_broker, 1, **config)
    producer = _producer(kafka_broker)
    pad = "x" * 1000  # ~1 KB records: three 1 MiB segments, two of them cleanable
    for i in range(3_000):
        producer.produce(topic, key=str(i % 100).encode(), value=json.dumps({"id": i, "pad": pad}).encode())
    assert producer.flush(30) == 0
    seen: list[list[int]] = [[]]

    def compacted_and_settled() -> bool:
        ids = _visible_ids(kafka_broker, topic)
        settled = len(ids) < 3_000 and ids == seen[0]
        seen[0] = ids
        return settled

    wait_until(compacted_and_settled, 90, "the log cleaner to compact the topic", interval=0.5)
    visible = seen[0]
    job = _job(tmp_path, kafka_broker, topic)
    try:
        job.start()
        wait_until(lambda: job.applied() >= len(visible), 120, f"{len(visible)} visible records")
        with job.admin() as admin:  # every position of the log, the gaps included, is covered once
            wait_until(lambda: admin.describe_dataset("stream").records_acked == 3_000, 30, "all offsets acked")
        report = Ledger(job.ledger_path).verify(np.array(visible))
        assert report.exact, str(report)
        assert len(visible) < 3_000  # the topic really had gaps
    finally:
        job.stop()
