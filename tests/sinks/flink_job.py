"""The PyFlink job of the sink tests and bench, run with the PyFlink venv's python (tests/sinks/flink.py).

Reads a Kafka topic of JSON ``{id, x, ...}`` records (Flink's Kafka connector), featurizes each in a
Python map into a named row ``(id, x, y = 3x + 1)`` and sinks the rows to a streamrover staged dataset
(``streamrover.sinks.flink.TrainingSink``), or to a ``DiscardingSink`` (``--discard``, the bench's
baseline). Checkpoints every ``--checkpoint-ms`` into ``--checkpoints``, retained on cancellation; a
fixed-delay restart strategy. ``--fail-after N``: the map raises once, in the first attempt to reach N
records in a subtask, after creating ``--fail-marker`` (so the restarted attempt goes on).
``--restore`` resumes from a retained checkpoint. ``--progress DIR``: each map subtask appends
``<time> <records mapped>`` to ``DIR/<subtask>-<attempt>.txt`` every 1,000 records (the bench's clock).
``--bounded``: read up to the topic's end at the start, then finish (the bench).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from pyflink.common import Configuration, Row, Types, WatermarkStrategy
from pyflink.common.serialization import SimpleStringSchema
from pyflink.datastream import MapFunction, RuntimeContext, StreamExecutionEnvironment
from pyflink.datastream.connectors.kafka import KafkaOffsetsInitializer, KafkaSource

PROGRESS_EVERY = 1000
ROW = Types.ROW_NAMED(["id", "x", "y"], [Types.LONG(), Types.DOUBLE(), Types.DOUBLE()])


class Featurize(MapFunction):  # type: ignore[misc]
    """JSON text -> (id, x, y = 3x + 1); optionally raises once after ``fail_after`` records."""

    def __init__(self, fail_after: int, marker: str, progress: str = "") -> None:
        self.fail_after = fail_after
        self.marker = marker
        self.progress = progress
        self.seen = 0
        self.out: Any = None

    def open(self, runtime_context: RuntimeContext) -> None:
        self.seen = 0
        if self.progress:  # the bench's clock: "<time> <records mapped>" every PROGRESS_EVERY records
            name = f"{runtime_context.get_index_of_this_subtask()}-{runtime_context.get_attempt_number()}.txt"
            self.out = open(os.path.join(self.progress, name), "a", buffering=1)

    def close(self) -> None:
        if self.out is not None:
            self.out.write(f"{time.time()} {self.seen}\n")
            self.out.close()

    def map(self, value: str) -> Row:
        self.seen += 1
        if self.out is not None and self.seen % PROGRESS_EVERY == 0:
            self.out.write(f"{time.time()} {self.seen}\n")
        if self.fail_after and self.seen >= self.fail_after and not os.path.exists(self.marker):
            with open(self.marker, "x") as f:
                f.write(f"raised after {self.seen} records\n")
            raise RuntimeError(f"injected failure after {self.seen} records")
        record = json.loads(value)
        x = float(record["x"])
        return Row(id=int(record["id"]), x=x, y=3.0 * x + 1.0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--jars", required=True, help="the Kafka connector's jars, os.pathsep-separated")
    p.add_argument("--checkpoints", required=True)
    p.add_argument("--checkpoint-ms", type=int, default=500)
    p.add_argument("--parallelism", type=int, default=2)
    p.add_argument("--master", default="")
    p.add_argument("--token", default="")
    p.add_argument("--dataset", default="stream")
    p.add_argument("--staging", default="")
    p.add_argument("--rest-port", type=int, default=0)
    p.add_argument("--fail-after", type=int, default=0)
    p.add_argument("--fail-marker", default="")
    p.add_argument("--restore", default="")
    p.add_argument("--bounded", action="store_true")
    p.add_argument("--discard", action="store_true")
    p.add_argument("--progress", default="", help="a folder: the map writes its progress there (the bench)")
    args = p.parse_args()

    conf = Configuration()
    conf.set_string("restart-strategy.type", "fixed-delay")
    conf.set_string("restart-strategy.fixed-delay.attempts", "5")
    conf.set_string("restart-strategy.fixed-delay.delay", "1 s")
    conf.set_string("execution.checkpointing.interval", f"{args.checkpoint_ms} ms")
    conf.set_string("execution.checkpointing.dir", f"file://{os.path.abspath(args.checkpoints)}")
    conf.set_string("execution.checkpointing.externalized-checkpoint-retention", "RETAIN_ON_CANCELLATION")
    conf.set_string("execution.checkpointing.num-retained", "2")
    conf.set_string("rest.bind-address", "127.0.0.1")
    conf.set_string("rest.address", "127.0.0.1")
    conf.set_string("rest.port", str(args.rest_port))
    conf.set_string("taskmanager.memory.process.size", "1g")
    conf.set_string("python.executable", sys.executable)
    if args.restore:
        conf.set_string("execution.state-recovery.path", args.restore)
    env = StreamExecutionEnvironment.get_execution_environment(conf)
    env.set_parallelism(args.parallelism)
    env.add_jars(*[f"file://{os.path.abspath(j)}" for j in args.jars.split(os.pathsep) if j])

    builder = (
        KafkaSource.builder()
        .set_bootstrap_servers(args.bootstrap)
        .set_topics(args.topic)
        .set_group_id("flink-sink-test")
        .set_starting_offsets(KafkaOffsetsInitializer.earliest())
        .set_value_only_deserializer(SimpleStringSchema())
    )
    if args.bounded:
        builder = builder.set_bounded(KafkaOffsetsInitializer.latest())
    raw = env.from_source(builder.build(), WatermarkStrategy.no_watermarks(), "kafka").uid("kafka")
    rows = raw.map(Featurize(args.fail_after, args.fail_marker, args.progress), output_type=ROW).uid("featurize")
    if args.discard:
        from pyflink.datastream.connectors import Sink
        from pyflink.java_gateway import get_gateway

        jvm = get_gateway().jvm
        rows.sink_to(Sink(jvm.org.apache.flink.streaming.api.functions.sink.v2.DiscardingSink())).uid("sink")
    else:
        from streamrover.sinks.flink import TrainingSink

        sink = TrainingSink(args.master, args.dataset, token=args.token, staging_dir=args.staging)
        rows.sink_to(sink).uid("sink")
    result = env.execute("streamrover-flink-sink-test")
    print(f"NET_RUNTIME_MS={result.get_net_runtime()}", flush=True)  # the bench reads it (bounded runs)


if __name__ == "__main__":
    main()
