"""Batch files as a source: Parquet, CSV and JSON lines through pyarrow.

Partitions are parquet row groups (``path#rg3``) or whole CSV / JSON-lines files
(``path``); a position is the row index inside the partition, so positions are
dense. URIs are local paths, globs, directories, or any fsspec URL
(``s3://bucket/data/*.parquet``, ``memory://...``).

Everything that can be wrong with the input is found when the source is opened
(the dataset is registered), not when a worker reads: a URI that matches no
file, a file that cannot be read or parsed, a format that cannot be told, and
files whose schemas differ.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq

from streamrover.sources.api import (
    Partition,
    ReadBatch,
    Source,
    SourceError,
    SourceKind,
    SourceNotFoundError,
    SourceSchemaError,
    SourceUnreadableError,
    register_source,
)
from streamrover.sources.options import FileOptions

FORMATS_BY_SUFFIX = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".csv": "csv",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
}
_GLOB_CHARS = set("*?[")
_KEEP_OPEN_AT_SCAN = 64  # local parquet files whose handle opening the source keeps for reading


@dataclass(frozen=True)
class _FilePart:
    path: str
    row_group: int | None  # None: the whole file is one partition
    rows: int


def _format_of(path: str, declared: str) -> str:
    if declared:
        if declared not in set(FORMATS_BY_SUFFIX.values()):
            raise SourceError(f"unknown file format {declared!r}; use one of parquet, csv, jsonl")
        return declared
    suffix = os.path.splitext(path)[1].lower()
    fmt = FORMATS_BY_SUFFIX.get(suffix)
    if fmt is None:
        raise SourceError(
            f"cannot tell the format of {path!r} from its suffix {suffix!r}; "
            "pass format=parquet|csv|jsonl when registering the dataset"
        )
    return fmt


class FileSource(Source):
    """Parquet, CSV or JSON-lines files as a bounded, partitioned source."""

    kind = SourceKind.BATCH
    dense_positions = True

    def __init__(self, uri: str, format: str = "", options: Mapping[str, str] | None = None) -> None:
        self.uri = uri
        self.options = dict(options or {})
        self.parsed = FileOptions.parse(self.options)  # before the files are scanned
        self._fs, self._paths = self._resolve(uri)
        formats = {_format_of(p, format) for p in self._paths}
        if len(formats) > 1:
            raise SourceError(f"{uri!r} matches files of several formats ({', '.join(sorted(formats))}); pass format=")
        self.format = formats.pop()
        self._parts: list[_FilePart] = []
        self._by_id: dict[str, _FilePart] = {}
        self._schema: pa.Schema | None = None
        self._cache: OrderedDict[tuple[str, int | None], pa.Table] = OrderedDict()
        self._cache_size = self.parsed.cache_partitions
        self._files: dict[str, pq.ParquetFile] = {}
        self._metadata: dict[str, pq.FileMetaData] = {}  # footers parsed at open
        protocol = self._fs.protocol if isinstance(self._fs.protocol, str) else self._fs.protocol[0]
        self._local = protocol in ("file", "local")
        self._scan()

    # -- resolution and validation ------------------------------------------
    @staticmethod
    def _resolve(uri: str) -> tuple[Any, list[str]]:
        try:
            fs, root = fsspec.core.url_to_fs(uri)
        except (ValueError, ImportError) as exc:
            raise SourceError(f"cannot open {uri!r}: {exc}") from exc
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        if any(c in root for c in _GLOB_CHARS):
            paths = sorted(p for p in fs.glob(root) if fs.isfile(p))
            if not paths:
                raise SourceNotFoundError(f"no files match {uri!r}")
        elif fs.isdir(root):
            paths = sorted(p for p in fs.find(root) if os.path.splitext(p)[1].lower() in FORMATS_BY_SUFFIX)
            if not paths:
                raise SourceNotFoundError(f"directory {uri!r} holds no .parquet, .csv or .jsonl files")
        elif fs.exists(root):
            paths = [root]
        else:
            raise SourceNotFoundError(f"file {uri!r} does not exist")
        if protocol not in ("file", "local"):
            paths = [fs.unstrip_protocol(p) if hasattr(fs, "unstrip_protocol") else p for p in paths]
        return fs, paths

    def _fs_path(self, path: str) -> str:
        return str(self._fs._strip_protocol(path))

    def _open(self, path: str) -> Any:
        try:
            return self._fs.open(self._fs_path(path), "rb")
        except (OSError, PermissionError) as exc:
            raise SourceUnreadableError(f"cannot read {path!r}: {exc}") from exc

    def _scan(self) -> None:
        first_path = ""
        for path in self._paths:
            schema, parts = self._scan_file(path)
            if self._schema is None:
                self._schema, first_path = schema, path
            elif not schema.equals(self._schema, check_metadata=False):
                raise SourceSchemaError(
                    f"files of dataset {self.uri!r} have different schemas: {first_path!r} has "
                    f"{_schema_str(self._schema)} but {path!r} has {_schema_str(schema)}"
                )
            self._parts.extend(parts)
        for part in self._parts:
            self._by_id[self._part_id(part)] = part

    def _scan_file(self, path: str) -> tuple[pa.Schema, list[_FilePart]]:
        if self.format == "parquet":
            try:
                if self._local:
                    pf = pq.ParquetFile(path, memory_map=True)
                    meta = pf.metadata
                    if len(self._files) < _KEEP_OPEN_AT_SCAN:  # read from it later: opening again costs
                        self._files[path] = pf
                    else:  # many files: no fd held per file until it is read
                        pf.close()
                else:
                    with self._open(path) as fh:
                        meta = pq.ParquetFile(fh).metadata
                self._metadata[path] = meta  # reused when the file is opened to read: one footer parse per file
                schema = meta.schema.to_arrow_schema()
            except (pa.ArrowInvalid, OSError) as exc:
                raise SourceUnreadableError(f"cannot read parquet file {path!r}: {exc}") from exc
            parts = [_FilePart(path, i, meta.row_group(i).num_rows) for i in range(meta.num_row_groups)]
            return schema, [p for p in parts if p.rows > 0]
        table = self._read_whole(path)
        self._remember((path, None), table)
        return table.schema, ([_FilePart(path, None, table.num_rows)] if table.num_rows else [])

    def _read_whole(self, path: str) -> pa.Table:
        try:
            with self._open(path) as fh:
                if self.format == "csv":
                    return pacsv.read_csv(fh)
                return pajson.read_json(fh)
        except (pa.ArrowInvalid, OSError) as exc:
            raise SourceUnreadableError(f"cannot parse {self.format} file {path!r}: {exc}") from exc

    @staticmethod
    def _part_id(part: _FilePart) -> str:
        return part.path if part.row_group is None else f"{part.path}#rg{part.row_group}"

    # -- Source --------------------------------------------------------------
    def partitions(self) -> list[Partition]:
        return [Partition(self._part_id(p), 0, p.rows) for p in self._parts]

    def schema(self) -> pa.Schema:
        assert self._schema is not None
        return self._schema

    def read(self, partition: Partition, start: int, end: int, batch_size: int) -> Iterator[ReadBatch]:
        part = self._by_id.get(partition.id)
        if part is None:
            raise SourceNotFoundError(f"partition {partition.id!r} is not part of {self.uri!r}")
        if not 0 <= start <= end <= part.rows:
            raise SourceError(f"rows [{start}, {end}) are outside partition {partition.id!r} of {part.rows} rows")
        table = self._table(part).slice(start, end - start)
        position = start
        for batch in table.to_batches(max_chunksize=batch_size):
            if batch.num_rows == 0:
                continue
            yield ReadBatch(batch, position, position + batch.num_rows)
            position += batch.num_rows

    def _table(self, part: _FilePart) -> pa.Table:
        key = (part.path, part.row_group)
        table = self._cache.get(key)
        if table is not None:
            self._cache.move_to_end(key)
            return table
        if part.row_group is None:
            table = self._read_whole(part.path)
        else:
            try:
                table = self._parquet(part.path).read_row_group(part.row_group)
            except (pa.ArrowInvalid, OSError) as exc:
                raise SourceUnreadableError(f"cannot read {self._part_id(part)!r}: {exc}") from exc
        self._remember(key, table)
        return table

    def _parquet(self, path: str) -> pq.ParquetFile:
        """An open parquet file (its footer parsed once, when the source was opened); local files are memory-mapped."""
        pf = self._files.get(path)
        if pf is None:
            if self._local:
                pf = pq.ParquetFile(path, memory_map=True, metadata=self._metadata.get(path))
            else:
                pf = pq.ParquetFile(self._open(path), metadata=self._metadata.get(path))
            self._files[path] = pf
        return pf

    def _remember(self, key: tuple[str, int | None], table: pa.Table) -> None:
        self._cache[key] = table
        while len(self._cache) > max(self._cache_size, 1):
            self._cache.popitem(last=False)

    def close(self) -> None:
        self._cache.clear()
        for pf in self._files.values():
            pf.close()
        self._files.clear()
        self._metadata.clear()


def _schema_str(schema: pa.Schema) -> str:
    return "{" + ", ".join(f"{f.name}: {f.type}" for f in schema) + "}"


def _factory(uri: str, format: str, options: Mapping[str, str]) -> Source:
    return FileSource(uri, format, options)


register_source(_factory, schemes=("file",), formats=("files", "parquet", "csv", "jsonl"))
