"""Smoke tests: each fixture's broker works with its real Python client, records read back exactly.

Kafka also survives a SIGKILL with its data; every broker listens on 127.0.0.1 only.
"""

from __future__ import annotations

import ctypes
import time
import uuid
from collections import Counter

import pytest

from streamrover.sources.rocketmq import librocketmq
from tests.brokers.kafka import KafkaBroker
from tests.brokers.pulsar import PulsarLiteBroker
from tests.brokers.rocketmq import RocketMQBroker
from tests.brokers.tansu import TansuBroker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

N = 2000
PARTITIONS = 4
LOOPBACK_ADDRS = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


def _topic(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _listening_addresses(pids: list[int | None]) -> set[tuple[str, int]]:
    psutil = pytest.importorskip("psutil")
    out: set[tuple[str, int]] = set()
    for pid in pids:
        assert pid is not None
        proc = psutil.Process(pid)
        for p in [proc, *proc.children(recursive=True)]:
            connections = getattr(p, "net_connections", None) or p.connections  # psutil < 6 names it connections
            for c in connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    out.add((c.laddr.ip, c.laddr.port))
    return out


# --------------------------------------------------------------------------- Kafka protocol


def _kafka_create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])
    futures[topic].result(30)


def _kafka_produce(config: dict[str, object], topic: str, n: int) -> None:
    from confluent_kafka import Producer

    errors: list[object] = []
    producer = Producer({**config, "acks": "all", "enable.idempotence": True})
    for i in range(n):
        producer.produce(topic, key=str(i).encode(), value=f"record-{i}".encode(),
                         on_delivery=lambda err, _msg: errors.append(err) if err else None)
        producer.poll(0)
    assert producer.flush(30) == 0, "records still undelivered after 30 s"
    assert not errors, errors[:5]


def _watermarks(consumer: object, tp: object, timeout: float = 30.0) -> tuple[int, int]:
    """The partition's watermarks, retrying what the client calls retriable (a leader still loading after a restart)."""
    from confluent_kafka import KafkaError, KafkaException

    transient = {KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE, KafkaError._TRANSPORT,
                 KafkaError._TIMED_OUT, KafkaError.UNKNOWN_TOPIC_OR_PART}
    deadline = time.monotonic() + timeout
    while True:
        try:
            low, high = consumer.get_watermark_offsets(tp, timeout=10)  # type: ignore[attr-defined]
            return int(low), int(high)
        except KafkaException as exc:
            err = exc.args[0]
            if not (err.retriable() or err.code() in transient) or time.monotonic() > deadline:
                raise
            time.sleep(0.2)  # backoff between retries, not synchronisation


def _kafka_read_all(bootstrap: str, topic: str, partitions: int) -> dict[int, list[bytes]]:
    """Read every partition from its low to its high watermark, assigned at explicit offsets (no consumer group).

    The start offsets go into ``assign``: a ``seek`` right after ``assign`` fails with _STATE
    ("Erroneous state") until the partition's fetcher has started.
    """
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "smoke-unused", "enable.auto.commit": False,
                         "fetch.wait.max.ms": 100})
    try:
        bounds = {p: _watermarks(consumer, TopicPartition(topic, p)) for p in range(partitions)}
        consumer.assign([TopicPartition(topic, p, low) for p, (low, _) in bounds.items()])
        position = {p: low for p, (low, _) in bounds.items()}
        by_partition: dict[int, list[bytes]] = {p: [] for p in range(partitions)}
        deadline = time.monotonic() + 30
        while any(position[p] < bounds[p][1] for p in bounds):
            assert time.monotonic() < deadline, f"stuck at {position}, watermarks {bounds}"
            for msg in consumer.consume(1000, 0.5):
                assert msg.error() is None, msg.error()
                p, offset, value = msg.partition(), msg.offset(), msg.value()
                assert p is not None and offset is not None and value is not None
                if offset < bounds[p][1]:
                    by_partition[p].append(value)
                position[p] = max(position[p], offset + 1)
    finally:
        consumer.close()
    return by_partition


