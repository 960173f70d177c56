"""Staged datasets: Parquet files a stream engine's sink (Flink, Spark) commits to the master.

A staged dataset is registered with the URI ``staged://<anything>``. It has no partitions
of its own: each file committed with ``CommitStaged`` becomes one partition, whose id is the
file's URI (any fsspec URL the workers can read) and whose positions are its row indexes,
so positions are dense. The master plans the shards at commit time; it never polls.

Options:

- ``sr.staging_dir``: where the sink stages files, as ``<dir>/<producer>/<part>/<epoch>/<file>``;
  the master deletes uncommitted staging there (see :func:`staging_garbage`).
- ``sr.schema``: optional, the records' Arrow schema (:func:`encode_schema`); committed files must
  match it. Without it the first committed file fixes the schema.
- ``sr.staged_retention``: ``delete`` (the default) or ``keep``. With ``delete`` the master deletes a
  committed file under ``sr.staging_dir`` once every record of it is trained and held by two durable
  checkpoints (the limit offsets are committed upstream by: a fallback from a corrupt newest checkpoint
  to the one before never needs it), with the folders that emptied. A restore to an older cursor than
  that then finds the file gone (as with a broker's retention); ``keep`` leaves every file to you.
  Files outside ``sr.staging_dir`` are never deleted.
- ``sr.commit_gap_ms``: how long a commit that a later commit of the same (producer, part) names as its
  previous may be missing before it counts as lost (15 minutes by default; see
  ``streamrover.shard_service.master.gaps``). ``sr.on_data_loss`` (``fail`` or ``skip``) says what then.
"""

from __future__ import annotations

import base64
import json
import re
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

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
    register_source,
)

SCHEME = "staged"
STAGING_DIR = "sr.staging_dir"
SCHEMA = "sr.schema"
RETENTION = "sr.staged_retention"
RETENTIONS = ("delete", "keep")
COMMIT_GAP_MS = "sr.commit_gap_ms"
DEFAULT_GAP_MS = 15 * 60 * 1000  # Flink: a commit retries, then 10 retryLater rounds, then a job restart replays it
_KEY_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_OPEN_FILES = 4  # parquet files a worker keeps open


def is_staged(uri: str) -> bool:
    """Whether a dataset URI names a staged dataset (``staged://...``)."""
    return uri.startswith(f"{SCHEME}://")


def encode_schema(schema: pa.Schema) -> str:
    """An Arrow schema as the ``sr.schema`` option's value (base64 of its IPC serialisation)."""
    return base64.b64encode(schema.remove_metadata().serialize().to_pybytes()).decode()


def decode_schema(text: str) -> pa.Schema:
    """The schema :func:`encode_schema` wrote; SourceError when ``text`` is not one."""
    try:
        return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text, validate=True)))
    except (ValueError, pa.ArrowInvalid) as exc:
        raise SourceError(f"option {SCHEMA}: not a base64 Arrow IPC schema (use encode_schema): {exc}") from exc


def schema_json(schema: pa.Schema) -> str:
    """The JSON form of a schema the master shows and compares (field names and types)."""
    return json.dumps([[f.name, str(f.type)] for f in schema])


def validate_key_part(what: str, value: str) -> None:
    """A producer or part name: it is a directory name under the staging dir."""
    if not _KEY_RE.match(value):
        raise SourceError(f"{what} {value!r} must be 1-128 characters of letters, digits, '_', '.', '-'")


@dataclass(frozen=True)
class FileFacts:
    """What the master checks of a file before it commits it."""

    uri: str
    rows: int
    schema_json: str


def inspect_file(uri: str) -> FileFacts:
    """Read a staged file's footer: its row count and schema. SourceError naming the file when it cannot."""
    try:
        fs, path = fsspec.core.url_to_fs(uri)
    except (ValueError, ImportError) as exc:
        raise SourceError(f"staged file {uri!r}: cannot open: {exc}") from exc
    try:
        with fs.open(path, "rb") as fh:
            meta = pq.ParquetFile(fh).metadata
    except FileNotFoundError as exc:
        raise SourceNotFoundError(f"staged file {uri!r} does not exist") from exc
    except (pa.ArrowInvalid, OSError) as exc:
        raise SourceUnreadableError(f"staged file {uri!r} is not a readable Parquet file: {exc}") from exc
    return FileFacts(uri, int(meta.num_rows), schema_json(meta.schema.to_arrow_schema()))


