"""Session-scoped pytest fixtures that start real brokers on 127.0.0.1 (one of each per test session).

Register them for the whole suite in the top-level ``tests/conftest.py``::

    pytest_plugins = ["tests.brokers.fixtures"]

Each fixture starts its broker on first use and stops it when the session ends; the child
processes also die with the test process (atexit, and PR_SET_PDEATHSIG if it is killed). A test
that kills or stops a broker must start it again before it returns (``broker.restart()``, or
``broker.start()`` in a ``finally`` when ``not broker.is_running()``), since later tests share it.
Work directories (data and logs) live under pytest's basetemp,
which pytest keeps for the last three runs: look there for ``kafka.log`` etc. after a failure.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.brokers.kafka import KafkaBroker
from tests.brokers.pulsar import PulsarLiteBroker
from tests.brokers.rocketmq import RocketMQBroker
from tests.brokers.tansu import TansuBroker


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaBroker]:
    """Apache Kafka 4.x, single KRaft node; ``.bootstrap``; ``kill()``/``restart()`` keep the log dir."""
    broker = KafkaBroker(tmp_path_factory.mktemp("kafka"))
    broker.start()
    try:
        yield broker
    finally:
        broker.stop(timeout=20)


@pytest.fixture(scope="session")
def tansu_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TansuBroker]:
    """tansu (Kafka protocol, memory storage); ``.bootstrap``; see tests/brokers/tansu.py for its quirks."""
    broker = TansuBroker(tmp_path_factory.mktemp("tansu"))
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def pulsar_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PulsarLiteBroker]:
    """pulsar-lite with 4 partitions per topic; ``.service_url``; see tests/brokers/pulsar.py for its quirks."""
    broker = PulsarLiteBroker(tmp_path_factory.mktemp("pulsar"), default_partitions=4)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def rocketmq_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RocketMQBroker]:
    """RocketMQ 5.x name server + broker; ``.namesrv_address``, ``.broker_address``, ``create_topic()``."""
    broker = RocketMQBroker(tmp_path_factory.mktemp("rocketmq"))
    broker.start()
    try:
        yield broker
    finally:
        # A graceful stop of the 5.5 broker takes ~11 s (two shutdown hooks); the data is thrown away
        # with basetemp anyway, so end the session fast.
        broker.kill()


__all__ = ["kafka_broker", "pulsar_broker", "rocketmq_broker", "tansu_broker"]
