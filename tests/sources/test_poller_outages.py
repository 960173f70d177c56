"""The master's stream poller through broker outages and clients that wedge, against real Apache Kafka (KRaft).

- The broker SIGKILLed for long enough that the poller fails polls in a row and reopens its source,
  then restarted on the same port and log dir: new records are planned and leased again.
- A client whose calls never answer (a librdkafka request left unresolved, a handle's destroy that
  waits on it) is abandoned after ``sr.source_timeout_ms``, and status says what the poller waits on.
- A client that keeps failing is reopened after a few failed polls; a list-offsets answer that never
  comes is a source error, not a blocked poll.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from streamrover.shard_service import DatasetSpec, ShardClient
from streamrover.shard_service.master import MasterServer
from streamrover.sources.api import Partition, register_source
from tests.helpers import wait_until
from tests.sources.test_stream_failures import _create_topic, _produce

pytestmark = pytest.mark.slow


def _planned(admin: ShardClient) -> int:
    return int(admin.describe_dataset("s").total_records)


@contextmanager
def _stream_master(
    tmp_path: Path, kafka_broker: Any, scheme: str, options: dict[str, str], records_per_shard: int
) -> Iterator[tuple[MasterServer, ShardClient, str]]:
    """A master with stream dataset "s" of a new one-partition topic (``scheme``), its first 100 records planned."""
    topic = _create_topic(kafka_broker, 1)
    _produce(kafka_broker, topic, range(100), 1)
    master = MasterServer(tmp_path / "state", "token")
    try:
        with ShardClient(master.address, token="token", heartbeat=False, timeout=30) as admin:
            uri = f"{scheme}://{kafka_broker.bootstrap}/{topic}"
            admin.register_dataset(DatasetSpec("s", uri, options=options, records_per_shard=records_per_shard))
            wait_until(lambda: _planned(admin) == 100, 60, "the first records planned")
            yield master, admin, topic
    finally:
        master.stop()


def test_planning_resumes_after_the_broker_is_killed_long_enough_to_reopen_the_source(
    tmp_path: Path, kafka_broker: Any
) -> None:
    """SIGKILL the broker, wait for failed polls and the poller's reopen of its source (status says both), restart
    the broker on the same port and log dir: records produced after the restart are planned and leased."""
    options = {"sr.poll_interval_ms": "50", "sr.max_delay_ms": "0"}
    with _stream_master(tmp_path, kafka_broker, "kafka", options, 1000) as (master, admin, topic):
        kafka_broker.kill()
        try:
            wait_until(lambda: "reopened" in admin.describe_dataset("s").error, 90,
                       "status to show failed polls and the source reopened")  # fmt: skip
        finally:
            kafka_broker.start()  # also when the check failed: the broker is shared with later tests
        _produce(kafka_broker, topic, range(100, 200), 1)
        wait_until(lambda: _planned(admin) == 200, 60, "records produced after the restart planned")
        with ShardClient(master.address, token="token", heartbeat=True, timeout=30) as worker:
            spans: list[tuple[int, int]] = []
            while sum(b - a for a, b in spans) < 200:
                _, leased = worker.lease("s", max_shards=10, wait=10)
                assert leased, f"no shard leased after {spans}"
                spans += [(s.lease.start, s.lease.end) for s in leased]
            spans.sort()  # one shard of the first 100 records, then what was produced after the restart
            assert spans[0] == (0, 100) and spans[-1][1] == 200, spans
            assert all(a == b for (_, a), (b, _) in pairwise(spans)), spans
        wait_until(lambda: admin.describe_dataset("s").error == "", 60, "the outage cleared from status")


class _StuckKafka:
    """A Kafka source whose client stops answering: once ``stick`` is set, the instance polled next blocks in that
    poll, and in its close, until ``release`` is set (a librdkafka answer that never comes, a destroy that waits on
    it); instances opened later work."""

    stick = False
    stuck: object = None
    release = threading.Event()

    def __new__(cls, uri: str, format: str = "", options: dict[str, str] | None = None) -> Any:
        from streamrover.sources.kafka import KafkaSource

        source = KafkaSource(uri.replace("stuck-kafka://", "kafka://", 1), format, options)
        real_poll, real_close = source.poll, source.close

        def poll() -> list[Partition]:
            if cls.stick and cls.stuck is None:
                cls.stuck = source
            if cls.stuck is source:
                cls.release.wait()
            return real_poll()

        def close() -> None:
            if cls.stuck is source:
                cls.release.wait()
            real_close()

        source.poll = poll  # type: ignore[method-assign]
        source.close = close  # type: ignore[method-assign]
        return source


def test_a_source_call_that_never_answers_is_abandoned_and_status_says_what_the_poller_waits_on(
    tmp_path: Path, kafka_broker: Any
) -> None:
    register_source(_StuckKafka, schemes=("stuck-kafka",))
    options = {"sr.poll_interval_ms": "50", "sr.max_delay_ms": "0", "sr.source_timeout_ms": "8000"}
    try:
        with _stream_master(tmp_path, kafka_broker, "stuck-kafka", options, 1000) as (_, admin, topic):
            try:
                _StuckKafka.stick = True
                wait_until(lambda: "polling the end positions: waiting" in admin.describe_dataset("s").error, 60,
                           "status to show what the poller waits on")  # fmt: skip
                _produce(kafka_broker, topic, range(100, 200), 1)
                wait_until(lambda: _planned(admin) == 200, 60,
                           "records produced while the old client is stuck planned")  # fmt: skip
                wait_until(lambda: admin.describe_dataset("s").error == "", 60, "the error to clear")
                assert not admin.describe_dataset("s").failed
            finally:
                _StuckKafka.release.set()  # the stuck calls return before the master stops
    finally:
        _StuckKafka.stick, _StuckKafka.stuck = False, None


class _WedgedKafka:
    """A Kafka source whose client wedges: once ``wedge`` is set, the instance polled next fails every poll from
    then on (librdkafka's "Broker transport failure" that a client kept after a bad minute of its broker, seen
    in a loaded run for 5+ minutes while fresh clients worked); instances opened later work."""

    wedge = False
    wedged: object = None
    opened = 0

    def __new__(cls, uri: str, format: str = "", options: dict[str, str] | None = None) -> Any:
        from streamrover.sources.api import SourceUnavailableError
        from streamrover.sources.kafka import KafkaSource

        source = KafkaSource(uri.replace("wedged-kafka://", "kafka://", 1), format, options)
        cls.opened += 1
        real_poll = source.poll

        def poll() -> list[Partition]:
            if cls.wedge and cls.wedged is None:
                cls.wedged = source
            if cls.wedged is source:
                raise SourceUnavailableError("Failed to get metadata: Local: Broker transport failure")
            return real_poll()

        source.poll = poll  # type: ignore[method-assign]
        return source


class _Unanswered:
    """An AdminClient whose list-offsets futures never resolve (what held a master's poller for good after its
    Kafka broker was fenced and came back under load: the stream stopped being planned, with nothing logged)."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def list_offsets(self, request: dict[Any, Any], **_: Any) -> dict[Any, Any]:
        import concurrent.futures

        return {tp: concurrent.futures.Future() for tp in request}


