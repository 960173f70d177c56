"""The history of a topic as exported to Parquet, Kafka-Connect style: which file holds which offsets.

Kafka Connect's S3/HDFS sinks write one topic partition per file, in offset order, with the
partition and the first offset in the file's name (``topics/T/partition=3/T+3+0000001000.parquet``)
and, with the ``InsertField`` transform, the record's offset (and partition) as columns. This module
reads that layout into a :class:`HistoryIndex`: per partition, its *pieces* (one per row group: the
first and last offset it holds), sorted and checked; :func:`read_offsets` reads the records of an
offset range back.

The index comes from the row groups' statistics (min/max of the offset and partition columns), so
building it reads no data (the master and every worker build it); a row group without statistics is
read. What is refused when the index is built (:class:`~streamrover.sources.api.SourceError` naming the
file, the partition and the offsets): a file without the offset column, a row group that mixes
partitions, two pieces of one partition whose offsets overlap, and (unless ``allow_gaps``) offsets
missing between two pieces of a partition. A row group whose offsets do not increase is refused when
it is read (:class:`HistoryReader`; when the index is built too if it had no statistics).
"""

from __future__ import annotations

import itertools
import os
import re
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from streamrover.sources.api import SourceError, SourceNotFoundError, SourceUnreadableError

#: Kafka Connect's file name: ``<topic>+<partition>+<first offset>`` and a suffix.
CONNECT_NAME = re.compile(r"^(?P<topic>.+)\+(?P<partition>\d+)\+(?P<offset>\d+)(\.[A-Za-z0-9.]+)?$")
_CACHE_PIECES = 4  # decoded row groups a reader keeps (a shard usually spans one or two)


class HistoryError(SourceError):
    """The history does not fit the topic (overlap, gap, foreign partition): the message names where."""


@dataclass(frozen=True)
class Piece:
    """One row group of an exported file: ``rows`` records of ``partition`` at offsets ``first`` .. ``last``."""

    partition: int
    first: int
    last: int  # inclusive
    rows: int
    path: str
    row_group: int

    def where(self) -> str:
        """The piece for messages: the file, its row group and its offsets."""
        return f"{self.path} (row group {self.row_group}, offsets [{self.first}, {self.last + 1}))"


class HistoryIndex:
    """Per partition number, the pieces of the history in offset order (see the module docstring)."""

    def __init__(self, pieces: dict[int, list[Piece]], offset_column: str) -> None:
        self.pieces = pieces
        self.offset_column = offset_column

    def start(self, partition: int) -> int | None:
        """The first offset the history holds of ``partition`` (None: it holds none)."""
        got = self.pieces.get(partition)
        return got[0].first if got else None

    def boundary(self, partition: int) -> int | None:
        """The offset after the last one the history holds of ``partition`` (None: it holds none)."""
        got = self.pieces.get(partition)
        return got[-1].last + 1 if got else None

    def between(self, partition: int, start: int, end: int) -> list[Piece]:
        """The pieces of ``partition`` holding offsets in ``[start, end)``, in order."""
        return [p for p in self.pieces.get(partition, []) if p.last >= start and p.first < end]


def build_index(uri: str, topic: str, offset_column: str, partition_column: str, allow_gaps: bool) -> HistoryIndex:
    """Scan the Parquet files ``uri`` names (a directory, a glob, one file; any fsspec URL) into an index."""
    fs, paths = _resolve(uri)
    pieces: dict[int, list[Piece]] = {}
    for path in paths:
        for piece in _scan_file(fs, path, topic, offset_column, partition_column):
            pieces.setdefault(piece.partition, []).append(piece)
    for number, found in pieces.items():
        found.sort(key=lambda p: (p.first, p.last))
        for before, after in itertools.pairwise(found):
            if after.first <= before.last:
                raise HistoryError(
                    f"history of {topic}-{number}: offsets [{after.first}, {min(before.last, after.last) + 1}) "
                    f"are in two files, {before.where()} and {after.where()}: remove the duplicate export"
                )
            if after.first > before.last + 1 and not allow_gaps:
                raise HistoryError(
                    f"history of {topic}-{number}: offsets [{before.last + 1}, {after.first}) are in no file "
                    f"(between {before.where()} and {after.where()}): export them, or pass "
                    "sr.history.gaps=allow if the topic holds no records there (compaction, transaction markers)"
                )
    return HistoryIndex(pieces, offset_column)


