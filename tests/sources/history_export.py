"""A Kafka-Connect-style export of a topic's first records, for the history-then-live tests.

Like the S3/HDFS sinks: one directory per partition, files named ``<topic>+<partition>+<first offset>.parquet``,
the record's fields as columns plus ``offset`` and ``partition`` (the InsertField transform's).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq


def create_topic(broker: Any, partitions: int) -> str:
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = f"h-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    for f in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        f.result(30)
    return topic


def produce(broker: Any, topic: str, ids: range | dict[int, int], partitions: int) -> None:
    """Records ``{"id": i}`` to partition ``i % partitions``, in order; ``ids`` a dict: id -> timestamp (ms)."""
    from confluent_kafka import Producer

    producer = Producer(broker.client_config(**{"acks": "all", "enable.idempotence": True}))
    for i in ids:
        value = json.dumps({"id": i}).encode()
        if isinstance(ids, dict):
            producer.produce(topic, value=value, partition=i % partitions, timestamp=ids[i])
        else:
            producer.produce(topic, value=value, partition=i % partitions)
        if i % 1000 == 0:
            producer.poll(0)
    assert producer.flush(60) == 0


def read_topic(broker: Any, topic: str, partition: int, upto: int) -> list[tuple[int, int, int]]:
    """(offset, id, timestamp) of the records at offsets below ``upto`` of one partition."""
    from confluent_kafka import Consumer, TopicPartition

    group = f"export-{uuid.uuid4().hex[:6]}"
    consumer = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": group, "enable.auto.commit": False})
    out: list[tuple[int, int, int]] = []
    try:
        consumer.assign([TopicPartition(topic, partition, 0)])
        while len(out) < upto:
            for msg in consumer.consume(min(500, upto - len(out)), timeout=5):
                offset, value = msg.offset(), msg.value()
                if msg.error() is None and offset is not None and value is not None and offset < upto:
                    out.append((offset, int(json.loads(value)["id"]), msg.timestamp()[1]))
    finally:
        consumer.close()
    return out


def export(
    broker: Any, topic: str, root: Path, upto: dict[int, int], per_file: int, row_group: int = 100
) -> dict[int, list[tuple[int, int, int]]]:
    """Export offsets ``[0, upto[p])`` of each partition ``p`` as Kafka Connect would; returns what was exported."""
    exported = {}
    for p, end in upto.items():
        rows = read_topic(broker, topic, p, end)
        exported[p] = rows
        folder = root / "topics" / topic / f"partition={p}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(0, len(rows), per_file):
            chunk = rows[i : i + per_file]
            write_piece(folder / f"{topic}+{p}+{chunk[0][0]:010d}.parquet", p, chunk, row_group)
    return exported


def write_piece(path: Path, partition: int, rows: list[tuple[int, int, int]], row_group: int = 100) -> None:
    table = pa.table(
        {
            "id": pa.array([r[1] for r in rows], pa.int64()),
            "timestamp": pa.array([r[2] for r in rows], pa.int64()),
            "offset": pa.array([r[0] for r in rows], pa.int64()),
            "partition": pa.array([partition] * len(rows), pa.int32()),
        }
    )
    pq.write_table(table, path, row_group_size=row_group)
