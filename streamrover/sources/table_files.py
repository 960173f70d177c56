"""What the table sources share (``delta.py``, ``iceberg.py``): a table's data files as row-group partitions.

A partition is one row group of one Parquet data file, named ``{tag}:{file}#rg{n}``: ``tag`` is the table's
version or snapshot that brought the file in (``v3``, ``s8165618976659575987``), so it is in every cursor
that holds the file's records. Positions are row indexes (dense). A local file is named by its path, any other
by its URL (as :class:`~streamrover.sources.files.FileSource` names them).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterator

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from streamrover.sources.api import (
    Partition,
    ReadBatch,
    Source,
    SourceError,
    SourceKind,
    SourceNotFoundError,
    SourceUnreadableError,
)
from streamrover.sources.files import FileSource

PART_ID = re.compile(r"^(?P<tag>[a-z][0-9]+):(?P<path>.+)#rg(?P<rg>[0-9]+)$")
_OPEN_FILES = 4


def local_or_url(path: str) -> str:
    """``file:///x`` as ``/x`` (how FileSource names local files); other URLs as they are."""
    return path.removeprefix("file://") if path.startswith("file:///") else path


def row_groups(tag: str, path: str) -> tuple[pa.Schema, list[Partition]]:
    """The schema of data file ``path`` and its non-empty row groups as partitions tagged ``tag``."""
    path = local_or_url(path)
    try:
        with fsspec.open(path, "rb") as fh:
            meta = pq.ParquetFile(fh).metadata
    except FileNotFoundError as exc:
        raise SourceNotFoundError(f"data file {path!r} is gone (vacuumed or expired?): {exc}") from exc
    except (pa.ArrowInvalid, OSError) as exc:
        raise SourceUnreadableError(f"cannot read data file {path!r}: {exc}") from exc
    parts = [
        Partition(f"{tag}:{path}#rg{i}", 0, meta.row_group(i).num_rows)
        for i in range(meta.num_row_groups)
        if meta.row_group(i).num_rows
    ]
    return meta.schema.to_arrow_schema(), parts


class TableFiles:
    """Reads partitions named as above, keeping a few data files open."""

    def __init__(self) -> None:
        self._files: OrderedDict[str, FileSource] = OrderedDict()

    def read(self, partition: Partition, start: int, end: int, batch_size: int) -> Iterator[ReadBatch]:
        found = PART_ID.match(partition.id)
        if found is None:
            raise SourceError(f"partition {partition.id!r} is not a table data file's row group (TAG:FILE#rgN)")
        path = found["path"]
        files = self._files.get(path)
        if files is None:
            files = FileSource(path, "parquet")  # SourceNotFoundError when the file was deleted
            self._files[path] = files
            while len(self._files) > _OPEN_FILES:
                self._files.popitem(last=False)[1].close()
        yield from files.read(
            Partition(f"{path}#rg{found['rg']}", partition.start, partition.end), start, end, batch_size
        )

    def close(self) -> None:
        for files in self._files.values():
            files.close()
        self._files.clear()


class TableSource(Source):
    """What a table source (Delta, Iceberg) shares: partitions are data files' row groups, read by
    :class:`TableFiles`; a poll lists the partitions again; the schema is known once they are listed.
    A subclass sets ``_schema`` in :meth:`partitions` (a STREAM ``kind`` when it follows the table)."""

    kind = SourceKind.BATCH
    dense_positions = True

    def __init__(self) -> None:
        self._files = TableFiles()
        self._schema: pa.Schema | None = None

    def poll(self) -> list[Partition]:
        return self.partitions()

    def schema(self) -> pa.Schema:
        if self._schema is None:
            self.partitions()
        assert self._schema is not None
        return self._schema

    def read(self, partition: Partition, start: int, end: int, batch_size: int) -> Iterator[ReadBatch]:
        yield from self._files.read(partition, start, end, batch_size)  # SourceNotFoundError: the file is gone

    def close(self) -> None:
        self._files.close()