def test_a_list_offsets_answer_that_never_comes_is_a_source_error(kafka_broker: Any, monkeypatch: Any) -> None:
    """The master source's poll is bounded even when librdkafka never answers: it fails as
    ``SourceUnavailableError`` (the poller reports it, retries and reopens) instead of blocking its caller."""
    import threading

    from streamrover.sources import kafka as kafka_module
    from streamrover.sources import kafka_client
    from streamrover.sources.api import SourceUnavailableError

    topic = _create_topic(kafka_broker, 1)
    source = kafka_module.KafkaSource(f"kafka://{kafka_broker.bootstrap}/{topic}", "raw", {})
    monkeypatch.setattr(kafka_module, "REQUEST_TIMEOUT", 0.5)
    monkeypatch.setattr(kafka_client, "REQUEST_TIMEOUT", 0.5)
    # The dataset's first look (partitions: the admin's list_offsets) and every poll after it (the consumer's
    # ListOffsets requests in chunks, kafka_client.watermarks) each get no answer.
    admin = source._admin = _Unanswered(source._admin_client())  # type: ignore[assignment]
    consumer = source._consumer = _UnansweredConsumer(source._consumer_client())  # type: ignore[assignment]
    try:
        for call in (source.partitions, source.poll):
            raised: list[BaseException] = []

            def run(call: Any = call, raised: list[BaseException] = raised) -> None:
                try:
                    call()
                except BaseException as exc:  # what the call raised is the test's subject
                    raised.append(exc)

            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            thread.join(60)
            assert not thread.is_alive(), f"{call.__name__} still blocked on a list-offsets answer after 60 s"
            assert len(raised) == 1 and isinstance(raised[0], SourceUnavailableError), raised
        assert "no answer in" in str(raised[0]) or "Timed out" in str(raised[0]), raised[0]
        assert consumer.timeouts and all(t == 0.5 for t in consumer.timeouts), consumer.timeouts
    finally:
        source._admin, source._consumer = admin.real, consumer.real  # closed by close()
        source.close()


