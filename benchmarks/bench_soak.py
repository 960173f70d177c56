"""Soak: leases, acks, checkpoint cuts, restores and key-value churn on a live stream for minutes (issue 15, item 10).

Not a test: it shows whether anything the master keeps grows with time. A producer writes a
Kafka topic (Kafka 4, KRaft, from tests/brokers; ``--broker tansu`` for tansu) at a steady rate;
the master plans shards as records arrive;
worker threads lease shards and ack them (a progress ack, then the end: the master's load,
without reading the records, which never pass through the master anyway); a coordinator takes
and commits a cut every ``--cut-every`` seconds (the compaction a checkpointing job drives),
restores the last cut every ``--restore-every`` seconds, and sets and deletes rendezvous-style
keys. The master's RSS and journal size (db + WAL) are sampled after a warm-up and at intervals;
the ratio end / start is the figure (the peer is the same master minutes earlier).

``python -m benchmarks soak --duration 600`` (default 600 s; ``--quick``: 30 s).
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil

from benchmarks._common import environment, load, table
from streamrover.shard_service import DatasetSpec, ShardClient, ShardServiceError
from streamrover.testing.procs import MasterProcess


def _journal_bytes(state: Path) -> int:
    return sum(p.stat().st_size for p in state.glob("journal.db*") if p.is_file())


class _Counters:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.acks = 0
        self.refused = 0
        self.produced = 0
        self.cuts = 0
        self.restores = 0


def _produce(bootstrap: str, topic: str, rate: int, stop: threading.Event, counters: _Counters) -> None:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    t0, sent = time.monotonic(), 0
    while not stop.is_set():
        due = int((time.monotonic() - t0) * rate)
        try:
            while sent < due:
                producer.produce(topic, value=f"r{sent}".encode())
                sent += 1
        except BufferError:  # the broker is behind (a busy machine): produce less, never die
            pass
        producer.poll(0)
        with counters.lock:
            counters.produced = sent
        stop.wait(0.02)  # the production rate, not synchronisation
    producer.flush(10)


def _work(address: str, token: str, stop: threading.Event, counters: _Counters) -> None:
    with ShardClient(address, token=token, name="soak", timeout=30) as client:
        client.join()
        while not stop.is_set():
            try:
                _, leases = client.lease("soak", max_shards=2, wait=1.0)
                for shard in leases:
                    lease = shard.lease
                    mid = lease.resume + (lease.end - lease.resume) // 2
                    if lease.resume < mid < lease.end:
                        client.ack(lease, mid, wait=True)
                    client.ack(lease, lease.end, wait=True)
                    with counters.lock:
                        counters.acks += 2
            except ShardServiceError:  # a lease revoked by a restore: refused, as it must be
                with counters.lock:
                    counters.refused += 1


def _coordinate(
    address: str, token: str, cut_every: float, restore_every: float, stop: threading.Event, counters: _Counters
) -> None:
    from streamrover.trainers.torch.rendezvous import MasterStore

    with ShardClient(address, token=token, heartbeat=False, timeout=30) as client:
        store = MasterStore(client, "rdzv/soak/store")
        last_restore = time.monotonic()
        round_ = 0
        while not stop.wait(cut_every):  # the checkpoint interval
            cut_id, _ = client.prepare_cut()
            client.commit_cut(cut_id)
            round_ += 1
            for i in range(4):  # a rendezvous round's keys, set then deleted
                store.set(f"round-{round_}/{i}", b"x" * 64)
            for i in range(4):
                store.delete_key(f"round-{round_}/{i}")
            with counters.lock:
                counters.cuts += 1
            if restore_every and time.monotonic() - last_restore >= restore_every:
                client.restore_cut(cut_id)
                last_restore = time.monotonic()
                with counters.lock:
                    counters.restores += 1


def run(
    kind: str, duration: float, workers: int, rate: int, shard: int, cut_every: float, restore_every: float
) -> int:
    from confluent_kafka.admin import AdminClient, NewTopic

    from tests.brokers.kafka import KafkaBroker
    from tests.brokers.tansu import TansuBroker

    print(environment())
    print(f"load: {load()}")
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        broker: KafkaBroker | TansuBroker = (KafkaBroker if kind == "kafka" else TansuBroker)(Path(tmp) / kind)
        broker.start()
        print(f"{kind} broker at {broker.bootstrap}", flush=True)
        master = MasterProcess(Path(tmp) / "state", lease_ttl=10.0)
        master.start()
        try:
            topic = f"soak-{uuid.uuid4().hex[:6]}"
            admin = AdminClient({"bootstrap.servers": broker.bootstrap})
            admin.create_topics([NewTopic(topic, 4, 1)])[topic].result(30)
            spec = DatasetSpec("soak", f"kafka://{broker.bootstrap}/{topic}", options={"sr.max_delay_ms": "50"},
                               records_per_shard=shard)  # fmt: skip
            with ShardClient(master.address, token=master.token, heartbeat=False) as c:
                c.register_dataset(spec)
            assert master.proc is not None
            proc = psutil.Process(master.proc.pid)
            stop = threading.Event()
            counters = _Counters()
            threads = [threading.Thread(target=_produce, args=(broker.bootstrap, topic, rate, stop, counters))]
            threads += [
                threading.Thread(target=_work, args=(master.address, master.token, stop, counters))
                for _ in range(workers)
            ]
            threads.append(threading.Thread(
                target=_coordinate, args=(master.address, master.token, cut_every, restore_every, stop, counters)
            ))  # fmt: skip
            for t in threads:
                t.start()
            rows = []
            t0 = time.monotonic()
            warmup = min(10.0, duration / 6)
            marks = [warmup] + [warmup + (duration - warmup) * k / 6 for k in range(1, 7)]
            last_acks, last_t = 0, t0
            status = ShardClient(master.address, token=master.token, heartbeat=False)
            for mark in marks:
                stop.wait(max(t0 + mark - time.monotonic(), 0))  # the sampling schedule
                now = time.monotonic()
                with counters.lock:
                    acks, produced, cuts, restores = counters.acks, counters.produced, counters.cuts, counters.restores
                info = status.describe_dataset("soak")
                mem = proc.memory_info()  # rss = anonymous (the heaps) + file-backed (shared libraries' pages touched)
                rows.append([f"{now - t0:.0f}", mem.rss / 2**20, (mem.rss - mem.shared) / 2**20,
                             _journal_bytes(master.state_dir) / 1024,
                             produced, acks, (acks - last_acks) / max(now - last_t, 1e-3), cuts, restores,
                             info.shards.todo + info.shards.leased + info.shards.acked, info.lag])  # fmt: skip
                last_acks, last_t = acks, now
                print(f"  t={rows[-1][0]}s rss {rows[-1][1]:.1f} MiB (anon {rows[-1][2]:.1f}) "
                      f"journal {rows[-1][3]:.0f} KiB acks {acks:,}",
                      flush=True)  # fmt: skip
            stop.set()
            for t in threads:
                t.join(timeout=60)
            status.close()
            headers = ["t (s)", "master RSS MiB", "anon MiB", "journal KiB", "produced", "acks", "acks/s", "cuts",
                       "restores", "live shards", "lag"]  # fmt: skip
            print(table(headers, rows))
            first, last = rows[0], rows[-1]
            print(f"master RSS: {first[1]:.1f} MiB at t={first[0]}s -> {last[1]:.1f} MiB at t={last[0]}s "
                  f"(x{last[1] / first[1]:.2f}; anonymous {first[2]:.1f} -> {last[2]:.1f} MiB, "
                  f"x{last[2] / first[2]:.2f}); "
                  f"journal: {first[3]:.0f} KiB -> {last[3]:.0f} KiB (x{last[3] / max(first[3], 1e-3):.2f}); "
                  f"refused acks (restores): {counters.refused:,}")  # fmt: skip
            settled = rows[1]  # the first sample after the warm-up minute (the first restore, caches filled)
            print(f"anonymous memory after t={settled[0]}s: {settled[2]:.1f} -> {last[2]:.1f} MiB over "
                  f"{last[5] - settled[5]:,} acks: {(last[2] - settled[2]) * 2**20 / max(last[5] - settled[5], 1):.0f} "
                  "bytes per ack (goal: ~0, nothing grows with the acks)")  # fmt: skip
        finally:
            master.stop()
            broker.stop()
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks soak", description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    parser.add_argument("--quick", action="store_true", help="30 seconds")
    parser.add_argument("--broker", choices=["kafka", "tansu"], default="kafka",
                        help="Kafka 4 (the reference broker) or tansu (starts faster; its memory storage slowed "
                        "to a stall after a few minutes of single-record batches here)")  # fmt: skip
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rate", type=int, default=2000, help="records produced per second")
    parser.add_argument("--shard", type=int, default=100, help="records per shard")
    parser.add_argument("--cut-every", type=float, default=2.0, help="seconds between committed cuts")
    parser.add_argument("--restore-every", type=float, default=60.0, help="seconds between restores (0: none)")
    args, _ = parser.parse_known_args(argv)
    duration = 30.0 if args.quick else args.duration
    restore_every = min(args.restore_every, duration / 3)  # a short run restores too
    return run(args.broker, duration, args.workers, args.rate, args.shard, args.cut_every, restore_every)
