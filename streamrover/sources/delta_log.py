"""Following a Delta table (``sr.follow=true``): each version appended after the pinned one is new data.

A followed table is a *stream* dataset: its partitions are the pinned version's data files' row groups
(``v{pinned}:FILE#rgK``) and then, version by version, the row groups of the files each later version
*adds with new data*, named after that version (``v{N}:FILE#rgK``). Ids depend only on the table's log, so
a master restarted at any point lists the same partitions, and the version that brought a record in is
in every cursor that holds it.

What a later version may do, read from its commit in ``_delta_log/`` (``{N:020d}.json``):

- **append** (adds with ``dataChange: true``, no removes with it): its files become new partitions;
- **rearrange** (adds and removes with ``dataChange: false``: OPTIMIZE, compaction): nothing new, skipped;
- **change or remove rows** (a remove with ``dataChange: true``: DELETE, UPDATE, MERGE, overwrite),
  **change the schema**, or **write deletion vectors**: refused. The dataset stops at the version before and
  every poll reports why (status, ``streamrover dataset describe``): rows trained already cannot be
  un-trained, so a table that is rewritten is pinned instead (a new dataset at a version).

A poll only checks whether the next commit file exists (one ``exists`` per poll), and reads it when it does.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import unquote

import fsspec
import pyarrow as pa

from streamrover.sources.api import Partition, SourceError, SourceSchemaError, SourceUnavailableError
from streamrover.sources.table_files import row_groups


class DeltaLog:
    """The commits of one Delta table after version ``pinned``, turned into partitions (module docstring)."""

    def __init__(self, table_uri: str, pinned: int, schema: pa.Schema) -> None:
        self.fs, root = fsspec.core.url_to_fs(table_uri)
        self.root = root.rstrip("/")
        self.table_uri = table_uri
        self.schema = schema
        self.version = pinned  # the newest version turned into partitions
        self.partitions: list[Partition] = []  # those of the versions after ``pinned``, in log order

    def _commit(self, version: int) -> list[dict[str, Any]] | None:
        path = f"{self.root}/_delta_log/{version:020d}.json"
        try:
            if not self.fs.exists(path):
                return None
            with self.fs.open(path, "rb") as fh:
                return [json.loads(line) for line in fh.read().decode().splitlines() if line.strip()]
        except OSError as exc:
            raise SourceUnavailableError(
                f"cannot read version {version} of the Delta table {self.table_uri!r}: {exc}"
            ) from exc

    def follow(self) -> list[Partition]:
        """Turn every version committed since the last call into partitions; returns all of them so far.

        Raises :class:`SourceError` at a version that changes or removes rows, the schema, or writes deletion
        vectors (the versions before it are kept: a later poll reports the same error).
        """
        while True:
            actions = self._commit(self.version + 1)
            if actions is None:
                return self.partitions
            self.partitions += self._appended(self.version + 1, actions)
            self.version += 1

    def _appended(self, version: int, actions: list[dict[str, Any]]) -> list[Partition]:
        info: dict[str, Any] = next((a["commitInfo"] for a in actions if "commitInfo" in a), {})
        what = f"version {version} of the Delta table {self.table_uri!r} ({info.get('operation', 'an operation')})"
        refuse = "; sr.follow trains appended rows only: register a new dataset pinned to a version (sr.version)"
        if any("metaData" in a for a in actions):
            raise SourceSchemaError(f"{what} changes the table's metadata (schema, partitioning){refuse}")
        if any(a.get("remove", {}).get("dataChange", True) for a in actions if "remove" in a):
            raise SourceError(f"{what} removes or rewrites rows{refuse}")
        adds = [a["add"] for a in actions if "add" in a and a["add"].get("dataChange", True)]
        out: list[Partition] = []
        for add in sorted(adds, key=lambda x: str(x["path"])):
            if add.get("deletionVector"):
                raise SourceError(f"{what} writes deletion vectors (not read yet){refuse}")
            if add.get("partitionValues"):
                raise SourceError(f"{what} writes a partitioned file (not read yet){refuse}")
            path = unquote(str(add["path"]))
            if "://" not in path:  # relative to the table (absolute paths are rare: shallow clones)
                path = path if path.startswith("/") else f"{self.root}/{path}"
                if not self.table_uri.startswith("file:"):  # s3://..., as the pinned table's file_uris() names it
                    path = self.fs.unstrip_protocol(path)
            schema, groups = row_groups(f"v{version}", path)
            if not schema.equals(self.schema, check_metadata=False):
                raise SourceSchemaError(f"{what}: {path!r} has another schema than the table's{refuse}")
            out += groups
        return out
