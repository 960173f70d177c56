"""bench_streams [2]: Pulsar records/s through the shard path against a raw pulsar-client reader.

pulsar-lite (tests/brokers/pulsar.py) with one non-partitioned topic; records produced without
batching (pulsar-lite does not persist acks of batched messages; a position is then a message).
What pulsar-lite 0.2.0 allows, measured: its readers and consumers stop delivering a backlog at
random points and never resume (receiver queues of 100 and 1000, partitioned or not, readers,
Shared and Exclusive consumers); a new reader at the position reached goes on. On a partitioned
topic the shard path's master learns each partition's end by tailing the whole topic with one
reader (``routed``: pulsar-lite cannot look a partition up on its own) and that reader stalls
the same way, so planning waits: not measurable there yet. A non-partitioned topic is read
``direct`` (the master asks for the last message id), which is what this bench uses.

Both sides read the same way: a ``Reader`` from a message id with a receiver queue of 1000
(pulsar-client's default), dropping duplicate deliveries (pulsar-lite redelivers when readers
read a backlog) by message id, and, after 0.5 s without a new message while records are known
to be there, a new reader from the last message kept (the source's ``sr.reopen_ms``). The raw
peer is one reader in one process from the earliest message; it reads ``batch_size`` messages,
then does the per-batch work (count, value bytes), like the shard-path workers (2 processes,
shards of ``pulsar_records_per_shard`` messages).

Values are printable ASCII, like JSON records: pulsar-client 3.13 given a Python ``logging``
logger (what the source gave its client before) formats a DEBUG line per received message and,
when the value is not UTF-8, prints it to stdout, payload included. Both sides' clients log to
the console at WARN.
"""

from __future__ import annotations

import base64
import os
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks._common import CTX, processes
from benchmarks.bench_streams.pool import Pass, Pool, Result

TOPIC = "persistent://public/default/bench-throughput"
STALL = 10.0  # seconds without a new message after which a read fails (after re-opening its reader)
REOPEN = 0.5  # seconds without a new message after which a reader is re-opened where it stopped


def _quiet() -> Any:
    import pulsar

    return pulsar.ConsoleLogger(pulsar.LoggerLevel.Warn)


def pulsar_raw_pass(job: tuple[Any, ...], shared: Any) -> Result:
    import pulsar

    service_url, topic, expected, batch_size, deadline_s = job
    t0, c0 = time.monotonic(), time.process_time()
    deadline = t0 + deadline_s
    client = pulsar.Client(service_url, operation_timeout_seconds=10, logger=_quiet())
    records = nbytes = 0
    last = progress = t0
    reader = None
    try:
        reader = client.create_reader(topic, pulsar.MessageId.earliest, receiver_queue_size=1000)
        seen = (-1, -1, -1)  # (ledger, entry, batch index) last kept
        last_id = None
        batch: list[Any] = []
        quiet = time.monotonic()
        while records < expected:
            if time.monotonic() > deadline:
                raise TimeoutError(f"raw reader saw {records + len(batch)} of {expected} records")
            try:
                msg = reader.read_next(200)
            except pulsar.Timeout:
                now = time.monotonic()
                if now - progress > STALL:
                    raise TimeoutError(
                        f"the raw reader stalled: no new message for {STALL:.0f}s after {records + len(batch)} "
                        f"of {expected}"
                    ) from None
                if now - quiet > REOPEN:  # pulsar-lite stopped delivering: a new reader where this one stopped
                    reader.close()
                    start = pulsar.MessageId.earliest if last_id is None else last_id
                    reader = client.create_reader(topic, start, start_message_id_inclusive=True,
                                                  receiver_queue_size=1000)
                    quiet = now
                continue
            mid = msg.message_id()
            pos = (mid.ledger_id(), mid.entry_id(), mid.batch_index())
            quiet = time.monotonic()
            if pos <= seen:
                continue  # a duplicate delivery
            seen, last_id = pos, mid
            progress = quiet
            batch.append(msg)
            if len(batch) >= batch_size or records + len(batch) >= expected:
                records += len(batch)
                nbytes += sum(len(m.data()) for m in batch)
                batch = []
                last = time.monotonic()
    finally:
        end, cpu = time.monotonic(), time.process_time() - c0
        if reader is not None:
            reader.close()
        client.close()
    return Result(records, nbytes, t0, last, end, cpu)


