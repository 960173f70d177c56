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

import numpy as np
import pyarrow as pa
import pyarrow.json as pa_json

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
    """One record as a source read it: its position, value and key (``index`` within a position holding several)."""
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
        """Write ``msg``, which failed to decode with ``error``, to the dead-letter directory; :class:`SourceError`
        when ``sr.dead_letter_dir`` is not set.
        """
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
    """(records, their positions, how many went to the dead-letter dataset).

    A batch of well-formed records is parsed at once by Arrow's JSON reader (C++, no Python
    per record: about a tenth of the CPU of ``json.loads`` per record, the most a reading
    trainer spent besides its step). Whatever that reader would not take exactly as the
    per-record path does (a record that is not one JSON object, a missing or null field, a
    value of another type, an integer out of range) sends the whole batch down the per-record
    path, which decides each record as before: the result never depends on the path taken.
    """
    fast = _decode_all(msgs, schema)
    if fast is not None:
        return fast, pa.array([m.position for m in msgs], pa.int64()), 0
    return _decode_each(msgs, schema, partition_id, dead)


_EXACT_INT = {pa.float32(): float(2**24), pa.float64(): float(2**53)}  # integers up to this are floats exactly


def _wide(kind: pa.DataType) -> pa.DataType:
    """The type Arrow's JSON reader parses a column as: 64-bit, cast after (as Python's values are)."""
    if pa.types.is_integer(kind):
        return pa.int64()
    return pa.float64() if pa.types.is_floating(kind) else kind


def _decode_all(msgs: Sequence[Message], schema: pa.Schema) -> pa.RecordBatch | None:
    """The records of ``msgs`` in one parse, or None where any record needs the per-record path."""
    values = [m.value for m in msgs]
    # one line, one non-blank record: Arrow skips blank lines, so rows could no longer be told apart
    if not values or not all(values) or any(map(bytes.isspace, values)):
        return None
    data = b"\n".join(values)
    wide = pa.schema([pa.field(f.name, _wide(f.type)) for f in schema])
    try:
        table = pa_json.read_json(
            pa.BufferReader(data),
            read_options=pa_json.ReadOptions(use_threads=False, block_size=len(data) + 1),
            parse_options=pa_json.ParseOptions(explicit_schema=wide, unexpected_field_behavior="ignore"),
        )
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return None
    if table.num_rows != len(values) or any(c.null_count for c in table.columns):
        return None  # a line held several records, or a field is missing (or null): decided one by one
    for f in schema:
        # Python takes an integer into a float column only where the float holds it exactly; the reader
        # parses either as a float: magnitudes where the two could differ are decided one by one (compared value
        # by value: a NaN elsewhere in the column made max() NaN, and the check passed a 2**53 + 1 it must not)
        exact = _EXACT_INT.get(f.type)
        if exact is not None and bool(np.any(np.abs(table.column(f.name).to_numpy()) >= exact)):
            return None
    try:
        return table.cast(schema).combine_chunks().to_batches()[0]  # safe casts: out of range raises
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return None


def _decode_each(
    msgs: Sequence[Message], schema: pa.Schema, partition_id: str, dead: DeadLetters
) -> tuple[pa.RecordBatch, pa.Array, int]:
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
