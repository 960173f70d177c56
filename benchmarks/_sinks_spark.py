"""Spark part of the ``sinks`` bench: Structured Streaming from Kafka through the training sink vs a counting peer.

One Spark session (local[2]) and one run: a real Kafka topic (tests/brokers/kafka.py) of ``--records``
``{id, x, y}`` JSON records over 4 partitions; two queries read all of it with the same featurizing
step (JSON parsed into columns) and ``maxOffsetsPerTrigger``, in alternating order over ``--rounds``,
after one untimed warm-up query of the peer's:

- peer: ``foreachBatch`` that only counts the batch (``df.count()``);
- sink: ``foreachBatch(training_sink(...))``: Spark writes the batch as Parquet into the staging dir,
  the driver commits the files to a real master (its own process) with ``CommitStaged``.

Each query's clock runs from ``start()`` to ``processAllAvailable()`` returning. The ratio is
sink records/s over peer records/s, the median of the rounds' ratios (goal >= 0.7). Trainers do not
run: what is measured is what the sink adds to the Spark job.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import environment, load, table


def _query(spark: Any, bootstrap: str, topic: str, per_trigger: int, sink: Any, checkpoint: Path) -> float:
    from tests.sinks.spark_job import features

    start = time.perf_counter()
    query = (
        features(spark, bootstrap, topic, per_trigger)
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(checkpoint))
        .start()
    )
    query.processAllAvailable()
    elapsed = time.perf_counter() - start
    query.stop()
    return elapsed


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks sinks --part spark")
    parser.add_argument("--records", type=int, default=400_000)
    parser.add_argument("--per-trigger", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a smoke-sized run (50k records, two rounds)")
    args, _ = parser.parse_known_args(argv)
    if args.quick:
        args.records, args.per_trigger, args.rounds = 50_000, 25_000, 2
    print(environment())
    print(f"load before: {load()}")

    from streamrover.sinks.spark import training_sink
    from streamrover.testing.procs import MasterProcess
    from tests.brokers.kafka import KafkaBroker
    from tests.sinks.spark_job import session
    from tests.trainers.streams import KafkaTopic

    with tempfile.TemporaryDirectory(prefix="bench-sinks-spark-") as tmp:
        work = Path(tmp)
        broker = KafkaBroker(work / "kafka")
        broker.start()
        master = MasterProcess(work / "master")
        master.start()
        spark = session("streamrover-bench-sinks")
        try:
            topic = KafkaTopic(broker)
            topic.produce(np.arange(args.records))
            counted: list[int] = []

            def count_only(df: Any, batch_id: int) -> None:
                counted.append(df.count())

            # warm-up, not timed: the JVM's first query pays class loading, JIT and the Kafka clients' set-up
            _query(spark, broker.bootstrap, topic.topic, args.per_trigger, count_only, work / "ck-warm-up")
            rows: list[list[Any]] = []
            ratios = []
            for r in range(args.rounds):
                times: dict[str, float] = {}
                order = ["peer", "sink"] if r % 2 == 0 else ["sink", "peer"]
                for kind in order:
                    if kind == "peer":
                        counted.clear()
                        times[kind] = _query(
                            spark, broker.bootstrap, topic.topic, args.per_trigger, count_only, work / f"ck-peer-{r}"
                        )
                        assert sum(counted) == args.records, f"the peer counted {sum(counted)} records"
                    else:
                        sink = training_sink(
                            master.address, f"clicks-{r}", staging_dir=str(work / f"staging-{r}"), token=master.token
                        )
                        times[kind] = _query(
                            spark, broker.bootstrap, topic.topic, args.per_trigger, sink, work / f"ck-sink-{r}"
                        )
                        committed = sum(n for _, n, again in sink.history if not again)
                        assert committed == args.records, f"the sink committed {committed} records"
                        sink.close()
                peer, mine = args.records / times["peer"], args.records / times["sink"]
                ratios.append(mine / peer)
                rows.append([r, f"{peer:,.0f}", f"{mine:,.0f}", f"{mine / peer:.2f}"])
            print(table(["round", "peer rec/s (count)", "sink rec/s", "ratio"], rows))
            ratio = statistics.median(ratios)
            verdict = "meets" if ratio >= 0.7 else "MISSES"
            print(f"spark sink / counting foreachBatch: {ratio:.2f} (goal >= 0.7: {verdict}); "
                  f"{args.records:,} records, {args.per_trigger:,} per batch")  # fmt: skip
            print(f"load after: {load()}")
        finally:
            spark.stop()
            master.stop()
            broker.stop(timeout=20)
    return 0