def _produce(service_url: str, n: int, size: int) -> float:
    import pulsar

    client = pulsar.Client(service_url, operation_timeout_seconds=10, logger=_quiet())
    failed: list[str] = []

    def sent(result: Any, _msg_id: Any) -> None:
        if result != pulsar.Result.Ok:
            failed.append(str(result))

    payload = base64.b64encode(os.urandom(size))[:size]  # text: see the module docstring
    t0 = time.perf_counter()
    try:
        producer = client.create_producer(
            TOPIC, batching_enabled=False, block_if_queue_full=True,
            message_routing_mode=pulsar.PartitionsRoutingMode.RoundRobinDistribution,
        )
        for _ in range(n):
            producer.send_async(payload, sent)
        producer.flush()
        producer.close()
    finally:
        client.close()
    if failed:
        raise RuntimeError(f"{len(failed)} Pulsar sends failed: {failed[:3]}")
    return n / (time.perf_counter() - t0)


def bench_pulsar(tmp: Path, sizes: Any, profile_dir: str, extra: dict[str, str]) -> None:
    try:
        import streamrover.sources.pulsar  # noqa: F401
    except ImportError as exc:
        print(f"pulsar: source not available ({exc})")
        return
    from benchmarks.bench_streams.passes import PASS_DEADLINE, SHARD_IMPORTS, shard_pass
    from benchmarks.bench_streams.rounds import CpuMeter, _check, _shard_round, _throughput_table
    from tests.brokers.pulsar import PulsarLiteBroker

    sr_extra = {k: v for k, v in extra.items() if k.startswith("sr.")}  # librdkafka options are Kafka's
    broker = PulsarLiteBroker(tmp / "pulsar", default_partitions=0, log_level="warn")  # see the docstring
    broker.start()
    try:
        n = sizes.pulsar_records
        print(f"  pulsar-lite {broker.address} started in {broker.startup_seconds:.1f}s", flush=True)
        rate = _produce(broker.service_url, n, sizes.record_bytes)
        print(f"  produced {n:,} records (not batched) to a non-partitioned topic "
              f"at {rate:,.0f} records/s; {sizes.pulsar_records_per_shard:,} records/shard", flush=True)
        counter = CTX.Value("q", 0)
        raw = Pool(pulsar_raw_pass, 1, "pulsar-raw", imports=("pulsar",))
        imports = (*SHARD_IMPORTS[:-1], "streamrover.sources.pulsar")
        ours = Pool(shard_pass, 2, "pulsar-worker", shared=counter, imports=imports)
        uri = f"pulsar://{broker.address}/bench-throughput"
        # a stuck read fails after STALL seconds instead of the source's default 60
        options = {"sr.format": "raw", "sr.read_timeout_ms": str(int(STALL * 1000)),
                   "sr.reopen_ms": str(int(REOPEN * 1000)), **sr_extra}
        meter = CpuMeter(broker=broker.pid)
        runs: list[dict[str, Pass]] = []
        failed: dict[str, str] = {}
        with processes(raw.procs + ours.procs, grace=30):
            try:
                for r in range(sizes.rounds):
                    got: dict[str, Pass] = {}
                    for kind in (["raw1", "shard"] if r % 2 == 0 else ["shard", "raw1"]):
                        try:
                            if kind == "raw1":
                                meter.start()
                                job = (broker.service_url, TOPIC, n, sizes.batch_size, PASS_DEADLINE)
                                got[kind] = meter.stop(raw.run([job]))
                            else:
                                got[kind] = _shard_round(
                                    tmp, ours, counter, meter, uri, r, sizes, options,
                                    sizes.pulsar_records_per_shard, n, profile_dir, tag="pulsar",
                                )
                            _check(got[kind], n, sizes.record_bytes, f"pulsar round {r + 1} {kind}")
                            print(f"  round {r + 1}: {kind} {got[kind].rate:,.0f} rec/s", flush=True)
                        except RuntimeError as exc:  # measure the other reader all the same
                            failed[kind] = str(exc)
                            print(f"  round {r + 1}: {kind} FAILED: {exc}", flush=True)
                    if failed:
                        break  # a broker that cannot serve one reader is not worth more rounds
                    runs.append(got)
                    print(f"  round {r + 1}: ratio {got['shard'].rate / got['raw1'].rate:.2f}", flush=True)
            finally:
                raw.close()
                ours.close()
        if failed:
            raise RuntimeError("; ".join(f"{kind}: {why}" for kind, why in failed.items()))
        _throughput_table(runs, sizes.record_bytes, {
            "raw1": "raw pulsar-client Reader, 1 process",
            "shard": "shard path: master + 2 workers",
        })
        ratio = statistics.median(run["shard"].rate / run["raw1"].rate for run in runs)
        print(f"pulsar: shard path / raw reader = {ratio:.2f} (goal >= 0.8)")
    finally:
        broker.stop()
