"""Kafka shard reads at the source level: consecutive shards of a partition go on without a new assignment.

A worker whose next shard starts where its last read ended keeps its consumer where it is
(prefetched records, records delivered past the last shard's end). These tests read a
transactional topic (aborted records and commit/abort markers leave offset gaps, so fetches
overshoot shard ends) shard after shard with one source and check every shard's records
against what a plain read_committed consumer sees, and that the consumer was assigned once.
"""

from __future__ import annotations

import itertools
import json
import uuid
from typing import Any

import pytest

from streamrover.sources.api import Partition
from streamrover.sources.kafka import KafkaSource

pytestmark = pytest.mark.slow


class _CountingConsumer:
    """Delegates to a confluent-kafka Consumer and counts ``assign`` calls."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.assigns: list[tuple[int, int]] = []

    def assign(self, partitions: list[Any]) -> None:
        self.assigns.extend((tp.partition, tp.offset) for tp in partitions)
        self.inner.assign(partitions)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _transactional_topic(broker: Any, rounds: int, per_round: int, abort_last: bool) -> tuple[str, list[int]]:
    """One partition; every third transaction aborted (and the last one when ``abort_last``). Returns visible ids."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = f"reads-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    for f in admin.create_topics([NewTopic(topic, 1, 1)]).values():
        f.result(30)
    producer = Producer(broker.client_config(**{"transactional.id": f"tx-{topic}", "acks": "all"}))
    producer.init_transactions(30)
    visible: list[int] = []
    next_id = 0
    for r in range(rounds):
        abort = r % 3 == 1 or (abort_last and r == rounds - 1)
        producer.begin_transaction()
        for _ in range(per_round):
            producer.produce(topic, value=json.dumps({"id": next_id}).encode(), partition=0)
            if not abort:
                visible.append(next_id)
            next_id += 1
        if abort:
            assert producer.flush(30) == 0  # the aborted records take offsets before the abort
            producer.abort_transaction(30)
        else:
            producer.commit_transaction(30)
    return topic, visible


def _read(source: KafkaSource, part: Partition, start: int, end: int, batch_size: int) -> list[int]:
    """The ids of one shard, checking that batches tile [start, end)."""
    ids: list[int] = []
    pos = start
    for batch in source.read(part, start, end, batch_size):
        assert batch.start == pos and batch.end <= end
        pos = batch.end
        offsets = batch.records.column("offset").to_pylist()
        assert all(batch.start <= o < batch.end for o in offsets)
        ids += [json.loads(v)["id"] for v in batch.records.column("value").to_pylist()]
    assert pos == end
    return ids


@pytest.mark.parametrize("abort_last", [False, True], ids=["committed-tail", "aborted-tail"])
def test_consecutive_shards_continue_without_reassigning(kafka_broker: Any, abort_last: bool) -> None:
    topic, visible = _transactional_topic(kafka_broker, rounds=12, per_round=40, abort_last=abort_last)
    source = KafkaSource(f"kafka://{kafka_broker.bootstrap}/{topic}", options={"sr.format": "raw"})
    try:
        (part,) = source.partitions()
        assert part.end == 12 * 40 + 12  # records and one marker per transaction
        counting = _CountingConsumer(source._consumer_client())
        source._consumer = counting  # type: ignore[assignment]
        ids: list[int] = []
        size = 37  # shard ends fall inside transactions and on markers
        bounds = [*range(part.start, part.end, size), part.end]
        for a, b in itertools.pairwise(bounds):
            ids += _read(source, part, a, b, batch_size=16)
        assert ids == visible
        # one assignment: shards with no record in their tail (an aborted transaction) end at the
        # end of partition the consumer reported earlier
        assert counting.assigns == [(0, part.start)]

        # a read elsewhere re-assigns, and reading the continuation of that one goes on again
        mid = bounds[len(bounds) // 2]
        before = len(counting.assigns)
        again = _read(source, part, mid, mid + size, batch_size=1000) + _read(source, part, mid + size, part.end, 7)
        assert counting.assigns[before] == (0, mid)
        fresh = KafkaSource(f"kafka://{kafka_broker.bootstrap}/{topic}", options={"sr.format": "raw"})
        try:
            assert again == _read(fresh, part, mid, part.end, batch_size=64)
        finally:
            fresh.close()
    finally:
        source.close()


def test_an_unfinished_read_does_not_continue(kafka_broker: Any) -> None:
    topic, visible = _transactional_topic(kafka_broker, rounds=3, per_round=50, abort_last=False)  # aborts #2
    source = KafkaSource(f"kafka://{kafka_broker.bootstrap}/{topic}", options={"sr.format": "raw"})
    try:
        (part,) = source.partitions()
        counting = _CountingConsumer(source._consumer_client())
        source._consumer = counting  # type: ignore[assignment]
        reader = source.read(part, 0, 60, batch_size=10)
        next(reader)  # a lease lost mid-shard: the rest is not read
        reader.close()
        # the next shard starts at 60, but the consumer is not there: it is assigned afresh
        ids = _read(source, part, 60, part.end, batch_size=25)
        assert counting.assigns == [(0, 0), (0, 60)]
        # offsets: ids 0-49 at 0-49, a marker at 50, aborted ids 50-99 at 51-100, a marker, ids 100-149 at 102-151
        assert ids == list(range(100, 150)) and visible == [*range(50), *range(100, 150)]
    finally:
        source.close()


def test_batches_span_consumer_calls_and_keep_every_column(kafka_broker: Any) -> None:
    """Batches larger than what one consume() call takes (CHUNK) hold every record once, with its key,
    value (null values included), timestamp and offset as a plain consumer sees them; Message objects
    are freed call by call (at most one call's worth alive while a batch is handed out)."""
    import gc

    from confluent_kafka import Consumer, Message, Producer, TopicPartition
    from confluent_kafka.admin import AdminClient, NewTopic

    from streamrover.sources.kafka import CHUNK

    topic = f"chunks-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": kafka_broker.bootstrap})
    # records timestamped in 2023: older than the broker's 7-day retention, which deletes them at its first check
    # (30 s after the broker starts, then every 5 min) unless the topic keeps them
    for f in admin.create_topics([NewTopic(topic, 1, 1, config={"retention.ms": "-1"})]).values():
        f.result(30)
    n = 3 * CHUNK + 301
    producer = Producer(kafka_broker.client_config(acks="all"))
    for i in range(n):
        value = None if i % 97 == 5 else bytes([i % 251]) * (i % 1500)  # some null values (tombstones), some empty
        key = f"k{i}".encode() if i % 3 == 0 else None
        producer.produce(topic, value=value, key=key, partition=0, timestamp=1_700_000_000_000 + i)
    assert producer.flush(30) == 0

    plain = Consumer(kafka_broker.client_config(**{"group.id": f"plain-{topic}", "enable.partition.eof": True}))
    plain.assign([TopicPartition(topic, 0, 0)])
    expected: list[tuple[Any, ...]] = []
    while len(expected) < n:
        for m in plain.consume(1000, timeout=5):
            if m.error() is None:
                expected.append((m.key(), m.value(), m.timestamp()[1], m.offset()))
    plain.close()

    source = KafkaSource(f"kafka://{kafka_broker.bootstrap}/{topic}", options={"sr.format": "raw"})
    try:
        (part,) = source.partitions()
        assert part.end == n
        got: list[tuple[Any, ...]] = []
        sizes: list[int] = []
        cut = 1400  # two shards, the second going on from the first; the first holds a whole batch
        for start, end in ((0, cut), (cut, n)):
            for batch in source.read(part, start, end, batch_size=2 * CHUNK + 7):
                alive = sum(isinstance(o, Message) for o in gc.get_objects())
                assert alive <= CHUNK, f"{alive} Message objects alive while a batch is handed out"
                cols = batch.records.to_pydict()
                got += zip(cols["key"], cols["value"], cols["timestamp"], cols["offset"])
                assert batch.positions is not None and batch.positions.to_pylist() == cols["offset"]
                sizes.append(batch.num_records)
        assert got == expected
        assert max(sizes) == 2 * CHUNK + 7  # batches made of several consume() calls
    finally:
        source.close()