def _assert_exact(by_partition: dict[int, list[bytes]], n: int) -> None:
    values = [v for vs in by_partition.values() for v in vs]
    counts = Counter(values)
    assert len(values) == n, f"read {len(values)} records, produced {n}"
    assert set(counts) == {f"record-{i}".encode() for i in range(n)}
    assert max(counts.values()) == 1
    assert sum(1 for vs in by_partition.values() if vs) > 1, "all records landed in one partition"


def test_kafka_produce_read_and_survive_sigkill(kafka_broker: KafkaBroker) -> None:
    pytest.importorskip("confluent_kafka")
    topic = _topic("smoke-kafka")
    _kafka_create_topic(kafka_broker.bootstrap, topic, PARTITIONS)
    _kafka_produce(kafka_broker.client_config(), topic, N)
    before = _kafka_read_all(kafka_broker.bootstrap, topic, PARTITIONS)
    _assert_exact(before, N)

    kafka_broker.kill()
    assert not kafka_broker.is_running()
    kafka_broker.start()  # same ports, same log dir

    after = _kafka_read_all(kafka_broker.bootstrap, topic, PARTITIONS)
    assert after == before, "records changed across SIGKILL + restart"
    _kafka_produce(kafka_broker.client_config(), topic, 10)  # and it takes writes again


def test_tansu_produce_and_read(tansu_broker: TansuBroker) -> None:
    pytest.importorskip("confluent_kafka")
    topic = _topic("smoke-tansu")
    _kafka_create_topic(tansu_broker.bootstrap, topic, PARTITIONS)
    # One record per batch: tansu's high watermark is only exact that way (module docstring).
    _kafka_produce(tansu_broker.producer_config(), topic, N)
    _assert_exact(_kafka_read_all(tansu_broker.bootstrap, topic, PARTITIONS), N)


# --------------------------------------------------------------------------- Pulsar


def _pulsar_read_all(client: object, topic: str, n: int) -> dict[str, list[bytes]]:
    """A reader over the whole partitioned topic from earliest; deduplicated by (partition, message id)."""
    import pulsar

    reader = client.create_reader(topic, pulsar.MessageId.earliest)  # type: ignore[attr-defined]
    seen: dict[tuple[str, str], bytes] = {}
    deadline = time.monotonic() + 30
    try:
        while len(seen) < n and time.monotonic() < deadline:
            try:
                msg = reader.read_next(1000)
            except pulsar.Timeout:
                continue
            seen[(msg.topic_name(), str(msg.message_id()))] = msg.data()
    finally:
        reader.close()
    by_partition: dict[str, list[bytes]] = {}
    for (partition, _), value in seen.items():
        by_partition.setdefault(partition, []).append(value)
    return by_partition


def test_pulsar_lite_produce_read_and_survive_sigkill(pulsar_broker: PulsarLiteBroker) -> None:
    pulsar = pytest.importorskip("pulsar")
    topic = f"persistent://public/default/{_topic('smoke-pulsar')}"
    client = pulsar.Client(pulsar_broker.service_url, operation_timeout_seconds=10,
                           logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Warn))
    try:
        producer = client.create_producer(topic, batching_enabled=False)  # batched acks are not persisted
        for i in range(N):
            producer.send_async(f"record-{i}".encode(), None)
        producer.flush()
        producer.close()
        assert len(client.get_topic_partitions(topic)) == PARTITIONS
        before = _pulsar_read_all(client, topic, N)
    finally:
        client.close()
    _assert_exact({i: v for i, v in enumerate(before.values())}, N)

    pulsar_broker.kill()
    pulsar_broker.start()
    client = pulsar.Client(pulsar_broker.service_url, operation_timeout_seconds=10,
                           logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Warn))
    try:
        after = _pulsar_read_all(client, topic, N)
    finally:
        client.close()
    assert {k: sorted(v) for k, v in after.items()} == {k: sorted(v) for k, v in before.items()}


# --------------------------------------------------------------------------- RocketMQ