def staging_garbage(staging_dir: str, producer: str, part: str, epoch: int, keep: Iterable[str]) -> list[str]:
    """Files under ``<staging_dir>/<producer>/<part>/<e>/`` with integer ``e <= epoch`` not in ``keep``.

    Returned as fsspec URLs of the staging dir's filesystem; nothing is deleted here.
    """
    fs, root = fsspec.core.url_to_fs(staging_dir)
    base = f"{root.rstrip('/')}/{producer}/{part}"
    kept = {fs._strip_protocol(u) for u in keep}
    if not fs.isdir(base):
        return []
    garbage: list[str] = []
    for entry in fs.ls(base, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if not name.isdigit() or int(name) > epoch:
            continue
        garbage.extend(f for f in fs.find(entry) if fs._strip_protocol(f) not in kept)
    return [fs.unstrip_protocol(f) if hasattr(fs, "unstrip_protocol") else f for f in sorted(garbage)]


def retention(options: Mapping[str, str]) -> str:
    """The ``sr.staged_retention`` option (``delete`` by default); SourceError for another value."""
    value = options.get(RETENTION, "delete")
    if value not in RETENTIONS:
        raise SourceError(f"option {RETENTION} must be delete or keep, not {value!r}")
    return value


def in_staging(staging_dir: str, uri: str) -> bool:
    """Whether ``uri`` is a file under ``staging_dir`` (same filesystem; the files retention may delete)."""
    fs, root = fsspec.core.url_to_fs(staging_dir)
    try:
        other, path = fsspec.core.url_to_fs(uri)
    except (ValueError, ImportError):
        return False
    return type(other) is type(fs) and path.startswith(root.rstrip("/") + "/")


def delete_trained(staging_dir: str, urls: Iterable[str]) -> int:
    """Delete committed files under ``staging_dir`` and the folders they leave empty, up to
    ``<staging_dir>/<producer>/<part>`` (kept). Missing files are skipped. Returns how many were deleted."""
    fs, root = fsspec.core.url_to_fs(staging_dir)
    root = root.rstrip("/")
    deleted = delete_files(urls)
    folders = {fsspec.core.url_to_fs(u)[1].rsplit("/", 1)[0] for u in urls}
    for folder in sorted(folders, key=len, reverse=True):
        while folder.startswith(root + "/") and folder[len(root) + 1 :].count("/") >= 2:
            try:
                fs.rmdir(folder)  # only when empty
            except OSError:
                break
            folder = folder.rsplit("/", 1)[0]
    return deleted


def delete_files(urls: Iterable[str]) -> int:
    """Delete files (fsspec URLs); missing ones are skipped. Returns how many were deleted."""
    deleted = 0
    for url in urls:
        fs, path = fsspec.core.url_to_fs(url)
        try:
            fs.rm(path)
            deleted += 1
        except FileNotFoundError:
            continue
    return deleted

def gap_bound_ms(options: Mapping[str, str]) -> int:
    """The ``sr.commit_gap_ms`` option (:data:`DEFAULT_GAP_MS` when absent); SourceError unless a positive integer."""
    text = options.get(COMMIT_GAP_MS, "")
    if not text:
        return DEFAULT_GAP_MS
    if not text.isdigit() or int(text) <= 0:
        raise SourceError(f"option {COMMIT_GAP_MS} must be a positive integer of milliseconds, not {text!r}")
    return int(text)


class StagedSource(Source):
    """The files committed to a staged dataset: the master plans from commits, workers read files by URI."""

    kind = SourceKind.STREAM
    dense_positions = True

    def __init__(self, uri: str, format: str = "", options: Mapping[str, str] | None = None) -> None:
        if not is_staged(uri):
            raise SourceError(f"{uri!r} is not a staged dataset URI (staged://<name>)")
        if format not in ("", "parquet"):
            raise SourceError(f"staged dataset {uri!r}: format must be parquet, got {format!r}")
        self.uri = uri
        self.options = dict(options or {})
        retention(self.options)
        gap_bound_ms(self.options)
        if self.options.get("sr.on_data_loss", "fail") not in ("fail", "skip"):
            raise SourceError(f"option sr.on_data_loss must be fail or skip, not {self.options['sr.on_data_loss']!r}")
        declared = self.options.get(SCHEMA)
        self._schema: pa.Schema | None = decode_schema(declared) if declared else None
        self._files: OrderedDict[str, pq.ParquetFile] = OrderedDict()

    def partitions(self) -> list[Partition]:
        return []  # the partitions are the committed files: the master knows them, the URI does not

    def schema(self) -> pa.Schema:
        if self._schema is None:
            raise SourceError(
                f"staged dataset {self.uri!r}: its schema is not known before a file was read; "
                f"declare it with the {SCHEMA} option (streamrover.sources.staged.encode_schema)"
            )
        return self._schema

    def declared_schema(self) -> pa.Schema | None:
        """The ``sr.schema`` option's schema, None when the dataset declares none."""
        declared = self.options.get(SCHEMA)
        return decode_schema(declared) if declared else None

    def _parquet(self, uri: str) -> pq.ParquetFile:
        pf = self._files.get(uri)
        if pf is not None:
            self._files.move_to_end(uri)
            return pf
        try:
            fs, path = fsspec.core.url_to_fs(uri)
            pf = pq.ParquetFile(fs.open(path, "rb"))
        except FileNotFoundError as exc:
            raise SourceNotFoundError(f"staged file {uri!r} of {self.uri!r} does not exist") from exc
        except (pa.ArrowInvalid, OSError, ValueError) as exc:
            raise SourceUnreadableError(f"cannot read staged file {uri!r}: {exc}") from exc
        self._files[uri] = pf
        while len(self._files) > _OPEN_FILES:
            self._files.popitem(last=False)[1].close()
        return pf

    def read(self, partition: Partition, start: int, end: int, batch_size: int) -> Iterator[ReadBatch]:
        pf = self._parquet(partition.id)
        meta = pf.metadata
        if not 0 <= start <= end <= meta.num_rows:
            raise SourceError(f"rows [{start}, {end}) are outside staged file {partition.id!r} of {meta.num_rows}")
        if self._schema is None:
            self._schema = pf.schema_arrow
        groups: list[int] = []
        first = offset = 0
        for i in range(meta.num_row_groups):
            rows = meta.row_group(i).num_rows
            if offset + rows > start and offset < end:
                if not groups:
                    first = offset
                groups.append(i)
            offset += rows
        if not groups:
            return
        table = pf.read_row_groups(groups).slice(start - first, end - start)
        position = start
        for batch in table.to_batches(max_chunksize=batch_size):
            if batch.num_rows:
                yield ReadBatch(batch, position, position + batch.num_rows)
                position += batch.num_rows

    def close(self) -> None:
        for pf in self._files.values():
            pf.close()
        self._files.clear()


def _factory(uri: str, format: str, options: Mapping[str, str]) -> Source:
    return StagedSource(uri, format, options)


register_source(_factory, schemes=(SCHEME,))
