"""Real brokers for tests: Kafka 4.x (KRaft, Maven jars), tansu, pulsar-lite, RocketMQ 5.x (Maven jars).

Each class starts its broker as child processes bound to 127.0.0.1 on free ports, waits on a real
readiness condition, and offers ``start``/``stop``/``kill``/``restart``. Pytest fixtures are in
``tests.brokers.fixtures``. Jars come from ``scripts/fetch-jars.sh`` (run on demand if missing).
"""

from tests.brokers._process import BrokerError, BrokerStartError, MissingDependencyError
from tests.brokers.kafka import KAFKA_VERSION, KafkaBroker
from tests.brokers.pulsar import PulsarLiteBroker
from tests.brokers.rocketmq import ROCKETMQ_VERSION, RocketMQBroker
from tests.brokers.tansu import TansuBroker

__all__ = [
    "KAFKA_VERSION",
    "ROCKETMQ_VERSION",
    "BrokerError",
    "BrokerStartError",
    "KafkaBroker",
    "MissingDependencyError",
    "PulsarLiteBroker",
    "RocketMQBroker",
    "TansuBroker",
]