def _resolve(uri: str) -> tuple[Any, list[str]]:
    try:
        fs, root = fsspec.core.url_to_fs(uri)
    except (ValueError, ImportError) as exc:
        raise SourceError(f"cannot open the history {uri!r}: {exc}") from exc
    if any(c in root for c in "*?["):
        paths = sorted(p for p in fs.glob(root) if fs.isfile(p))
    elif fs.isdir(root):
        paths = sorted(p for p in fs.find(root) if p.endswith((".parquet", ".pq")))
    elif fs.exists(root):
        paths = [root]
    else:
        paths = []
    if not paths:
        raise SourceNotFoundError(f"the history {uri!r} names no parquet file")
    return fs, paths


def _scan_file(fs: Any, path: str, topic: str, offset_column: str, partition_column: str) -> Iterator[Piece]:
    named = CONNECT_NAME.match(os.path.basename(path))
    if named is not None and named["topic"] != topic:
        raise HistoryError(f"history file {path!r} is an export of topic {named['topic']!r}, not {topic!r}")
    try:
        with fs.open(path, "rb") as fh:
            pf = pq.ParquetFile(fh)
            names = pf.schema_arrow.names
            if offset_column not in names:
                raise HistoryError(
                    f"history file {path!r} has no offset column {offset_column!r} (columns: {', '.join(names)}): "
                    "export with Kafka Connect's InsertField transform (offset.field), or name the column with "
                    "sr.history.offset_column"
                )
            has_partition = partition_column in names
            if not has_partition and named is None:
                raise HistoryError(
                    f"history file {path!r} has no partition column {partition_column!r} and its name is not "
                    "<topic>+<partition>+<offset>.parquet: say which partition it holds one of these ways"
                )
            columns = [offset_column, partition_column] if has_partition else [offset_column]
            for rg in range(pf.metadata.num_row_groups):
                meta = pf.metadata.row_group(rg)
                if meta.num_rows == 0:
                    continue
                # From the row group's statistics when it has them (no data read: workers build the index too);
                # the offsets' order is then checked when a worker reads the row group (HistoryReader).
                stats = [_min_max(meta, names.index(c)) for c in columns]
                if any(s is None for s in stats):
                    stats = _read_min_max(path, rg, pf.read_row_group(rg, columns=columns), columns)
                offsets, partitions = stats[0], (stats[1] if has_partition else None)
                assert offsets is not None
                yield _piece(path, rg, offsets, meta.num_rows, partitions, named)
    except (pa.ArrowInvalid, OSError) as exc:
        raise SourceUnreadableError(f"cannot read history file {path!r}: {exc}") from exc


def _min_max(meta: Any, column: int) -> tuple[int, int] | None:
    """A row group's (min, max) of an integer column from its statistics; None when it has none."""
    stats = meta.column(column).statistics
    if stats is None or not stats.has_min_max or meta.column(column).physical_type not in ("INT32", "INT64"):
        return None
    return int(stats.min), int(stats.max)


def _read_min_max(path: str, rg: int, table: pa.Table, columns: list[str]) -> list[tuple[int, int] | None]:
    """(min, max) of each column, read from the data (no statistics); the offsets (first) must increase."""
    offsets = table.column(columns[0]).to_numpy().astype(np.int64)
    if offsets.size > 1 and not bool(np.all(offsets[1:] > offsets[:-1])):
        raise HistoryError(
            f"history file {path!r} row group {rg}: offsets do not increase (write files in offset order)"
        )
    out: list[tuple[int, int] | None] = [(int(offsets[0]), int(offsets[-1]))]
    for name in columns[1:]:
        bounds = pc.min_max(table.column(name))
        out.append((int(bounds["min"].as_py()), int(bounds["max"].as_py())))
    return out