def test_a_poller_whose_source_keeps_failing_reopens_it(tmp_path: Path, kafka_broker: Any) -> None:
    """After a few failed polls in a row the master's poller closes its source and opens a fresh one: a client
    that wedged must not stall the stream (no planning, no lag: the autoscaler then scaled the job in)."""
    register_source(_WedgedKafka, schemes=("wedged-kafka",))
    try:
        with _stream_master(tmp_path, kafka_broker, "wedged-kafka", {"sr.poll_interval_ms": "50"}, 10) as (
            _, admin, topic,
        ):  # fmt: skip
            _WedgedKafka.wedge = True
            wait_until(lambda: "Broker transport failure" in admin.describe_dataset("s").error, 60, "the wedge")
            _produce(kafka_broker, topic, range(100, 200), 1)
            wait_until(lambda: admin.describe_dataset("s").total_records == 200, 60, "records after the wedge planned")
            wait_until(lambda: admin.describe_dataset("s").error == "", 60, "the error to clear")
            assert not admin.describe_dataset("s").failed
    finally:
        _WedgedKafka.wedge, _WedgedKafka.wedged = False, None


class _UnansweredConsumer:
    """A Consumer whose offsets_for_times gets no answer: it waits out the timeout it is given and fails as
    librdkafka does then (_TIMED_OUT); ``timeouts`` keeps what each call was given (an unbounded call would block)."""

    def __init__(self, real: Any) -> None:
        self.real, self.timeouts = real, list[float]()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def offsets_for_times(self, partitions: list[Any], timeout: float = -1) -> list[Any]:
        from confluent_kafka import KafkaError, KafkaException

        self.timeouts.append(timeout)
        if timeout < 0:
            threading.Event().wait()  # librdkafka's default: wait for good
        threading.Event().wait(timeout)
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "Local: Timed out"))


class _NoOffsetConsumer(_UnansweredConsumer):
    """A Consumer whose ListOffsets answers carry no offset (-1001) for partition 0."""

    def offsets_for_times(self, partitions: list[Any], timeout: float = -1) -> list[Any]:
        from confluent_kafka import TopicPartition

        answered = self.real.offsets_for_times(partitions, timeout)
        return [TopicPartition(tp.topic, tp.partition, -1001 if tp.partition == 0 else tp.offset) for tp in answered]


class _NoOffset(_Unanswered):
    """An AdminClient whose list-offsets answers carry no offset (-1001), as a Kafka broker stopped (SIGSTOP) and
    resumed answered once: the poller took it as an end, reported "the end of ... went back from 311 to -1001"."""

    def list_offsets(self, request: dict[Any, Any], **_: Any) -> dict[Any, Any]:
        import concurrent.futures
        from types import SimpleNamespace

        answers = {}
        for tp in request:
            answers[tp] = concurrent.futures.Future()
            answers[tp].set_result(SimpleNamespace(offset=-1001))
        return answers


def test_a_list_offsets_answer_without_an_offset_is_a_source_error(kafka_broker: Any) -> None:
    from streamrover.sources.api import SourceUnavailableError
    from streamrover.sources.kafka import KafkaSource

    topic = _create_topic(kafka_broker, 2)
    source = KafkaSource(f"kafka://{kafka_broker.bootstrap}/{topic}", "raw", {})
    admin = source._admin = _NoOffset(source._admin_client())  # type: ignore[assignment]
    consumer = source._consumer = _NoOffsetConsumer(source._consumer_client())  # type: ignore[assignment]
    try:
        with pytest.raises(SourceUnavailableError, match=r"no offset in the answer for partition\(s\) 0 \(-1001\), 1"):
            source.partitions()
        with pytest.raises(SourceUnavailableError, match=r"partition 0: no offset in the answer \(-1001\)"):
            source.poll()
    finally:
        source._admin, source._consumer = admin.real, consumer.real  # closed by close()
        source.close()
