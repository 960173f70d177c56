"""The three brokers as the model-state ledger runs see them: a fresh topic, a producer, a restart.

Each :class:`BrokerTopic` makes a topic of :data:`PARTITIONS` partitions on a running broker fixture,
produces ``{id, x, y}`` records (tests/trainers/cluster.py's ``records_table``, as JSON) and
restarts the broker with a SIGKILL: Kafka's single KRaft node (broker and its metadata quorum
in one process), pulsar-lite (broker and its metadata in one process), and RocketMQ's broker
alone or together with its name server.

Producers send each record once and wait until the broker accepted it. Only Kafka's producer is
idempotent: a Pulsar or RocketMQ send retried across a broker restart can store a record twice,
which a ledger would count as a double apply that the trainer did not do. So the runs let a
broker restart happen only after every record was produced (tests/trainers/test_stream_ledger.py
joins the producer first): the records still arrive while the job trains, before the restart.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import numpy as np

from streamrover.sources.rocketmq import librocketmq
from tests.trainers.cluster import records_table

PARTITIONS = 4
SCHEMA = "id:int64,x:float64,y:float64"


def bodies(ids: np.ndarray) -> list[bytes]:
    table = records_table(ids)
    return [
        json.dumps({"id": i, "x": x, "y": y}).encode()
        for i, x, y in zip(table["id"].tolist(), table["x"].tolist(), table["y"].tolist())
    ]


class BrokerTopic:
    """A topic on one broker fixture: ``uri`` for the master, ``produce(ids)``, ``restarts`` by name."""

    uri: str

    def produce(self, ids: np.ndarray) -> None:
        """Send one record per id; returns once the broker accepted them all."""
        raise NotImplementedError

    def restarts(self) -> dict[str, Any]:
        """Broker faults by name: each SIGKILLs broker processes and starts them again (same ports, same data)."""
        raise NotImplementedError

    def ensure_running(self) -> None:
        """Start whatever a failed test left stopped: later tests share the broker."""
        raise NotImplementedError


class KafkaTopic(BrokerTopic):
    def __init__(self, broker: Any) -> None:
        from confluent_kafka.admin import AdminClient, NewTopic

        self.broker = broker
        self.topic = f"ledger-{uuid.uuid4().hex[:8]}"
        admin = AdminClient({"bootstrap.servers": broker.bootstrap})
        for f in admin.create_topics([NewTopic(self.topic, PARTITIONS, 1)]).values():
            f.result(30)
        self.uri = f"kafka://{broker.bootstrap}/{self.topic}"

    def produce(self, ids: np.ndarray) -> None:
        from confluent_kafka import Producer

        # Idempotent: a send retried across a broker restart is stored once.
        producer = Producer(self.broker.client_config(**{"acks": "all", "enable.idempotence": True, "linger.ms": 20}))
        for n, (i, body) in enumerate(zip(ids.tolist(), bodies(ids))):
            producer.produce(self.topic, value=body, partition=i % PARTITIONS)
            if n % 2000 == 0:
                producer.poll(0)
        assert producer.flush(120) == 0, "Kafka did not take every record"

    def restarts(self) -> dict[str, Any]:
        def restart() -> None:
            self.broker.kill()
            self.broker.start()

        return {"SIGKILL + restart Kafka (broker and KRaft controller)": restart}

    def ensure_running(self) -> None:
        if not self.broker.is_running():
            self.broker.start()


class PulsarTopic(BrokerTopic):
    def __init__(self, broker: Any) -> None:
        self.broker = broker
        self.topic = f"ledger-{uuid.uuid4().hex[:8]}"
        self.uri = f"{broker.service_url}/{self.topic}"

    def produce(self, ids: np.ndarray) -> None:
        import logging

        import pulsar

        client = pulsar.Client(self.broker.service_url, operation_timeout_seconds=30,
                               logger=logging.getLogger("tests.pulsar-client"))  # fmt: skip
        failed: list[str] = []

        def sent(result: Any, _msg_id: Any) -> None:
            if result != pulsar.Result.Ok:
                failed.append(str(result))

        try:  # non-batched: pulsar-lite does not persist acks of batched messages; round robin over partitions
            producer = client.create_producer(f"persistent://public/default/{self.topic}", batching_enabled=False,
                                              block_if_queue_full=True)  # fmt: skip
            for body in bodies(ids):
                producer.send_async(body, sent)
            producer.flush()
            producer.close()
        finally:
            client.close()
        assert not failed, f"{len(failed)} Pulsar sends failed: {failed[:3]}"

    def restarts(self) -> dict[str, Any]:
        def restart() -> None:
            self.broker.kill()
            self.broker.start()

        return {"SIGKILL + restart pulsar-lite (broker and its metadata)": restart}

    def ensure_running(self) -> None:
        if not self.broker.is_running():
            self.broker.start()


class RocketMQTopic(BrokerTopic):
    def __init__(self, broker: Any) -> None:
        self.broker = broker
        self.topic = f"ledger-{uuid.uuid4().hex[:8]}"
        broker.create_topic(self.topic, PARTITIONS)
        self.uri = f"rocketmq://{broker.namesrv_address}/{self.topic}"

    def produce(self, ids: np.ndarray) -> None:
        librocketmq()  # first: the library deep-bound (TensorFlow may be loaded in this process)
        from rocketmq.client import Message, Producer
        from rocketmq.ffi import dll

        producer = Producer(f"ledger-producer-{uuid.uuid4().hex[:8]}", timeout=10_000)
        producer.set_namesrv_addr(self.broker.namesrv_address)
        producer.start()
        try:
            for body in bodies(ids):
                msg = Message(self.topic)
                dll.SetByteMessageBody(msg._handle, body, len(body))
                producer.send_sync(msg)
        finally:
            producer.shutdown()

    def restarts(self) -> dict[str, Any]:
        def broker_alone() -> None:
            self.broker.kill_broker()
            self.broker.start()  # the name server kept running: only the broker starts

        def with_name_server() -> None:
            self.broker.kill()
            self.broker.start()

        return {
            "SIGKILL + restart the RocketMQ broker (name server up)": broker_alone,
            "SIGKILL + restart the RocketMQ broker and its name server": with_name_server,
        }

    def ensure_running(self) -> None:
        if not self.broker.is_running():
            self.broker.kill()
            self.broker.start()
