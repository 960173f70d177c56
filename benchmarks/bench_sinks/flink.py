"""The Flink part of ``make bench`` ``sinks`` (benchmarks/bench_sinks/, issue 12): sink vs DiscardingSink.

A topic of JSON ``{id, x, y}`` records over 4 Kafka partitions (Apache Kafka 4.x, KRaft, tests/brokers) is
read by the PyFlink job of tests/sinks/flink_job.py (Flink's Kafka connector, a Python featurize map,
parallelism 2, a checkpoint every 500 ms) bounded to the topic's end, once sinking to
``streamrover.sinks.flink.TrainingSink`` (a real master, a staged dataset) and once to Flink's
``DiscardingSink``. Throughput is the steady state's, measured the same way for both sinks: the Python map
(the same in both jobs) writes ``<time> <records mapped>`` every 1,000 records per subtask (flink_job.py
``--progress``); the rate is the records mapped between the moment all subtasks together passed 10% of the
records and the moment they passed 90%, over those seconds. Backpressure ties the map to the sink: in the
steady state the map runs as fast as the sink takes its rows (what is buffered between them, at most a
bundle / a checkpoint interval of rows, is about the same at both ends of the window). What both jobs pay and
the goal is not about is left out: the JVM's, the Python workers' and the tasks' start-up, the Kafka source's
first fetches, and the bounded job's end (its last checkpoint, its shutdown). The sink's per-checkpoint work
(closing its files, moving them, the commit RPC) is inside the window. Nothing polls Flink's metrics (the
REST metric fetcher cost the JobManager ~15% of the JVM's samples in a profile, more for the job with more
operators). The job's net runtime (JobExecutionResult) is printed beside it. Goal: ratio >= 0.7.

Latency: for every checkpoint of the sink run, from its completion (the REST API's latest_ack_timestamp,
polled while the job runs) to a trainer leasing the first shard of its files: a client long-polls
LeaseShards (a commit wakes it) and acks what it gets at once. p50/p99/max; goal p99 <= 1 s.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks._common import environment, load, table
from benchmarks._servers import cpu_seconds

EPOCH = re.compile(r"/(\d+)/[^/]+\.parquet$")


def _window(flink: Any) -> float:
    """The finished job's net runtime (its JobExecutionResult, printed by flink_job.py), seconds; 0 if none."""
    found = re.findall(r"NET_RUNTIME_MS=(\d+)", (flink.workdir / f"flink-{flink.runs}.log").read_text(errors="replace"))
    return int(found[-1]) / 1000.0 if found else 0.0


def _progress(folder: Path) -> list[tuple[float, int]]:
    """(time, records mapped by every subtask so far) after each progress line the map subtasks wrote."""
    events: list[tuple[float, str, int]] = []
    for f in folder.glob("*.txt"):
        subtask = f.stem.split("-")[0]
        for line in f.read_text().splitlines():
            when, count = line.split()
            events.append((float(when), subtask, int(count)))
    latest: dict[str, int] = {}
    out = []
    for when_, subtask, count_ in sorted(events):
        latest[subtask] = count_
        out.append((when_, sum(latest.values())))
    return out


def _window_rate(samples: list[tuple[float, int]], records: int) -> tuple[float, float, float]:
    """(records/s, seconds, start) between the first samples at or past 10% and 90% of ``records``; 0s if none."""
    lo = next(((t, n) for t, n in samples if n >= 0.1 * records), None)
    hi = next(((t, n) for t, n in samples if n >= 0.9 * records), None)
    if lo is None or hi is None or hi[0] <= lo[0]:
        return 0.0, 0.0, 0.0
    return (hi[1] - lo[1]) / (hi[0] - lo[0]), hi[0] - lo[0], lo[0]


