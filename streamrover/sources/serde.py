"""Turning broker messages into Arrow records, and sending those that fail to the dead-letter dataset.

Shared by the stream backends (Kafka, Pulsar, RocketMQ): serialisation apart from I/O.

- ``sr.format=raw`` keeps the payload as bytes; ``sr.format=json`` decodes each
  payload as a JSON object into the columns of ``sr.schema`` (``id:int64,x:float64``).
- A payload that is not a JSON object, lacks a column or has a value of the wrong
  type goes, raw, to ``sr.dead_letter_dir``: one file per record, named by
  partition and position, so a replay writes the same file again (idempotent).
  Without a dead-letter directory a poison record is an error that names it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from streamrover.sources.api import SourceError

TYPES = {
    "int64": pa.int64(),
    "int32": pa.int32(),
    "float64": pa.float64(),
    "float32": pa.float32(),
    "string": pa.string(),
    "bool": pa.bool_(),
    "binary": pa.binary(),
}


def parse_schema(text: str) -> pa.Schema:
    """``sr.schema``: comma-separated ``name:type`` with types from :data:`TYPES`."""
    fields = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, type_name = item.partition(":")
        if type_name not in TYPES:
            raise SourceError(f"sr.schema field {item!r}: type must be one of {', '.join(sorted(TYPES))}")
        fields.append(pa.field(name, TYPES[type_name]))
    if not fields:
        raise SourceError("sr.format=json needs sr.schema, e.g. id:int64,x:float64")
    return pa.schema(fields)


@dataclass(frozen=True)
class Message:
    position: int
    value: bytes
    key: bytes | None = None
    index: int = -1  # the record's index within its position, where one position holds several (Pulsar batches)


class DeadLetters:
    """Files under ``directory``, one per undecodable record. Backends may subclass (a Kafka topic)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def flush(self) -> None:
        """Make every record sent so far durable (called before the batch that holds them is handed out)."""

    def send(self, partition_id: str, msg: Message, error: Exception) -> None:
        if not self.directory:
            raise SourceError(
                f"record at {partition_id} position {msg.position} cannot be decoded ({error}); set "
                "sr.dead_letter_dir to send such records to a dead-letter dataset"
            )
        root = Path(self.directory)
        root.mkdir(parents=True, exist_ok=True)
        safe = partition_id.replace("/", "_")
        suffix = f"-{msg.index:06d}" if msg.index >= 0 else ""
        final = root / f"{safe}-{msg.position:020d}{suffix}.json"
        doc = {
            "partition": partition_id,
            "position": msg.position,
            "error": str(error),
            "key": (msg.key or b"").hex(),
            "value": msg.value.hex(),
        }
        tmp = final.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(doc))
        tmp.rename(final)


def decode_json(
    msgs: Sequence[Message], schema: pa.Schema, partition_id: str, dead: DeadLetters
) -> tuple[pa.RecordBatch, pa.Array, int]:
    """(records, their positions, how many went to the dead-letter dataset)."""
    rows: list[dict[str, Any]] = []
    keep: list[Message] = []
    failed = 0
    for m in msgs:
        try:
            obj = json.loads(m.value)
            rows.append({f.name: obj[f.name] for f in schema})
            keep.append(m)
        except (ValueError, KeyError, TypeError) as exc:
            failed += 1
            dead.send(partition_id, m, exc)
    try:
        records = pa.RecordBatch.from_pylist(rows, schema=schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError):  # some value has the wrong type: find which, one by one
        good_rows, good = [], []
        for row, m in zip(rows, keep):
            try:
                pa.RecordBatch.from_pylist([row], schema=schema)
            except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
                failed += 1
                dead.send(partition_id, m, exc)
                continue
            good_rows.append(row)
            good.append(m)
        keep = good
        records = pa.RecordBatch.from_pylist(good_rows, schema=schema)
    return records, pa.array([m.position for m in keep], pa.int64()), failed
