"""History, then live, joined **by time** (``sr.history.boundary=timestamp:T``): when the history has no offsets.

When the exported files carry only each record's time (a lake table written by another job), the
boundary is an instant ``T`` (milliseconds since the epoch, the Kafka record timestamp's clock). The rule
that trains every record once, whichever side holds it:

- a record timestamped **before** ``T`` is trained from the history; the history's records at or after ``T``
  are skipped (their copies in the topic are trained);
- a record timestamped **at or after** ``T`` is trained from the topic. The topic is read from
  ``offsets_for_times(T)`` (per partition, the first offset whose timestamp is ``T`` or later, so every record
  at or after ``T`` lies at or past it), and the records found there with a timestamp before ``T`` (producer
  clocks out of order) are skipped: the history holds them.

So **records sharing the boundary millisecond** ``T`` are all trained from the topic, and none from the
history. The rule is exact when the history holds every record timestamped before ``T`` (an export taken
at or after ``T``, with late records in) and the topic still holds every record at or after ``T``; the
latter is checked at registration (refused when a partition's first retained record is already at or past
``T`` after records before it were deleted: records at or after ``T`` may be gone), the former cannot be
checked without offsets and is the exporter's promise.

Partitions: each row group of the history is a partition ``history:PATH#rgN`` (positions: row indexes, as
``files.py``), each topic partition a live one (positions: offsets, from ``offsets_for_times(T)``). One
cursor spans both. History partitions hold at their end and live ones at 0 (``Partition.hold``): nothing live
is planned until every history row group is acked.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from streamrover.sources.api import Partition, ReadBatch, Source, SourceError
from streamrover.sources.files import FileSource
from streamrover.sources.history_index import HistoryError

HISTORY_ID = "history:"  # the prefix of the history's partition ids


class TimeChain:
    """The history (files) before instant ``boundary`` and the ``live`` source from it (module docstring)."""

    def __init__(self, files: str, timestamp_column: str, boundary: int, live: Source) -> None:
        self.files_uri = files
        self.timestamp_column = timestamp_column
        self.boundary = boundary
        self.live = live
        self._files: FileSource | None = None

    def files(self) -> FileSource:
        """The history's files (scanned on first use)."""
        if self._files is None:
            self._files = FileSource(self.files_uri, "parquet")
            names = self._files.schema().names
            missing = [n for n in [self.timestamp_column, *self.live.schema().names] if n not in names]
            if missing:
                raise HistoryError(
                    f"the history {self.files_uri!r} lacks the column(s) {', '.join(missing)} (it has "
                    f"{', '.join(names)}): the records' columns and the timestamp (sr.history.timestamp_column)"
                )
        return self._files

    def _history(self) -> list[Partition]:
        return [Partition(HISTORY_ID + p.id, p.start, p.end, hold=p.end) for p in self.files().partitions()]

    def partitions(self) -> list[Partition]:
        """At registration: the history's row groups and the topic's partitions from ``T``, checked."""
        starts = {p.id: p.start for p in self.live.partitions()}  # the live source starts at timestamp:T
        live = self.live.poll()
        for p in live:
            earliest = p.earliest if p.earliest is not None else 0
            if starts[p.id] == earliest and earliest > 0:
                raise HistoryError(
                    f"{p.id}: the topic's records before offset {earliest} were deleted and the first one it keeps "
                    f"is already at or past the boundary {self.boundary}: records at or after it may be in neither "
                    "the history nor the topic; choose a later boundary"
                )
        return self._history() + [Partition(p.id, starts[p.id], p.end, earliest=p.earliest, hold=0) for p in live]

    def poll(self) -> list[Partition]:
        return self._history() + [
            Partition(p.id, p.start, p.end, earliest=p.earliest, hold=0) for p in self.live.poll()
        ]

    def commit(self, positions: Mapping[str, int]) -> None:
        self.live.commit({k: v for k, v in positions.items() if not k.startswith(HISTORY_ID)})

    def read(self, partition: Partition, start: int, end: int, batch_size: int) -> Iterator[ReadBatch]:
        if not partition.id.startswith(HISTORY_ID):
            yield from self.live.read(partition, start, end, batch_size)
            return
        part = Partition(partition.id.removeprefix(HISTORY_ID), partition.start, partition.end)
        schema = self.live.schema()
        for batch in self.files().read(part, start, end, batch_size):
            before = pc.less(batch.records.column(self.timestamp_column), pa.scalar(self.boundary, pa.int64()))
            try:
                records = batch.records.filter(before).select(schema.names).cast(schema)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise SourceError(f"history {part.id}: its columns do not cast to the records' schema: {exc}") from exc
            positions = pa.array(np.arange(batch.start, batch.end, dtype=np.int64)).filter(before)
            yield ReadBatch(records, batch.start, batch.end, positions)

    def close(self) -> None:
        if self._files is not None:
            self._files.close()
