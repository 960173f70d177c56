"""Spark Structured Streaming into training: ``df.writeStream.foreachBatch(training_sink(master, "clicks"))``.

Each micro-batch is written by Spark's executors as Parquet under the staging dir, at
``<staging_dir>/<query id>/driver/<batch id>/<attempt>/``, and its files are committed to the
staged dataset with ``CommitStaged`` keyed by (query id, "driver", batch id). Spark owns replay:
a query restarted from its checkpoint location runs again every batch whose end it did not
record, with the same id and the same data, so a batch whose commit already went through is
answered ``already_committed`` and adds nothing, and the master deletes the replay's files
(and those of an attempt that died before its commit). The query id is kept in the checkpoint,
so it names the same producer across restarts. Trainers lease the shards like any dataset's.

The dataset is registered on the first batch (uri ``staged://<dataset>``, the records' schema
declared from the first file Spark wrote) unless it exists already; a dataset registered
beforehand (for trainers that start first) must be a staged one.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import fsspec
import pyarrow.parquet as pq

from streamrover.shard_service.api import DatasetSpec, NotFoundError
from streamrover.shard_service.client import ShardClient
from streamrover.sources.staged import SCHEMA, STAGING_DIR, encode_schema, is_staged

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import DataFrame

log = logging.getLogger(__name__)
PART = "driver"  # one commit per micro-batch, made by the driver
QUERY_ID = "sql.streaming.queryId"  # the local property Spark sets to the query's id (kept in its checkpoint)


class SparkSinkError(RuntimeError):
    """The sink cannot commit a micro-batch (the dataset is of another kind, the query id is unknown...)."""


@dataclass
class SparkTrainingSink:
    """The ``foreachBatch`` function: stage the batch as Parquet, commit it once by (query id, batch id)."""

    master: str
    dataset: str
    staging_dir: str
    token: str | None = None
    records_per_shard: int = 0
    producer: str = ""  # default: the streaming query's id
    _client: ShardClient | None = field(default=None, init=False, repr=False)
    _ready: bool = field(default=False, init=False, repr=False)
    #: (batch id, records committed, already committed) of each batch this sink handled, for tests and logs
    history: list[tuple[int, int, bool]] = field(default_factory=list, init=False, repr=False)

    @property
    def client(self) -> ShardClient:
        """The client of the master (made on first use)."""
        if self._client is None:
            self._client = ShardClient(self.master, token=self.token, heartbeat=False, timeout=120)
        return self._client

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        producer = self.producer or self._query_id(df)
        attempt = f"{self.staging_dir.rstrip('/')}/{producer}/{PART}/{batch_id}/{uuid.uuid4().hex}"
        df.write.mode("error").parquet(attempt)
        files = written_files(attempt)
        if not self._ready:
            self._ensure_dataset(df, files)
        staged = [(uri, rows) for uri, rows in files if rows]
        # settled: Spark runs batch N+1 only once batch N's foreachBatch returned (its commit landed), so no
        # earlier batch is committed again but the ones committed: their other staging is garbage.
        # previous_epoch: batch ids are consecutive and every batch commits (an empty one too), so N-1 came
        # before N; the master shows (and, past sr.commit_gap_ms, fails on) a batch of the query never committed
        previous = batch_id - 1 if batch_id > 0 else None
        answer = self.client.commit_staged(self.dataset, producer, PART, batch_id, staged, settled=True,
                                           previous_epoch=previous)  # fmt: skip
        self.history.append((batch_id, answer.records, answer.already_committed))
        if answer.already_committed:
            log.info("batch %d of query %s was committed before (a replay): nothing added", batch_id, producer)

    @staticmethod
    def _query_id(df: DataFrame) -> str:
        query_id = df.sparkSession.sparkContext.getLocalProperty(QUERY_ID)
        if not query_id:
            raise SparkSinkError(
                f"no streaming query id ({QUERY_ID}) in this foreachBatch call; pass producer= to training_sink"
            )
        return str(query_id)

    def _ensure_dataset(self, df: DataFrame, files: list[tuple[str, int]]) -> None:
        """Register the staged dataset (schema from the batch's first file) unless it exists; check it is staged."""
        try:
            spec = self.client.describe_dataset(self.dataset, spec_only=True).spec
        except NotFoundError:
            if files:
                schema = pq.read_schema(files[0][0])
            else:  # Spark wrote no file (an empty batch): the Arrow form of the batch's Spark schema
                from pyspark.sql.pandas.types import to_arrow_schema

                schema = to_arrow_schema(df.schema)
            options = {STAGING_DIR: self.staging_dir, SCHEMA: encode_schema(schema)}
            uri = f"staged://{self.dataset}"
            self.client.register_dataset(DatasetSpec(self.dataset, uri, "parquet", options, self.records_per_shard))
        else:
            if not is_staged(spec.uri):
                raise SparkSinkError(
                    f"dataset {self.dataset!r} is registered with uri {spec.uri!r}, not as a staged dataset "
                    "(staged://...): remove it or choose another name"
                )
        self._ready = True

    def close(self) -> None:
        """Close the client of the master, if one was made."""
        if self._client is not None:
            self._client.close()
            self._client = None


def written_files(directory: str) -> list[tuple[str, int]]:
    """The Parquet files Spark wrote under ``directory`` (its part files), with their row counts, in name order."""
    fs, root = fsspec.core.url_to_fs(directory)
    out = []
    for path in sorted(fs.find(root)):
        name = path.rsplit("/", 1)[-1]
        if name.endswith(".parquet") and not name.startswith((".", "_")):
            url = path if fs.protocol in ("file", ("file", "local")) else fs.unstrip_protocol(path)
            with fs.open(path, "rb") as fh:
                out.append((url, int(pq.ParquetFile(fh).metadata.num_rows)))
    return out


def training_sink(
    master: str,
    dataset: str,
    *,
    staging_dir: str,
    token: str | None = None,
    records_per_shard: int = 0,
    producer: str = "",
) -> SparkTrainingSink:
    """A ``foreachBatch`` function that feeds ``dataset`` of the job master at ``master`` (host:port).

    ``staging_dir``: a directory (path or fsspec URL) both Spark's executors and the trainers can
    reach; each batch's files stay there until trained. ``token``: the job token (default: the
    ``STREAMROVER_TOKEN`` environment variable). ``producer``: the commit key's producer (default:
    the streaming query's id, which survives a restart from the checkpoint location).
    """
    if "://" not in staging_dir:
        staging_dir = os.path.abspath(staging_dir)
    return SparkTrainingSink(master, dataset, staging_dir, token, records_per_shard, producer)


__all__ = ["SparkSinkError", "SparkTrainingSink", "training_sink", "written_files"]
