"""Spark part of the ``sinks`` bench: Structured Streaming from Kafka through the training sink vs a counting peer.

One Spark session (local[2]) and one run: a real Kafka topic (tests/brokers/kafka.py) of ``--records``
``{id, x, y}`` JSON records over 4 partitions; two queries read all of it with the same featurizing
step (JSON parsed into columns) and ``maxOffsetsPerTrigger``, in alternating order over ``--rounds``,
after one untimed warm-up query of the peer's:

- peer: ``foreachBatch`` that only counts the batch (``df.count()``);
- sink: ``foreachBatch(training_sink(...))``: Spark writes the batch as Parquet into the staging dir,
  the driver commits the files to a real master (its own process) with ``CommitStaged``.

Throughput is each query's steady state, taken the same way for both from Spark's own progress reports
(``query.recentProgress``): the records of every batch after the first over the time from the first
batch's end to the last batch's end (a batch's end = its trigger timestamp + its batchDuration). The
query's start and its first batch (Kafka consumers, code generation, the JIT: paid by both) are left
out; every later batch's whole work is in (for the sink: Spark writing the Parquet files, the driver
reading their footers and the CommitStaged RPC). The ratio is sink records/s over peer records/s, the
median of the rounds' ratios (goal >= 0.7). The wall time from ``start()`` to ``processAllAvailable()``
returning is printed beside it. Trainers do not run: what is measured is what the sink adds to the job.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import environment, load, table


def _steady(progress: list[Any]) -> tuple[int, float]:
    """(records, seconds) of a query's batches after its first, from the first batch's end to the last's."""
    ends = []
    for p in sorted(progress, key=lambda p: p.batchId):
        start = datetime.fromisoformat(p.timestamp.replace("Z", "+00:00")).timestamp()
        ends.append((start + p.batchDuration / 1000.0, int(p.numInputRows)))
    if len(ends) < 2:
        return 0, 0.0
    return sum(n for _, n in ends[1:]), ends[-1][0] - ends[0][0]


def _query(
    spark: Any, bootstrap: str, topic: str, per_trigger: int, sink: Any, checkpoint: Path
) -> tuple[float, float]:
    """(wall seconds from start to processAllAvailable, steady-state records/s)."""
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
    records, seconds = _steady(query.recentProgress)
    query.stop()
    assert seconds > 0, f"fewer than two batches: no steady state to measure ({records} records after the first)"
    return elapsed, records / seconds


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks sinks --part spark")
    parser.add_argument("--records", type=int, default=400_000)
    parser.add_argument("--per-trigger", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a smoke-sized run (60k records, 4 batches, two rounds)")
    args, _ = parser.parse_known_args(argv)
    if args.quick:
        args.records, args.per_trigger, args.rounds = 60_000, 15_000, 2
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
                rates: dict[str, float] = {}
                order = ["peer", "sink"] if r % 2 == 0 else ["sink", "peer"]
                for kind in order:
                    if kind == "peer":
                        counted.clear()
                        times[kind], rates[kind] = _query(
                            spark, broker.bootstrap, topic.topic, args.per_trigger, count_only, work / f"ck-peer-{r}"
                        )
                        assert sum(counted) == args.records, f"the peer counted {sum(counted)} records"
                    else:
                        sink = training_sink(
                            master.address, f"clicks-{r}", staging_dir=str(work / f"staging-{r}"), token=master.token
                        )
                        times[kind], rates[kind] = _query(
                            spark, broker.bootstrap, topic.topic, args.per_trigger, sink, work / f"ck-sink-{r}"
                        )
                        committed = sum(n for _, n, again in sink.history if not again)
                        assert committed == args.records, f"the sink committed {committed} records"
                        sink.close()
                peer, mine = rates["peer"], rates["sink"]
                ratios.append(mine / peer)
                wall = f"{times['peer']:.1f} / {times['sink']:.1f}"
                rows.append([r, f"{peer:,.0f}", f"{mine:,.0f}", f"{mine / peer:.2f}", wall])
            heads = ["round", "peer steady rec/s (count)", "sink steady rec/s", "ratio", "wall s peer / sink"]
            print(table(heads, rows))
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
