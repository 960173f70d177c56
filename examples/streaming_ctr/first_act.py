"""The demo's first act: the model learns the topic's past from its Parquet export, then goes live, one job.

A CTR team does not start a model from nothing: it trains on the logs in its lake, then keeps the model fresh
on the topic. Here the past is the click stream's first ``history`` records:

1. :func:`prepare` writes them to the topic (unpaced) and exports them as Kafka Connect's S3/HDFS sinks do:
   ``lake/topics/T/partition=P/T+P+<first offset>.parquet``, the record's fields plus the ``offset`` and
   ``partition`` columns (the InsertField transform's);
2. :func:`configure` names that export in the job's dataset (``sr.history``): the master plans the files'
   offsets first and nothing live until every one of them is acked, then the topic from each partition's
   boundary (the export's highest offset + 1) on; one cursor of offsets spans both (sources/history.py);
3. the demo starts the live producer at the seam (the history acked), from record ``history`` on; the trainer
   counts freshness for live records only (``--live-from``: the past's event times are old);
4. :meth:`Seam.describe` gives the report's rows: the export, each partition's boundary, how long the backfill
   took, and whether the records on both sides of the seam are each in the model once.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from examples.streaming_ctr.clickstream import SCHEMA, ClickStream
from examples.streaming_ctr.produce import produce

PER_FILE, ROW_GROUP = 5_000, 2_000  # records per exported file and per row group
AROUND = 2_000  # records on each side of the seam whose ledger entries the report checks


@dataclass
class Seam:
    """The first act: the export and the boundary of each partition (its first live offset)."""

    history: int
    lake: Path
    files: int
    boundary: dict[int, int]
    exported_s: float
    notes: dict[str, Any] = field(default_factory=dict)

    def describe(self, ledger: np.ndarray, samples: list[dict[str, Any]]) -> list[tuple[str, str]]:
        """The report's rows: ``ledger`` (per id, how many times it is in the model) and the demo's samples."""
        bounds = ", ".join(f"p{p}: {b:,}" for p, b in sorted(self.boundary.items()))
        started = next((s["t"] for s in samples if s["acked"] > 0), None)
        seam = next((s["t"] for s in samples if s["acked"] >= self.history), None)
        took = "-" if started is None or seam is None else f"{max(seam - started, 0.0):.1f} s"
        lo, hi = max(self.history - AROUND, 0), min(self.history + AROUND, len(ledger))
        around = ledger[lo:hi]
        once = "yes" if len(around) and bool(np.all(around == 1)) else "NO"
        return [
            ("first act: the past, from Parquet", f"{self.history:,} records in {self.files} files "
             f"(Kafka Connect layout, exported in {self.exported_s:.1f} s)"),
            ("the seam: first live offset per partition", bounds),
            ("backfill trained (first ack to the history acked)", took),
            (f"ids {lo:,}..{hi - 1:,} (both sides of the seam) each once", once),
        ]  # fmt: skip


def _schema() -> pa.Schema:
    kinds = {"int64": pa.int64(), "float64": pa.float64()}
    return pa.schema([(name, kinds[kind]) for name, kind in (f.split(":") for f in SCHEMA.split(","))])


def prepare(bootstrap: str, topic: str, partitions: int, history: int, seed: int, drift_at: int,
            lake: Path) -> Seam:  # fmt: skip
    """Write the first ``history`` records to ``topic`` and export them to ``lake`` (see the module docstring)."""
    produce(bootstrap, topic, ClickStream(seed, (drift_at,)), history, rate=1e9, partitions=partitions)
    started = time.monotonic()
    boundary, files = {}, 0
    for p in range(partitions):
        rows = _read(bootstrap, topic, p)
        folder = lake / "topics" / topic / f"partition={p}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(0, len(rows), PER_FILE):
            chunk = rows[i : i + PER_FILE]
            table = pa.Table.from_pylist([r for _, r in chunk], schema=_schema())
            table = table.append_column("offset", pa.array([o for o, _ in chunk], pa.int64()))
            table = table.append_column("partition", pa.array([p] * len(chunk), pa.int32()))
            pq.write_table(table, folder / f"{topic}+{p}+{chunk[0][0]:010d}.parquet", row_group_size=ROW_GROUP)
            files += 1
        if rows:
            boundary[p] = rows[-1][0] + 1
    return Seam(history, lake, files, boundary, time.monotonic() - started)


def _read(bootstrap: str, topic: str, partition: int) -> list[tuple[int, dict[str, Any]]]:
    """(offset, record) of every record of one partition, as an exporting connector reads them."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"export-{topic}", "enable.auto.commit": False})
    try:
        _, end = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=30)
        consumer.assign([TopicPartition(topic, partition, 0)])
        rows: list[tuple[int, dict[str, Any]]] = []
        deadline = time.monotonic() + 60
        while (rows[-1][0] + 1 if rows else 0) < end:
            if time.monotonic() > deadline:
                raise TimeoutError(f"exporting {topic}-{partition}: {len(rows)} records read of offsets [0, {end})")
            for msg in consumer.consume(1_000, timeout=1.0):
                value, offset = msg.value(), msg.offset()
                if msg.error() is None and value is not None and offset is not None and offset < end:
                    rows.append((offset, json.loads(value)))
        return rows
    finally:
        consumer.close()


def configure(spec: dict[str, Any], seam: Seam) -> None:
    """Name the export in the job's dataset and tell the trainer where the live records start."""
    spec["datasets"][0]["options"]["sr.history"] = str(seam.lake)
    spec["trainer"]["args"] += ["--live-from", str(seam.history)]
