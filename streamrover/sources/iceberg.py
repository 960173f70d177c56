"""An Iceberg table as a dataset, pinned to a snapshot or followed (``pyiceberg``).

URI: ``iceberg://NAMESPACE.TABLE``. The catalog is configured by the options that do not start with ``sr.``,
passed to ``pyiceberg.catalog.load_catalog`` as they are (``type=sql``, ``uri=sqlite:////lake/catalog.db``,
``warehouse=file:///lake``; a REST or Glue catalog's properties likewise); ``sr.catalog`` names it (default
``default``, also how pyiceberg finds it in ``~/.pyiceberg.yaml``).

- **Pinned** (``sr.snapshot=ID``; default the table's current snapshot when the dataset is registered): the
  snapshot's data files, listed once; an Iceberg data file is never rewritten, so the dataset is fixed
  whatever is committed later. **Sharded by data file and row group**: partitions ``s{snapshot}:FILE#rgK``
  (``table_files.py``), so the snapshot is in every cursor. Partitioned tables are read (Iceberg keeps the
  partition source columns in the data files).
- **Followed** (``sr.follow=true``, with ``sr.snapshot``): a *stream*: the pinned snapshot's files, then those
  each later snapshot of the table's main history *appends*, named after that snapshot. A ``replace``
  snapshot (compaction: the same rows rewritten) brings nothing new and is skipped; an ``overwrite`` or
  ``delete`` (rows changed), a snapshot that is not a child of the last one followed (a rollback), or a file
  with another schema stops the dataset there, said in status (rows trained cannot be un-trained). The table's
  metadata is loaded at most once a second (:data:`RELOAD_EVERY`).
- **Refused** at registration: a snapshot the table does not have, a missing table, delete files
  (positional or equality deletes: the data files alone do not give the rows; not read yet), data files
  whose schemas differ (schema evolution: not read yet).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from pydantic import ConfigDict, Field
from pyiceberg.catalog import load_catalog
from pyiceberg.exceptions import NoSuchTableError
from pyiceberg.manifest import ManifestEntryStatus

from streamrover.sources.api import (
    Partition,
    Source,
    SourceError,
    SourceKind,
    SourceNotFoundError,
    SourceSchemaError,
    register_source,
)
from streamrover.sources.options import PREFIX, OptionError, StreamPlanning
from streamrover.sources.table_files import TableSource, row_groups

RELOAD_EVERY = 1.0  # seconds: a followed table's metadata is loaded at most this often (a poll is every 100 ms)


class IcebergOptions(StreamPlanning):
    """``iceberg://`` datasets (the stream planning options apply with ``sr.follow``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=False, hide_input_in_errors=True)

    snapshot: int | None = Field(None, ge=0, alias="sr.snapshot", description="a snapshot id (default: the current)")
    follow: bool = Field(
        False, alias="sr.follow", description="true or false (true: a stream of the snapshots appended after it)"
    )
    catalog: str = Field("default", alias="sr.catalog", min_length=1, description="the catalog's name")


