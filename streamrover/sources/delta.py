"""A Delta Lake table as a batch dataset, pinned to one version (``deltalake``).

URI: ``delta://PATH`` (a local path: ``delta:///lake/clicks``; any URL ``deltalake`` opens after
``delta://``). Option ``sr.version``: the table version (snapshot) to train; default the newest one
when the dataset is registered.

- **Pinned.** The data files of that version are listed once, at registration; a Delta data file is
  never rewritten (an update writes new files, a vacuum deletes old ones), so the dataset is fixed
  whatever is appended, updated or compacted later.
- **Sharded by data file and row group.** Each row group of each data file is a partition
  ``v{version}:{file}#rg{n}``, its positions row indexes (dense, as ``files.py``). The version is in
  every partition id, so it is in every cursor (and checkpoint manifest) that holds the table's records.
- **Refused** at registration, with what to do: a version that does not exist, a partitioned table
  (partition values live in the log, not the files: not read yet), deletion vectors and column mapping
  (rows and names the Parquet files alone do not give).
- **Followed** with ``sr.follow=true`` (and ``sr.version``, where to start): a *stream* dataset, the pinned
  version's row groups and then those of every version appended after it, named after that version
  (``delta_log.py``: appends only; a version that removes or rewrites rows stops it, said in status).
- A data file deleted (vacuumed) before its records were trained cannot be read: the worker's read
  raises :class:`~streamrover.sources.api.SourceNotFoundError`, and the dataset fails (or, with
  ``sr.on_data_loss=skip``, its records are counted lost), as for files.
"""

from __future__ import annotations

from collections.abc import Mapping

import pyarrow as pa
from deltalake import DeltaTable
from deltalake.exceptions import DeltaError, TableNotFoundError
from pydantic import ConfigDict, Field

from streamrover.sources.api import (
    Partition,
    Source,
    SourceError,
    SourceKind,
    SourceNotFoundError,
    SourceSchemaError,
    register_source,
)
from streamrover.sources.delta_log import DeltaLog
from streamrover.sources.options import OptionError, StreamPlanning
from streamrover.sources.table_files import TableSource, row_groups

_UNSUPPORTED = {"deletionVectors": "deletion vectors", "columnMapping": "column mapping"}


class DeltaOptions(StreamPlanning):
    """``delta://`` datasets (the stream planning options apply with ``sr.follow``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=False, hide_input_in_errors=True)

    version: int | None = Field(None, ge=0, alias="sr.version", description="a table version (default: the newest)")
    follow: bool = Field(
        False, alias="sr.follow", description="true or false (true: a stream of the versions appended after sr.version)"
    )


class DeltaSource(TableSource):
    """One version of a Delta table; partitions are its data files' row groups (module docstring)."""

    def __init__(self, uri: str, format: str = "", options: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self.uri = uri
        self.path = uri.removeprefix("delta://")
        self.options = DeltaOptions.parse(dict(options or {}), "Delta")
        if self.options.follow:
            if self.options.version is None:
                raise OptionError(
                    "sr.follow=true needs sr.version: the version to start from (its rows, then every version "
                    "appended after it)"
                )
            self.kind = SourceKind.STREAM
        self._log: DeltaLog | None = None
        self._parts: list[Partition] | None = None

    def _table(self) -> DeltaTable:
        try:
            table = DeltaTable(self.path, version=self.options.version)
        except TableNotFoundError as exc:
            raise SourceNotFoundError(f"no Delta table at {self.path!r}: {exc}") from exc
        except DeltaError as exc:  # a version the log does not hold
            raise SourceNotFoundError(
                f"cannot open version {self.options.version} of the Delta table {self.path!r}: {exc}"
            ) from exc
        if table.metadata().partition_columns:
            raise SourceError(
                f"Delta table {self.path!r} is partitioned by {', '.join(table.metadata().partition_columns)}: "
                "partitioned tables are not read yet (their partition values are not in the data files)"
            )
        features = set(table.protocol().reader_features or ())
        refused = sorted(name for key, name in _UNSUPPORTED.items() if key in features)
        if refused:
            raise SourceError(
                f"Delta table {self.path!r} uses {', '.join(refused)}: not read yet (the Parquet files alone do "
                "not give its rows); rewrite it without (OPTIMIZE with purge) or train another version"
            )
        return table

    def partitions(self) -> list[Partition]:
        if self._parts is None:
            table = self._table()
            version = table.version()
            parts: list[Partition] = []
            for path in sorted(table.file_uris()):
                schema, groups = row_groups(f"v{version}", path)
                if self._schema is None:
                    self._schema = schema
                elif not schema.equals(self._schema, check_metadata=False):
                    raise SourceSchemaError(f"Delta table {self.path!r} version {version}: {path!r} has another schema")
                parts += groups
            if self._schema is None:
                self._schema = pa.schema(table.schema().to_arrow())
            self._parts = parts
            if self.options.follow:
                self._log = DeltaLog(table.table_uri, version, self._schema)
        if self._log is not None:
            return self._parts + self._log.follow()
        return self._parts



def _factory(uri: str, format: str, options: Mapping[str, str]) -> Source:
    return DeltaSource(uri, format, options)


register_source(_factory, schemes=("delta",))
