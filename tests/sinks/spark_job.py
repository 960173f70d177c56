"""A Spark Structured Streaming job, Kafka -> featurize -> the streamrover training sink, run as its own process.

Records are the trainers' ``{id, x, y}`` JSON (tests/trainers/streams.py). The job processes
everything the topic holds, then stops (exit 0). ``--die-after-staging B`` / ``--die-after-commit B``
SIGKILL the driver (its Python process and its JVM: the whole process group) in batch B right
after Spark wrote the batch's files (before the commit) or right after the commit was answered
(before Spark recorded the batch as done); started again with the same checkpoint location, the
query goes on from its checkpoint.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
from pathlib import Path
from typing import Any


def connector_jars(cache: Path | None = None) -> list[str]:
    """spark-sql-kafka and the jars it needs that the pyspark package does not ship (make jars fetches them)."""
    import pyspark

    root = cache or Path(os.environ.get("STREAMROVER_CACHE", Path.home() / ".cache/streamrover")) / "jars"
    fetched = root / f"spark-{pyspark.__version__}"
    if not (fetched / ".complete").exists():
        raise FileNotFoundError(f"no Spark Kafka connector jars in {fetched}: run `make jars` (scripts/fetch-jars.sh)")
    shipped = {_artifact(p.name) for p in (Path(pyspark.__file__).parent / "jars").glob("*.jar")}
    return sorted(str(p) for p in fetched.glob("*.jar") if _artifact(p.name) not in shipped)


def _artifact(jar: str) -> str:
    return re.sub(r"-\d[^-]*(-[A-Za-z0-9.]+)?\.jar$", "", jar)


def session(app: str) -> Any:
    """A local[2] session bound to 127.0.0.1, with the Kafka connector."""
    from pyspark.sql import SparkSession

    return (
        SparkSession.builder.master("local[2]")
        .appName(app)
        .config("spark.jars", ",".join(connector_jars()))
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.memory", "768m")
        .config("spark.hadoop.mapreduce.fileoutputcommitter.marksuccessfuljobs", "false")
        .config("spark.sql.parquet.compression.codec", "snappy")
        # Spark 4.1.1's Kafka micro-batch stream (V2) fails a query restarted from its checkpoint: its metrics
        # read offsets it has not fetched yet (NullPointerException in KafkaMicroBatchStream.metrics, Spark issue
        # 55236, SPARK-55271). The V1 Kafka source reads the same offsets and has no such metrics.
        .config("spark.sql.streaming.disabledV2MicroBatchReaders", "org.apache.spark.sql.kafka010.KafkaSourceProvider")
        .getOrCreate()
    )


def features(spark: Any, bootstrap: str, topic: str, per_trigger: int) -> Any:
    """The topic's JSON records parsed into columns (the featurizing step of a real job)."""
    from pyspark.sql import functions as F

    raw = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", str(per_trigger))
        .load()
    )
    parsed = raw.select(F.from_json(F.col("value").cast("string"), "id LONG, x DOUBLE, y DOUBLE").alias("r"))
    return parsed.select("r.id", "r.x", "r.y")


def _die() -> None:
    os.killpg(os.getpgid(0), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--master", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--dataset", default="stream")
    parser.add_argument("--staging", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--per-trigger", type=int, default=1000)
    parser.add_argument("--records-per-shard", type=int, default=500)
    parser.add_argument("--die-after-staging", type=int, default=-1)
    parser.add_argument("--die-after-commit", type=int, default=-1)
    args = parser.parse_args()

    from streamrover.sinks.spark import training_sink

    spark = session("streamrover-sink-test")
    sink = training_sink(
        args.master, args.dataset, staging_dir=args.staging, token=args.token, records_per_shard=args.records_per_shard
    )
    commit = sink.client.commit_staged

    def commit_or_die(dataset: str, producer: str, part: str, epoch: int, files: Any, **how: Any) -> Any:
        if epoch == args.die_after_staging:
            _die()
        answer = commit(dataset, producer, part, epoch, files, **how)  # settled, previous_epoch
        if epoch == args.die_after_commit:
            _die()
        return answer

    sink.client.commit_staged = commit_or_die  # type: ignore[method-assign]
    query = (
        features(spark, args.bootstrap, args.topic, args.per_trigger)
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", args.checkpoint)
        .start()
    )
    query.processAllAvailable()
    query.stop()
    print(f"batches {sink.history}", flush=True)
    sink.close()
    spark.stop()


if __name__ == "__main__":
    main()