def _job_cpu(root: int) -> float:
    """CPU seconds (user + system) of a process and all its descendants: the driver, the JVM, the Python workers."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        try:
            total += cpu_seconds(pid)
        except OSError:  # gone since the listing
            pass
        todo.extend(children.get(pid, []))
    return total


def _at(samples: list[tuple[float, float]], when: float) -> float:
    """A sampled quantity at ``when``, linearly between the samples around it."""
    before = [s for s in samples if s[0] <= when] or samples[:1]
    after = [s for s in samples if s[0] >= when] or samples[-1:]
    (t0, v0), (t1, v1) = before[-1], after[0]
    return v0 if t1 <= t0 else v0 + (v1 - v0) * (when - t0) / (t1 - t0)


def _run(workdir: Path, jar: Path, bootstrap: str, topic: str, master: Any | None, records: int) -> dict[str, Any]:
    from tests.brokers._process import free_port
    from tests.sinks.flink import FlinkJob

    progress = workdir / "progress"
    progress.mkdir(parents=True, exist_ok=True)
    args = ["--bootstrap", bootstrap, "--topic", topic, "--bounded", "--progress", str(progress)]
    if master is None:
        args.append("--discard")
    else:
        args += ["--master", master.address, "--token", master.token, "--staging", str(workdir / "staging")]
    flink = FlinkJob(workdir, jar, args, free_port())
    checkpoints: dict[int, float] = {}
    seen: dict[int, float] = {}
    stop = threading.Event()

    def watch_dataset() -> None:
        """A trainer that leases as soon as it can: LeaseShards long-polls (a commit wakes it), acks at once."""
        from streamrover.shard_service import ShardClient

        assert master is not None
        with ShardClient(master.address, token=master.token, heartbeat=False) as trainer:
            while not stop.is_set():
                _, leased = trainer.lease("stream", max_shards=64, wait=0.5)
                now = time.time()
                for shard in leased:
                    m = EPOCH.search(shard.lease.partition.id)
                    if m:
                        seen.setdefault(int(m.group(1)), now)
                    shard.ack(shard.lease.end, wait=True)

    watcher = threading.Thread(target=watch_dataset, daemon=True) if master is not None else None
    flink.start()
    if watcher is not None:
        watcher.start()
    job_id = None
    window = 0.0
    cpu: list[tuple[float, float]] = []  # (time, CPU seconds of the job's processes)
    master_cpu: list[tuple[float, float]] = []
    try:
        while flink.alive():
            assert flink.proc is not None
            cpu.append((time.time(), _job_cpu(flink.proc.pid)))
            if master is not None and master.proc is not None:
                master_cpu.append((time.time(), cpu_seconds(master.proc.pid)))
            job_id = job_id or flink.job_id()
            if job_id:
                try:
                    for c in flink.checkpoint_history(job_id):
                        if c["status"] == "COMPLETED":
                            checkpoints[int(c["id"])] = c["latest_ack_timestamp"] / 1000.0
                except (OSError, ValueError, KeyError):
                    pass  # the REST endpoint not up yet, or gone with the finished job
            time.sleep(0.25)  # Flink keeps the last 10 checkpoints' history: 5 s at one per 500 ms
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
    samples = _progress(progress)
    rate, seconds, lo = _window_rate(samples, records)
    assert rate > 0, f"no steady-state window in the map's progress ({len(samples)} lines: {samples[-3:]})"
    hi = lo + seconds
    per = 1e6 / (rate * seconds)
    job_us = (_at(cpu, hi) - _at(cpu, lo)) * per
    master_us = (_at(master_cpu, hi) - _at(master_cpu, lo)) * per if master_cpu else 0.0
    return {"window": window, "latencies": latencies, "rate": rate, "seconds": seconds, "cpu": job_us,
            "master_cpu": master_us}  # fmt: skip


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
            baseline = _run(root / "discard", jar, broker.bootstrap, topic.topic, None, records)
            master = MasterProcess(root / "master")
            master.start()
            try:
                with ShardClient(master.address, token=master.token, heartbeat=False) as admin:
                    spec = DatasetSpec("stream", "staged://stream", format="parquet",
                                       options={"sr.staging_dir": str(root / "sink" / "staging"),
                                                "sr.schema": encode_schema(schema)})  # fmt: skip
                    admin.register_dataset(spec)
                    sink = _run(root / "sink", jar, broker.bootstrap, topic.topic, master, records)
                    total = admin.describe_dataset("stream").total_records
            finally:
                master.stop()
        finally:
            broker.stop(timeout=20)
    assert total == records, f"the dataset holds {total} records, {records} were produced"
    rate_discard, rate_sink = baseline["rate"], sink["rate"]
    lat = sorted(sink["latencies"])
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan")
    heads = ["flink job (parallelism 2)", "records", "net runtime s", "10-90% window s", "steady records/s",
             "job CPU us/rec", "master CPU us/rec"]  # fmt: skip
    print(table(heads, [
        ["DiscardingSink", records, baseline["window"], baseline["seconds"], rate_discard, baseline["cpu"], "-"],
        ["streamrover TrainingSink", records, sink["window"], sink["seconds"], rate_sink, sink["cpu"],
         sink["master_cpu"]],
    ]))  # fmt: skip
    print("CPU: user + system seconds of the job's processes (driver, JVM, Python workers) in the window, per record")
    print(
        f"steady-state throughput ratio (sink / discarding): {rate_sink / rate_discard:.2f}  (goal >= 0.7); "
        f"net runtimes' ratio {baseline['window'] / sink['window']:.2f} (start-up and the end included)"
    )
    print(f"load after: {load()}")
    if lat:
        print(f"checkpoint complete -> shards leasable, {len(lat)} checkpoints: p50 {statistics.median(lat):.3f} s, "
              f"p99 {p99:.3f} s, max {lat[-1]:.3f} s  (goal p99 <= 1 s)")  # fmt: skip
    else:
        print("checkpoint complete -> shards leasable: no checkpoint was seen committing")
    return 0