class IcebergSource(TableSource):
    """One snapshot of an Iceberg table, or the table followed from it (module docstring)."""

    def __init__(self, uri: str, format: str = "", options: Mapping[str, str] | None = None) -> None:
        super().__init__()
        opts = dict(options or {})
        self.options = IcebergOptions.parse(opts, "Iceberg")
        self.identifier = uri.removeprefix("iceberg://").strip("/")
        if "." not in self.identifier:
            raise SourceError(f"{uri!r}: name the table as iceberg://NAMESPACE.TABLE")
        if self.options.follow:
            if self.options.snapshot is None:
                raise OptionError("sr.follow=true needs sr.snapshot: the snapshot to start from")
            self.kind = SourceKind.STREAM
        self.properties = {k: v for k, v in opts.items() if not k.startswith(PREFIX)}
        self._catalog: Any = None
        self._parts: list[Partition] | None = None
        self._followed: int | None = None  # the last snapshot turned into partitions
        self._loaded = 0.0  # when the followed table was last loaded (time.monotonic)

    def _table(self) -> Any:
        if self._catalog is None:
            try:
                self._catalog = load_catalog(self.options.catalog, **self.properties)
            except Exception as exc:  # pyiceberg raises many kinds for a bad configuration
                raise SourceError(f"cannot load the Iceberg catalog {self.options.catalog!r}: {exc}") from exc
        try:
            return self._catalog.load_table(self.identifier)
        except NoSuchTableError as exc:
            raise SourceNotFoundError(f"no Iceberg table {self.identifier!r}: {exc}") from exc

    def _files_of(self, tag: str, paths: list[str]) -> list[Partition]:
        parts: list[Partition] = []
        for path in sorted(paths):
            schema, groups = row_groups(tag, path)
            if self._schema is None:
                self._schema = schema
            elif not schema.equals(self._schema, check_metadata=False):
                raise SourceSchemaError(
                    f"Iceberg table {self.identifier!r}: {path!r} has another schema than the table's other files "
                    "(schema evolution: not read yet)"
                )
            parts += groups
        return parts

    def partitions(self) -> list[Partition]:
        if self._parts is None:
            table = self._table()
            snap = table.snapshot_by_id(self.options.snapshot) if self.options.snapshot is not None else None
            if self.options.snapshot is not None and snap is None:
                raise SourceNotFoundError(f"Iceberg table {self.identifier!r} has no snapshot {self.options.snapshot}")
            snap = snap or table.current_snapshot()
            paths: list[str] = []
            if snap is not None:
                for task in table.scan(snapshot_id=snap.snapshot_id).plan_files():
                    if task.delete_files:
                        raise SourceError(
                            f"Iceberg table {self.identifier!r} snapshot {snap.snapshot_id} has delete files: not "
                            "read yet (the data files alone do not give its rows); compact it or train another snapshot"
                        )
                    paths.append(task.file.file_path)
            self._parts = self._files_of(f"s{snap.snapshot_id}" if snap else "s0", paths)
            if self._schema is None:
                from pyiceberg.io.pyarrow import schema_to_pyarrow

                self._schema = schema_to_pyarrow(table.schema(), include_field_ids=False)
            self._followed = snap.snapshot_id if snap is not None else None
        if self.kind is SourceKind.STREAM and time.monotonic() - self._loaded >= RELOAD_EVERY:
            self._follow(self._parts)
            self._loaded = time.monotonic()
        return self._parts

    def _follow(self, parts: list[Partition]) -> None:
        """Add to ``parts`` those of the snapshots committed after the last one followed (module docstring)."""
        table = self._table()
        current = table.current_snapshot()
        while current is not None and current.snapshot_id != self._followed:
            child = next((s for s in table.snapshots() if s.parent_snapshot_id == self._followed), None)
            on_main = {s.snapshot_id for s in table.history()} if child is not None else set()
            if child is None or child.snapshot_id not in on_main:
                raise SourceError(
                    f"Iceberg table {self.identifier!r}: its current snapshot {current.snapshot_id} does not descend "
                    f"from snapshot {self._followed} (rolled back?); sr.follow trains appended rows only"
                )
            operation = child.summary.operation.value if child.summary is not None else "unknown"
            if operation in ("overwrite", "delete"):
                raise SourceError(
                    f"Iceberg table {self.identifier!r} snapshot {child.snapshot_id} ({operation}) changes rows; "
                    "sr.follow trains appended rows only: register a new dataset pinned to a snapshot (sr.snapshot)"
                )
            if operation == "append":
                added = [
                    entry.data_file.file_path
                    for manifest in child.manifests(table.io)
                    if manifest.added_snapshot_id == child.snapshot_id
                    for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True)
                    if entry.status == ManifestEntryStatus.ADDED and entry.snapshot_id == child.snapshot_id
                ]
                parts += self._files_of(f"s{child.snapshot_id}", added)
            self._followed = child.snapshot_id  # replace (compaction): nothing new



def _factory(uri: str, format: str, options: Mapping[str, str]) -> Source:
    return IcebergSource(uri, format, options)


register_source(_factory, schemes=("iceberg",))
