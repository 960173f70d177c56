"""The Flink part of ``make bench`` ``sinks`` (benchmarks/bench_sinks.py, issue 12): sink vs DiscardingSink.

A topic of JSON ``{id, x, y}`` records over 4 Kafka partitions (Apache Kafka 4.x, KRaft, tests/brokers) is
read by the PyFlink job of tests/sinks/flink_job.py (Flink's Kafka connector, a Python featurize map,
parallelism 2, a checkpoint every 500 ms) bounded to the topic's end, once sinking to
``streamrover.sinks.flink.TrainingSink`` (a real master, a staged dataset) and once to Flink's
``DiscardingSink``. Time: the job's net runtime (its JobExecutionResult: the JVM's and the client's start-up
are left out, the tasks' deployment and the sink's last commit are in). Goal: ratio >= 0.7.

Latency: for every checkpoint of the sink run, from its completion (the REST API's latest_ack_timestamp,
polled while the job runs) to its files being partitions of the dataset with leasable shards (DescribeDataset
polled every 10 ms). p50/p99/max; goal p99 <= 1 s.
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks._common import environment, load, table

EPOCH = re.compile(r"/(\d+)/[^/]+\.parquet$")


def _window(flink: Any) -> float:
    """The finished job's net runtime (its JobExecutionResult, printed by flink_job.py), seconds; 0 if none."""
    found = re.findall(r"NET_RUNTIME_MS=(\d+)", (flink.workdir / f"flink-{flink.runs}.log").read_text(errors="replace"))
    return int(found[-1]) / 1000.0 if found else 0.0


def _run(workdir: Path, jar: Path, bootstrap: str, topic: str, master: Any | None) -> dict[str, Any]:
    from tests.brokers._process import free_port
    from tests.sinks.flink import FlinkJob

    args = ["--bootstrap", bootstrap, "--topic", topic, "--bounded"]
    if master is None:
        args.append("--discard")
    else:
        args += ["--master", master.address, "--token", master.token, "--staging", str(workdir / "staging")]
    flink = FlinkJob(workdir, jar, args, free_port())
    checkpoints: dict[int, float] = {}
    seen: dict[int, float] = {}
    stop = threading.Event()

    def watch_dataset() -> None:
        from streamrover.shard_service import ShardClient

        assert master is not None
        with ShardClient(master.address, token=master.token, heartbeat=False) as admin:
            while not stop.is_set():
                now = time.time()
                for part in admin.describe_dataset("stream").partitions:
                    m = EPOCH.search(part.id)
                    if m:
                        seen.setdefault(int(m.group(1)), now)
                time.sleep(0.01)

    watcher = threading.Thread(target=watch_dataset, daemon=True) if master is not None else None
    flink.start()
    if watcher is not None:
        watcher.start()
    job_id = None
    window = 0.0
    try:
        while flink.alive():
            job_id = job_id or flink.job_id()
            if job_id:
                try:
                    for c in flink.checkpoint_history(job_id):
                        if c["status"] == "COMPLETED":
                            checkpoints[int(c["id"])] = c["latest_ack_timestamp"] / 1000.0
                except OSError:
                    pass
            time.sleep(0.1)
        assert flink.proc is not None
        flink.proc.wait()
        window = _window(flink)
        deadline = time.time() + 5
        while master is not None and time.time() < deadline and not set(checkpoints) <= set(seen):
            time.sleep(0.05)
    finally:
        stop.set()
        flink.kill()
    assert window > 0, f"the Flink job did not finish\n{flink.logs()}"
    latencies = [seen[c] - t for c, t in checkpoints.items() if c in seen]
    return {"window": window, "latencies": latencies}


def main(argv: list[str]) -> int:
    """Runs the Flink sink bench and prints its table."""
    parser = argparse.ArgumentParser(prog="bench sinks (flink)")
    parser.add_argument("--quick", action="store_true", help="a smoke-sized run")
    parser.add_argument("--records", type=int, default=0)
    args, _ = parser.parse_known_args(argv)
    records = args.records or (50_000 if args.quick else 300_000)

    import numpy as np
    import pyarrow as pa

    from streamrover.shard_service import DatasetSpec, ShardClient
    from streamrover.sources.staged import encode_schema
    from streamrover.testing.procs import MasterProcess
    from tests.brokers.kafka import KafkaBroker
    from tests.sinks.flink import build_sink
    from tests.trainers.streams import KafkaTopic

    print(environment())
    print(f"load: {load()}")
    jar = build_sink()
    schema = pa.schema([("id", pa.int64()), ("x", pa.float64()), ("y", pa.float64())])
    with tempfile.TemporaryDirectory(prefix="bench-sinks-flink-") as tmp:
        root = Path(tmp)
        broker = KafkaBroker(root / "kafka")
        broker.start()
        try:
            topic = KafkaTopic(broker)
            topic.produce(np.arange(records))
            baseline = _run(root / "discard", jar, broker.bootstrap, topic.topic, None)
            master = MasterProcess(root / "master")
            master.start()
            try:
                with ShardClient(master.address, token=master.token, heartbeat=False) as admin:
                    spec = DatasetSpec("stream", "staged://stream", format="parquet",
                                       options={"sr.staging_dir": str(root / "sink" / "staging"),
                                                "sr.schema": encode_schema(schema)})  # fmt: skip
                    admin.register_dataset(spec)
                    sink = _run(root / "sink", jar, broker.bootstrap, topic.topic, master)
                    total = admin.describe_dataset("stream").total_records
            finally:
                master.stop()
        finally:
            broker.stop(timeout=20)
    assert total == records, f"the dataset holds {total} records, {records} were produced"
    rate_discard, rate_sink = records / baseline["window"], records / sink["window"]
    lat = sorted(sink["latencies"])
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan")
    print(table(["flink job (parallelism 2)", "records", "seconds", "records/s"], [
        ["DiscardingSink", records, baseline["window"], rate_discard],
        ["streamrover TrainingSink", records, sink["window"], rate_sink],
    ]))  # fmt: skip
    print(f"throughput ratio (sink / discarding): {rate_sink / rate_discard:.2f}  (goal >= 0.7)")
    if lat:
        print(f"checkpoint complete -> shards leasable, {len(lat)} checkpoints: p50 {statistics.median(lat):.3f} s, "
              f"p99 {p99:.3f} s, max {lat[-1]:.3f} s  (goal p99 <= 1 s)")  # fmt: skip
    else:
        print("checkpoint complete -> shards leasable: no checkpoint was seen committing")
    return 0
