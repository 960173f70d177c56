"""What a poll of a large Kafka topic asks (issue 32: its cost follows the partitions that moved, not the topic).

No broker: the topic's listing and offsets are answered by a fake, so a topic of thousands of partitions costs
nothing here (the requests themselves are covered by test_kafka_reads and test_poller_outages).
"""

from __future__ import annotations

from typing import Any

import pytest

from streamrover.sources.api import SourceError, SourceUnavailableError
from streamrover.sources.kafka_poll import IDLE_CHUNK, IDLE_SECONDS, MOVED_SECONDS, TopicPolls


class _Topic:
    """A topic's ends as the brokers would answer them, and what was asked."""

    def __init__(self, partitions: int) -> None:
        self.numbers = list(range(partitions))
        self.end = dict.fromkeys(self.numbers, 5)
        self.first = dict.fromkeys(self.numbers, 0)
        self.asked: list[list[int]] = []  # the partitions of each ends request
        self.listings = self.earliest_asks = 0
        self.fail = False
        self.omit: set[int] = set()  # partitions the answers leave out

    def listing(self) -> list[int]:
        self.listings += 1
        return list(self.numbers)

    def ends(self, numbers: list[int]) -> dict[int, int]:
        if self.fail:
            raise SourceUnavailableError("no answer")
        self.asked.append(list(numbers))
        return {n: self.end[n] for n in numbers if n not in self.omit}

    def earliest(self, numbers: list[int]) -> dict[int, int]:
        self.earliest_asks += 1
        return {n: self.first[n] for n in numbers}


def test_a_poll_asks_what_moved_and_idle_partitions_in_turn() -> None:
    topic, now = _Topic(10_000), [0.0]
    polls = TopicPolls("t", topic.listing, topic.ends, topic.earliest, clock=lambda: now[0])

    def poll(after: float = 0.1) -> list[Any]:
        now[0] += after
        return polls.poll()

    first = poll()
    assert len(topic.asked[-1]) == 10_000 and [p.end for p in first] == [5] * 10_000  # the first poll asks all
    assert [p.id for p in first[:2]] == ["t-0", "t-1"] and first[3].earliest == first[3].start == 0
    # polls 100 ms apart: a tenth of the idle partitions each, every one of them within IDLE_SECONDS
    topic.asked.clear()
    for _ in range(round(IDLE_SECONDS / 0.1)):
        again = poll()
    assert all(len(a) == 1000 for a in topic.asked)
    assert sorted(n for a in topic.asked for n in a) == topic.numbers
    assert all(a is b for a, b in zip(again, first))  # partitions that did not change are the same objects
    # a record in an idle partition is reported within IDLE_SECONDS (of polls 100 ms apart)
    topic.end[1234] = 6
    waited = 0.0
    while poll()[1234].end != 6:
        waited += 0.1
        assert waited < IDLE_SECONDS, "an idle partition's new end not seen within IDLE_SECONDS"
    # a partition that moved is asked at every poll for MOVED_SECONDS after its last move, then in turn again
    topic.asked.clear()
    for _ in range(round(MOVED_SECONDS / 0.1) - 2):
        poll()
    assert all(1234 in a for a in topic.asked)
    for _ in range(30):
        poll()
    assert sum(1234 in a for a in topic.asked[-20:]) == 2  # twice in its last 2 s: in turn with the idle ones
    # polls IDLE_SECONDS apart ask every partition; the listing and earliest offsets: every 10 s at 10,000
    topic.asked.clear()
    poll(IDLE_SECONDS)
    assert topic.asked == [topic.numbers]
    assert topic.listings == topic.earliest_asks == 2  # in ~15 s of polls: at 0.1 s and 10.1 s


def test_a_small_topic_is_asked_whole_and_a_failed_poll_lists_again() -> None:
    topic, now = _Topic(IDLE_CHUNK), [0.0]
    polls = TopicPolls("t", topic.listing, topic.ends, topic.earliest, listed_per_second=1, clock=lambda: now[0])
    for _ in range(5):
        now[0] += 0.1
        polls.poll()
    assert topic.asked == [topic.numbers] * 5
    topic.fail = True
    now[0] += 0.1
    with pytest.raises(SourceError):
        polls.poll()
    topic.fail, listings = False, topic.listings
    topic.numbers.append(IDLE_CHUNK)  # a partition added meanwhile: never asked, so an answer without it fails
    topic.end[IDLE_CHUNK], topic.first[IDLE_CHUNK] = 3, 1
    topic.omit = {IDLE_CHUNK}
    now[0] += 0.1
    with pytest.raises(SourceError, match=rf"no end offset of 't' partition\(s\) \[{IDLE_CHUNK}\]"):
        polls.poll()
    topic.omit = set()
    now[0] += 0.1
    polled = polls.poll()
    assert topic.listings == listings + 2  # listed again (a deleted topic is told as gone), new partition included
    assert (polled[-1].id, polled[-1].start, polled[-1].end) == (f"t-{IDLE_CHUNK}", 1, 3)


def test_a_kafka_poll_of_a_thousand_idle_partitions_asks_a_request_of_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through ``KafkaSource.poll``, its requests faked: every poll asked every partition's end before."""
    from streamrover.sources import kafka as kafka_module

    topic = _Topic(1000)
    source = kafka_module.KafkaSource("kafka://127.0.0.1:9/t", options={"sr.format": "raw"})
    source._partition_numbers = topic.listing  # type: ignore[method-assign]
    source._consumer_client = lambda: None  # type: ignore[assignment,method-assign,return-value]  # (no broker)

    def watermarks(consumer: Any, name: str, numbers: list[int], which: int, where: str) -> dict[int, int]:
        return topic.ends(numbers) if which == kafka_module.OFFSET_END else topic.earliest(numbers)

    monkeypatch.setattr(kafka_module, "watermarks", watermarks)
    try:
        source.poll()
        assert topic.asked == [topic.numbers]
        topic.asked.clear()
        topic.end[7] = 9
        polled = [source.poll() for _ in range(1000 // IDLE_CHUNK)]  # (polls a few ms apart: a request's worth)
        assert all(len(a) <= IDLE_CHUNK + 1 for a in topic.asked)
        assert sorted(set(n for a in topic.asked for n in a)) == topic.numbers  # each asked within 4 polls
        assert polled[-1][7].end == 9
        polled = source.poll()
        assert 7 in topic.asked[-1] and len(topic.asked[-1]) <= IDLE_CHUNK + 1  # moved: asked at every poll
    finally:
        source.close()