def _piece(
    path: str,
    rg: int,
    offsets: tuple[int, int],
    rows: int,
    partitions: tuple[int, int] | None,
    named: re.Match[str] | None,
) -> Piece:
    if partitions is not None:
        low, high = partitions
        if low != high:
            raise HistoryError(f"history file {path!r} row group {rg} mixes partitions {low} to {high}: one per file")
        number = int(low)
        if named is not None and int(named["partition"]) != number:
            raise HistoryError(
                f"history file {path!r}: its name says partition {named['partition']}, its rows {number}"
            )
    else:
        assert named is not None
        number = int(named["partition"])
    return Piece(number, offsets[0], offsets[1], rows, path, rg)


class HistoryReader:
    """Reads offset ranges of the history back (a worker's side), keeping a few decoded row groups."""

    def __init__(self, uri: str, index: HistoryIndex, schema: pa.Schema) -> None:
        self.fs, _ = _resolve(uri)
        self.index = index
        self.schema = schema
        self._cache: OrderedDict[tuple[str, int], tuple[pa.Table, np.ndarray]] = OrderedDict()

    def read(
        self, partition: int, start: int, end: int, batch_size: int
    ) -> Iterator[tuple[pa.RecordBatch, pa.Array, int, int]]:
        """(records, their offsets, first position, position after) batches of the records at offsets ``[start, end)``.

        Batches are contiguous: the first starts at ``start``, each next where the one before ended, the
        last ends at ``end``. A batch holds at most ``batch_size`` records.
        """
        at = start
        # one batch behind: the last one is stretched to the range's end
        held: tuple[pa.RecordBatch, pa.Array, int, int] | None = None
        for piece in self.index.between(partition, start, end):
            table, offsets = self._piece(piece)
            lo, hi = (int(x) for x in np.searchsorted(offsets, [max(start, piece.first), end]))
            for i in range(lo, hi, max(batch_size, 1)):
                j = min(i + batch_size, hi)
                if held is not None:
                    yield held
                after = int(offsets[j - 1]) + 1
                records = table.slice(i, j - i).combine_chunks().to_batches()[0]
                held = (records, pa.array(offsets[i:j]), at, after)
                at = after
        if held is not None:
            yield held[0], held[1], held[2], end
        elif at < end:
            yield pa.RecordBatch.from_pylist([], schema=self.schema), pa.array([], pa.int64()), at, end

    def _piece(self, piece: Piece) -> tuple[pa.Table, np.ndarray]:
        key = (piece.path, piece.row_group)
        got = self._cache.get(key)
        if got is not None:
            self._cache.move_to_end(key)
            return got
        try:
            with self.fs.open(piece.path, "rb") as fh:
                raw = pq.ParquetFile(fh).read_row_group(piece.row_group)
        except FileNotFoundError as exc:
            raise SourceNotFoundError(f"history file {piece.path!r} is gone: {exc}") from exc
        except (pa.ArrowInvalid, OSError) as exc:
            raise SourceUnreadableError(f"cannot read history {piece.where()}: {exc}") from exc
        offsets = raw.column(self.index.offset_column).to_numpy().astype(np.int64)
        if offsets.size > 1 and not bool(np.all(offsets[1:] > offsets[:-1])):
            raise SourceUnreadableError(
                f"history {piece.where()}: offsets do not increase (write them in offset order)"
            )
        missing = [f.name for f in self.schema if f.name not in raw.column_names]
        if missing:
            raise SourceUnreadableError(f"history {piece.where()} lacks the record column(s) {', '.join(missing)}")
        try:
            table = raw.select(self.schema.names).cast(self.schema)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise SourceUnreadableError(
                f"history {piece.where()}: its columns do not cast to the records' schema: {exc}"
            ) from exc
        self._cache[key] = (table, offsets)
        while len(self._cache) > _CACHE_PIECES:
            self._cache.popitem(last=False)
        return table, offsets