def _rocketmq_pull_all(namesrv: str, topic: str) -> dict[int, list[tuple[int, bytes]]]:
    """Pull every queue of ``topic`` from offset 0 with the 4.x remoting client (package ``rocketmq`` 0.4.4).

    Its ``PullConsumer.pull`` keeps offsets in a class-level dict shared by all instances, so this
    drives the library's ``Pull(mq, expression, offset, max)`` call directly: pull by explicit offset.
    """
    librocketmq()  # first: the library deep-bound (TensorFlow may be loaded in this process)
    from rocketmq.client import PullConsumer, RecvMessage
    from rocketmq.exceptions import ffi_check
    from rocketmq.ffi import _CMessageQueue, _CPullStatus, dll

    consumer = PullConsumer(f"smoke-reader-{uuid.uuid4().hex[:8]}")
    consumer.set_namesrv_addr(namesrv)
    consumer.start()
    queues = ctypes.POINTER(_CMessageQueue)()
    count = ctypes.c_int()
    out: dict[int, list[tuple[int, bytes]]] = {}
    try:
        ffi_check(dll.FetchSubscriptionMessageQueues(consumer._handle, topic.encode(), ctypes.pointer(queues),
                                                     ctypes.pointer(count)))
        for i in range(count.value):
            mq = queues[i]
            offset, records = 0, []
            while True:
                result = dll.Pull(consumer._handle, ctypes.pointer(mq), b"*", offset, 32)
                status, next_offset = result.pullStatus, result.nextBeginOffset
                if status == _CPullStatus.FOUND:
                    for j in range(result.size):
                        msg = RecvMessage(result.msgFoundList[j])
                        records.append((msg.queue_offset, msg.body))
                dll.ReleasePullResult(result)
                if status != _CPullStatus.FOUND:
                    assert status == _CPullStatus.NO_NEW_MSG, f"queue {mq.queueId}: pull status {status}"
                    break
                offset = next_offset
            out[int(mq.queueId)] = records
        ffi_check(dll.ReleaseSubscriptionMessageQueue(queues))
    finally:
        consumer.shutdown()
    return out


def test_rocketmq_produce_and_pull_by_offset(rocketmq_broker: RocketMQBroker) -> None:
    pytest.importorskip("rocketmq", reason="rocketmq 0.4.4 (4.x remoting client) is not installed")
    librocketmq()  # first: the library deep-bound (TensorFlow may be loaded in this process)
    from rocketmq.client import Message, Producer

    n = 500
    topic = _topic("smoke-rocketmq")
    rocketmq_broker.create_topic(topic, PARTITIONS)

    producer = Producer(f"smoke-producer-{uuid.uuid4().hex[:8]}")
    producer.set_namesrv_addr(rocketmq_broker.namesrv_address)
    producer.start()
    try:
        for i in range(n):
            msg = Message(topic)
            msg.set_body(f"record-{i}".encode())
            producer.send_sync(msg)
    finally:
        producer.shutdown()

    queues = _rocketmq_pull_all(rocketmq_broker.namesrv_address, topic)
    assert sorted(queues) == list(range(PARTITIONS))
    for qid, records in queues.items():
        assert [off for off, _ in records] == list(range(len(records))), f"queue {qid}: offsets not dense from 0"
    _assert_exact({q: [body for _, body in r] for q, r in queues.items()}, n)


# --------------------------------------------------------------------------- all


def test_brokers_listen_on_loopback_only(kafka_broker: KafkaBroker, tansu_broker: TansuBroker,
                                         pulsar_broker: PulsarLiteBroker, rocketmq_broker: RocketMQBroker) -> None:
    listening = {
        "kafka": _listening_addresses([kafka_broker.pid]),
        "tansu": _listening_addresses([tansu_broker.pid]),
        "pulsar-lite": _listening_addresses([pulsar_broker.pid]),
        "rocketmq": _listening_addresses(list(rocketmq_broker.pids)),
    }
    for name, addrs in listening.items():
        assert addrs, f"{name}: no listening socket found"
        outside = {a for a in addrs if a[0] not in LOOPBACK_ADDRS}
        assert not outside, f"{name} listens beyond loopback: {outside}"
    ports = {p for _, p in listening["rocketmq"]}
    assert {rocketmq_broker.namesrv_port, rocketmq_broker.broker_port} <= ports
