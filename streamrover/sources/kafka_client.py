"""Kafka client plumbing of the Kafka source: its URI, librdkafka settings, the dead-letter topic, and the
master's requests (topic partitions, offsets, consumer-group commits), each bounded by :data:`REQUEST_TIMEOUT`.

The source itself (partitions, reads, commits) is ``kafka.py``; this module holds what
does not depend on the source's state.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka import (
    TIMESTAMP_NOT_AVAILABLE,
    Consumer,
    ConsumerGroupTopicPartitions,
    IsolationLevel,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient

from streamrover.sources.api import SourceError, SourceGoneError, SourceUnavailableError
from streamrover.sources.options import OptionError
from streamrover.sources.serde import DeadLetters, Message

REQUEST_TIMEOUT = 10.0  # seconds an admin request, a commit or a dead-letter flush may take
_CONSUMER_ONLY = ("group.", "isolation.", "enable.", "auto.")  # settings an admin client or producer refuses


class RepeatFilter(logging.Filter):
    """Passes a line at most once per ``every`` seconds when it repeats (the same text but for its numbers).

    librdkafka logs "Connect to ... failed: Connection refused" every ~50 ms while a broker is down (755 lines in
    40 s in a chief's log). The first line passes; repeats within ``every`` seconds are counted, and the next
    one that passes says how many were suppressed.
    """

    def __init__(self, every: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.every = every
        self.clock = clock
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[float, int]] = {}  # shape -> (when it last passed, repeats suppressed since)

    def filter(self, record: logging.LogRecord) -> bool:
        shape = re.sub(r"\d+", "#", record.getMessage())
        now = self.clock()
        with self._lock:
            last, suppressed = self._seen.get(shape, (float("-inf"), 0))
            if now - last < self.every:
                self._seen[shape] = (last, suppressed + 1)
                return False
            if len(self._seen) > 1000:  # shapes of lines long gone
                self._seen.clear()
            self._seen[shape] = (now, 0)
        if suppressed:
            record.msg = f"{record.getMessage()} ({suppressed} like it suppressed in the last {self.every:.0f}s)"
            record.args = None
        return True


#: where librdkafka's own log lines go (instead of stderr), repeats rate-limited
RDKAFKA_LOG = logging.getLogger("streamrover.sources.kafka.rdkafka")
RDKAFKA_LOG.addFilter(RepeatFilter())


#: partitions per ListOffsets request of a poll: librdkafka's cost grows faster than the request (10,000 partitions
#: in one: 311 ms of CPU; in requests of 250: 21.5 ms; `python -m benchmarks poll`, issue 32)
OFFSETS_CHUNK = 250


def watermarks(consumer: Consumer, topic: str, numbers: list[int], which: int, where: str) -> dict[int, int]:
    """Per partition number, its latest (``which`` = -1: the last stable offset under read_committed, the high
    watermark otherwise, as the consumer's isolation.level says) or earliest (-2) offset, asked in requests of
    :data:`OFFSETS_CHUNK` partitions, each bounded by :data:`REQUEST_TIMEOUT`. An answer without an offset (-1001,
    seen from a broker stopped and resumed) is no end: SourceUnavailableError, as for any failed request."""
    found: dict[int, int] = {}
    try:
        for k in range(0, len(numbers), OFFSETS_CHUNK):
            asked = [TopicPartition(topic, n, which) for n in numbers[k : k + OFFSETS_CHUNK]]
            for tp in consumer.offsets_for_times(asked, REQUEST_TIMEOUT):
                if tp.error is not None or tp.offset < 0:
                    raise SourceUnavailableError(
                        f"cannot list offsets of {topic!r} at {where}: partition {tp.partition}: "
                        f"{tp.error if tp.error is not None else f'no offset in the answer ({tp.offset})'}"
                    )
                found[tp.partition] = int(tp.offset)
    except KafkaException as exc:
        raise SourceUnavailableError(f"cannot list offsets of {topic!r} at {where}: {exc}") from exc
    return found


# -- the master's admin requests (bounded: a wedged client must not hold the master's poller) ----------------------
def partition_numbers(admin: AdminClient, topic: str, where: str) -> list[int]:
    """The partition numbers of ``topic``, sorted; SourceGoneError when it does not exist (``where``: bootstrap)."""
    try:
        meta = admin.list_topics(topic, timeout=REQUEST_TIMEOUT)
    except KafkaException as exc:
        raise SourceUnavailableError(f"cannot reach Kafka at {where}: {exc}") from exc
    found = meta.topics.get(topic)
    if found is None or (found.error is not None and found.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART):
        raise SourceGoneError(f"Kafka topic {topic!r} does not exist at {where}")
    if found.error is not None:
        raise SourceUnavailableError(f"Kafka topic {topic!r}: {found.error}")
    return sorted(found.partitions)


def list_offsets(
    admin: AdminClient, topic: str, where: str, numbers: list[int], spec: Any, read_committed: bool, exact: bool = True
) -> dict[int, int]:
    """Per partition number, the offset ``spec`` names; ``exact``: every answer must be one (not -1 or -1001)."""
    level = IsolationLevel.READ_COMMITTED if read_committed else IsolationLevel.READ_UNCOMMITTED
    request = {TopicPartition(topic, n): spec for n in numbers}
    try:
        futures = admin.list_offsets(request, isolation_level=level, request_timeout=REQUEST_TIMEOUT)
        # Bounded here too: a future librdkafka never resolved (a broker fenced and back under load) held the
        # master's poller for good, and with it the stream's planning, silently.
        deadline = time.monotonic() + REQUEST_TIMEOUT + 5
        found = {
            tp.partition: int(f.result(timeout=max(deadline - time.monotonic(), 0.0)).offset)
            for tp, f in futures.items()
        }
    except TimeoutError as exc:
        raise SourceUnavailableError(
            f"cannot list offsets of {topic!r} at {where}: no answer in {REQUEST_TIMEOUT + 5:.0f}s"
        ) from exc
    except KafkaException as exc:
        raise SourceUnavailableError(f"cannot list offsets of {topic!r} at {where}: {exc}") from exc
    # An answer without an offset (-1001, seen from a broker stopped and resumed) is no end: taken as one it
    # read as "the end went back" (reported as records gone) and lag went negative.
    invalid = sorted(n for n, off in found.items() if off < 0)
    if exact and invalid:
        raise SourceUnavailableError(
            f"cannot list offsets of {topic!r} at {where}: no offset in the answer for partition(s) "
            + ", ".join(f"{n} ({found[n]})" for n in invalid)
        )
    return found


def commit_group_offsets(admin: AdminClient, group: str, offsets: list[TopicPartition]) -> None:
    """Commit ``offsets`` to consumer group ``group``; SourceUnavailableError when it fails or any is refused."""
    # Through the admin API, bounded by REQUEST_TIMEOUT: a consumer's synchronous commit waits for the group
    # coordinator with no bound, so an outage would stall the master's poller (and its status) until it ended.
    try:
        futures = admin.alter_consumer_group_offsets(
            [ConsumerGroupTopicPartitions(group, offsets)], request_timeout=REQUEST_TIMEOUT
        )
        answered = futures[group].result(timeout=REQUEST_TIMEOUT + 5)
    except (KafkaException, TimeoutError) as exc:
        raise SourceUnavailableError(f"cannot commit offsets to group {group!r}: {exc}") from exc
    refused = [tp for tp in answered.topic_partitions or [] if tp.error is not None]
    if refused:
        raise SourceUnavailableError(
            f"cannot commit offsets to group {group!r}: "
            + ", ".join(f"partition {tp.partition}: {tp.error}" for tp in refused)
        )


def with_logger(conf: Mapping[str, Any]) -> dict[str, Any]:
    """``conf`` with librdkafka's log sent to :data:`RDKAFKA_LOG` (unless the user gave a ``logger``)."""
    return {"logger": RDKAFKA_LOG, **conf}


def non_consumer_options(rdkafka: Mapping[str, Any]) -> dict[str, Any]:
    """The librdkafka settings less the consumer-only ones (``group.*``, ``isolation.*``...): for admin and producer."""
    return {k: v for k, v in rdkafka.items() if not k.startswith(_CONSUMER_ONLY)}


def parse_uri(uri: str) -> tuple[str, str]:
    """(bootstrap servers, topic) of ``kafka://HOST:PORT[,HOST:PORT...]/TOPIC``; SourceError otherwise."""
    if not uri.startswith("kafka://"):
        raise SourceError(f"a Kafka URI looks like kafka://HOST:PORT/TOPIC, got {uri!r}")
    rest = uri[len("kafka://") :]
    bootstrap, _, topic = rest.partition("/")
    if not bootstrap or not topic or "/" in topic:
        raise SourceError(f"a Kafka URI looks like kafka://HOST:PORT[,HOST:PORT]/TOPIC, got {uri!r}")
    return bootstrap, topic


def check_client_options(conf: Mapping[str, Any]) -> None:
    """librdkafka checks setting names and values when a client is made: make one that connects nowhere."""
    probe = {k: v for k, v in conf.items() if k != "bootstrap.servers"}
    try:
        Consumer({**probe, "log_level": 0}).close()
    except KafkaException as exc:
        raise OptionError(f"Kafka client option refused: {exc.args[0].str()} (options other than sr.* are "
                          "librdkafka configuration, see its CONFIGURATION.md)") from None  # fmt: skip


class TopicDeadLetters(DeadLetters):
    """Undecodable records produced, raw, to a Kafka topic of the same cluster.

    The key is ``partition:offset`` (a compacted topic keeps one copy per record
    across replays); headers carry the partition, offset and decode error.
    """

    def __init__(self, rdkafka: Mapping[str, Any], topic: str) -> None:
        super().__init__("")
        conf = non_consumer_options(rdkafka)
        conf.update({"acks": "all", "enable.idempotence": True})
        self.topic = topic
        self._producer = Producer(conf)

    def send(self, partition_id: str, msg: Message, error: Exception) -> None:
        """Produce ``msg``, which failed to decode with ``error``, to the dead-letter topic (its partition, offset
        and error in headers).
        """
        headers: list[tuple[str, str | bytes | None]] = [
            ("sr.partition", partition_id.encode()),
            ("sr.offset", str(msg.position).encode()),
            ("sr.error", str(error).encode()),
        ]
        self._producer.produce(self.topic, value=msg.value, key=f"{partition_id}:{msg.position}", headers=headers)

    def flush(self) -> None:
        if self._producer.flush(REQUEST_TIMEOUT) != 0:
            raise SourceUnavailableError(
                f"dead letters not delivered to topic {self.topic!r} within {REQUEST_TIMEOUT}s"
            )


class RecordTimes:
    """The timestamps (CreateTime or LogAppendTime, as the topic keeps them) of the first records of offset ranges:
    what the master's poller reads for each new shard (stream-time order). A consumer of its own that fetches
    little at a time (a shard's first record, not 16 MB after it), no group: nothing is committed."""

    def __init__(self, rdkafka: Mapping[str, Any], topic: str) -> None:
        conf = {**rdkafka, "enable.auto.commit": False, "enable.partition.eof": True, "auto.offset.reset": "error"}
        conf.update({"max.partition.fetch.bytes": 65536, "queued.max.messages.kbytes": 1024, "fetch.wait.max.ms": 20})
        self.topic = topic
        self._consumer = Consumer(with_logger(conf))

    def first(self, ranges: list[tuple[int, int, int]], timeout: float = REQUEST_TIMEOUT) -> list[float | None]:
        """For each (partition number, start, end): the timestamp in ms of the first record in [start, end), None
        where the topic keeps none or the range holds no record. One partition's range per fetch round.

        Raises :class:`SourceUnavailableError` when a round gets no answer within ``timeout`` seconds.
        """
        try:
            return self._first(ranges, timeout)
        except KafkaException as exc:
            raise SourceUnavailableError(f"reading record timestamps of topic {self.topic!r}: {exc}") from exc

    def _first(self, ranges: list[tuple[int, int, int]], timeout: float) -> list[float | None]:
        out: list[float | None] = [None] * len(ranges)
        # each partition's ranges in position order: a record still queued from an earlier assignment of the
        # partition then lies before this range or is one of its records in log order, never a later range's
        todo = sorted(enumerate(ranges), key=lambda r: (r[1][1], r[1][0]))
        while todo:
            round_: dict[int, tuple[int, int, int]] = {}  # partition -> (index in ranges, start, end)
            rest = []
            for i, (p, start, end) in todo:
                if p in round_:
                    rest.append((i, (p, start, end)))
                else:
                    round_[p] = (i, start, end)
            todo = rest
            self._consumer.assign([TopicPartition(self.topic, p, start) for p, (_, start, _) in round_.items()])
            deadline = time.monotonic() + timeout
            while round_:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SourceUnavailableError(
                        f"no record timestamps of topic {self.topic!r} partitions {sorted(round_)} in {timeout:.0f}s"
                    )
                msg = self._consumer.poll(min(left, 1.0))
                if msg is None or msg.partition() not in round_:
                    continue
                i, start, end = round_[msg.partition()]  # type: ignore[index]
                err = msg.error()
                if err is None and msg.offset() < start:  # type: ignore[operator]
                    continue  # (fetched before this assignment)
                if err is not None and err.code() == KafkaError._PARTITION_EOF and msg.offset() > start:  # type: ignore[operator]
                    continue  # the end an earlier assignment reached (records lie past this one's start)
                if msg.error() is None and msg.offset() < end:  # type: ignore[operator]
                    kind, stamp = msg.timestamp()
                    out[i] = float(stamp) if kind != TIMESTAMP_NOT_AVAILABLE else None
                del round_[msg.partition()]  # type: ignore[arg-type]  # a record, the partition's end, or an error
        self._consumer.unassign()
        return out

    def close(self) -> None:
        self._consumer.close()
