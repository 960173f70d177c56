"""``streamrover.sinks.flink``: a PyFlink job's records become a streamrover staged dataset, exactly once.

::

    ds = env.from_source(kafka, ...).map(featurize, output_type=Types.ROW_NAMED(["id", "x", "y"], [...]))
    ds.sink_to(TrainingSink("127.0.0.1:50051", "clicks", token=token, staging_dir="/shared/staging"))

The sink is Java (PyFlink has no Python sink or checkpoint hook): ``java/flink-sink/``, a Sink V2 with a
committer. At each checkpoint every subtask closes its Parquet file(s) under ``<staging_dir>/<job
id>/<subtask>/<checkpoint id>/``; when the checkpoint completes the committer registers them with the master's
``CommitStaged`` RPC, keyed by (job id, subtask, checkpoint id), so a commit replayed after a restore, or
retried after its answer was lost, is a no-op. A writer restored from checkpoint K deletes its own
``<checkpoint id>`` folders above K: a failed attempt staged them and no commit can claim them. Records reach
Java in Flink's own row serialization: the stream's declared row type is the schema, nothing is pickled.
Checkpointing must be on (without it Flink never commits). The dataset must be registered first with uri
``staged://<name>``, format ``parquet``, option ``sr.staging_dir`` set to the same ``staging_dir`` and option
``sr.schema`` (the rows' Arrow schema, ``streamrover.sources.staged.encode_schema``: trainers need it before
the first file is committed).

The jar is built by ``make flink-sink`` (``scripts/build-flink-sink.sh``) into
``~/.cache/streamrover/flink-sink/``; ``STREAMROVER_FLINK_SINK_JAR`` names another one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

JAR_ENV = "STREAMROVER_FLINK_SINK_JAR"
JAR_NAME = "streamrover-flink-sink.jar"


def sink_jar() -> Path:
    """The built sink jar: ``$STREAMROVER_FLINK_SINK_JAR`` or the one ``make flink-sink`` caches."""
    named = os.environ.get(JAR_ENV)
    if named:
        path = Path(named)
    else:
        cache = Path(os.environ.get("STREAMROVER_CACHE") or Path.home() / ".cache" / "streamrover")
        path = cache / "flink-sink" / JAR_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"the streamrover Flink sink jar is not at {path}: build it with `make flink-sink` "
            f"(scripts/build-flink-sink.sh) or set {JAR_ENV}"
        )
    return path


def _java_sink_class() -> Any:
    from pyflink.java_gateway import get_gateway
    from pyflink.util.java_utils import add_jars_to_context_class_loader

    add_jars_to_context_class_loader([sink_jar().resolve().as_uri()])
    return get_gateway().jvm.streamrover.flink.TrainingSink


def TrainingSink(  # a function named as the sink it makes: ds.sink_to(TrainingSink(...))
    master: str,
    dataset: str,
    *,
    token: str,
    staging_dir: str,
    rows_per_file: int = 1_000_000,
    retry_seconds: int = 60,
) -> Any:
    """A PyFlink ``Sink`` committing the stream's rows to ``dataset`` on the master at ``master`` (host:port).

    ``staging_dir`` is an absolute path or ``file://`` URL every trainer can read. A checkpoint closes each
    subtask's open file; ``rows_per_file`` caps a file in between. A commit that fails with a transient
    gRPC status (the master down, killed mid-call, restarting: ``Retry.java``) is retried for
    ``retry_seconds``, then handed back to Flink, which calls the committer again up to
    ``sink.committer.retries`` times and then fails the job; a final status (a staged file gone, the
    dataset failed, a wrong token) fails the job at once. Either way the restart commits the checkpoint
    again: a commit is never dropped. The stream must carry named rows
    (``output_type=Types.ROW_NAMED(...)``): BIGINT, INT, DOUBLE, FLOAT, BOOLEAN, STRING, BYTES fields or
    arrays of the numeric ones.
    """
    if rows_per_file <= 0:
        raise ValueError(f"rows_per_file must be > 0, not {rows_per_file}")
    if not (staging_dir.startswith("file:///") or os.path.isabs(staging_dir)):
        raise ValueError(
            f"staging_dir must be an absolute local path or a file:// URL every trainer can read, not {staging_dir!r}"
        )
    if not master or not dataset:
        raise ValueError(f"TrainingSink needs a master address and a dataset name (got {master!r}, {dataset!r})")
    from pyflink.datastream.connectors import Sink

    j_sink = _java_sink_class()(master, dataset, token, staging_dir, int(rows_per_file), int(retry_seconds))
    return Sink(j_sink)
