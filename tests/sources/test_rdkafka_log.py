"""librdkafka's "Connection refused" no longer floods a worker's log while a broker is down: repeats are
rate-limited (streamrover.sources.kafka_client.RepeatFilter), and the line that passes counts the rest."""

from __future__ import annotations

import logging
import time

import pytest
from confluent_kafka import Consumer

from streamrover.sources.kafka_client import RDKAFKA_LOG, RepeatFilter, with_logger
from tests.brokers._process import free_port


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_down_broker_logs_a_few_lines_not_one_per_reconnect(caplog: pytest.LogCaptureFixture) -> None:
    lines = _Lines()
    seen = _Lines()  # every line librdkafka gave, before the filter
    RDKAFKA_LOG.addHandler(lines)
    unfiltered = logging.getLogger("test.rdkafka.unfiltered")
    unfiltered.addHandler(seen)
    unfiltered.setLevel(logging.DEBUG)
    port = free_port()  # nothing listens: every connect is refused
    conf = {"bootstrap.servers": f"127.0.0.1:{port}", "group.id": "g", "reconnect.backoff.ms": 20,
            "reconnect.backoff.max.ms": 50}  # fmt: skip
    filtered, raw = Consumer(with_logger(conf)), Consumer({**conf, "logger": unfiltered})
    try:
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            filtered.poll(0.1)
            raw.poll(0.1)
    finally:
        filtered.close()
        raw.close()
        RDKAFKA_LOG.removeHandler(lines)
    refused = [x for x in seen.lines if "refused" in x]
    assert len(refused) >= 10, f"librdkafka said too little to test with: {seen.lines[:5]}"
    assert 1 <= len([x for x in lines.lines if "refused" in x]) <= 2, lines.lines


def test_the_filter_counts_what_it_suppressed() -> None:
    now = [0.0]
    f = RepeatFilter(every=30, clock=lambda: now[0])
    rec = lambda n: logging.LogRecord("x", logging.ERROR, "", 0, f"connect failed after {n}ms", None, None)  # noqa: E731
    assert f.filter(rec(1)) and not f.filter(rec(2)) and not f.filter(rec(3))
    now[0] = 31.0
    later = rec(4)
    assert f.filter(later) and "(2 like it suppressed" in later.getMessage()