def test_a_large_topic_is_listed_once_per_period_and_again_after_a_failed_poll(
    kafka_broker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 32: listing 10,000 partitions at every poll (100 ms apart) stalled the master's answers; a poll now
    reuses the listing and the earliest offsets for len/LISTED_PER_SECOND seconds, and a poll that fails lists
    again, so a deleted topic is still told as gone (SourceGoneError), not only as a broker that does not answer."""
    import time

    from confluent_kafka.admin import AdminClient, NewPartitions, NewTopic

    from streamrover.sources import kafka as kafka_module
    from streamrover.sources.api import SourceError, SourceGoneError

    monkeypatch.setattr(kafka_module, "LISTED_PER_SECOND", 2 / 3600)  # two partitions: listed once an hour
    topic = f"listed-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": kafka_broker.bootstrap})
    admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(30)
    source = KafkaSource(f"kafka://{kafka_broker.bootstrap}/{topic}", options={"sr.format": "raw"})
    listings: list[int] = []
    real = source._partition_numbers

    def counted() -> list[int]:
        listings.append(1)
        return real()

    source._partition_numbers = counted  # type: ignore[method-assign]
    earliest_asked: list[int] = []  # polls that asked the partitions' earliest offsets
    real_watermarks = kafka_module.watermarks

    def watermarks(consumer: Any, topic: str, numbers: list[int], which: int, *args: Any) -> dict[int, int]:
        if which == kafka_module.OFFSET_BEGINNING:
            earliest_asked.append(1)
        return real_watermarks(consumer, topic, numbers, which, *args)

    monkeypatch.setattr(kafka_module, "watermarks", watermarks)

    def poll_until(error: type[Exception] | None, seconds: float = 60.0) -> Exception | None:
        """Poll until a poll succeeds (``error`` None) or raises ``error``; other source errors are retried."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                source.poll()
                if error is None:
                    return None
            except SourceError as exc:
                if error is not None and isinstance(exc, error):
                    return exc
                if time.monotonic() > deadline:
                    raise
            if time.monotonic() > deadline:
                raise AssertionError(f"no {error} within {seconds} s")
            time.sleep(0.2)  # the next poll (a poller's interval), not synchronisation

    try:
        poll_until(None)  # a new topic's leaders may take a moment
        listings.clear()
        earliest_asked.clear()
        for _ in range(3):
            assert [p.id for p in source.poll()] == [f"{topic}-0", f"{topic}-1"]
        assert listings == []  # (every poll listed the topic before)
        assert earliest_asked == []  # asked with the listing only (every poll asked them before)
        admin.create_partitions([NewPartitions(topic, 3)])[topic].result(30)
        assert len(source.poll()) == 2  # the listing is reused within its period: a new partition waits for it
        admin.delete_topics([topic])[topic].result(30)
        assert isinstance(poll_until(SourceGoneError), SourceGoneError)  # a failed poll dropped the listing
        assert listings
    finally:
        source.close()
