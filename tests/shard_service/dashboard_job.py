"""A small running stream job for the dashboard tests: a tansu topic of 2 partitions, a real master
process, a worker that reads every record from the broker, acks it and reports metrics, and a durable cut."""

from __future__ import annotations

import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from streamrover.shard_service import DatasetSpec, ShardClient
from streamrover.testing.procs import MasterProcess
from tests.brokers.tansu import TansuBroker
from tests.helpers import wait_until


@dataclass
class StreamJob:
    master: MasterProcess
    broker: TansuBroker
    topic: str
    worker: ShardClient
    records_read: int = 0

    @property
    def partitions(self) -> list[str]:
        return [f"{self.topic}-0", f"{self.topic}-1"]

    def produce(self, per_partition: tuple[int, int]) -> None:
        """Produce records to partition 0 and 1 (one record per batch: tansu's high watermark stays exact)."""
        from confluent_kafka import Producer

        producer = Producer(self.broker.producer_config())
        for partition, n in enumerate(per_partition):
            for i in range(n):
                producer.produce(self.topic, value=f"{partition}:{i}".encode(), partition=partition)
        assert producer.flush(30) == 0

    def consume_all(self, expected: int) -> None:
        """Lease, read from the broker and ack shards until ``expected`` records in all were read."""
        while self.records_read < expected:
            _, shards = self.worker.lease("clicks", max_shards=4, wait=10)
            for shard in shards:
                for batch in shard.batches(64):
                    self.records_read += batch.records.num_rows
                shard.ack(wait=True)
        assert self.records_read == expected

    def commit(self) -> int:
        """A cut of everything acked, committed (as a durable checkpoint would): returns its id."""
        cut_id, _ = self.worker.prepare_cut()
        self.worker.commit_cut(cut_id)
        return cut_id

    def scrape(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return scrape(self.master)

    def lag(self, partition: int) -> float | None:
        key = ("streamrover_partition_lag_records", (("dataset", "clicks"), ("partition", self.partitions[partition])))
        return self.scrape().get(key)


def start_stream_job(broker: TansuBroker, master: MasterProcess, per_partition: tuple[int, int]) -> StreamJob:
    """The job: ``per_partition`` records produced, all read and acked by one worker, a cut committed."""
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = f"dash-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(30)
    worker = ShardClient(master.address, token=master.token, name="rank0@test")
    job = StreamJob(master, broker, topic, worker)
    job.produce(per_partition)
    spec = DatasetSpec("clicks", f"kafka://{broker.bootstrap}/{topic}", options={"sr.max_delay_ms": "0"},
                       records_per_shard=20)  # fmt: skip
    worker.register_dataset(spec)
    total = sum(per_partition)
    wait_until(lambda: worker.describe_dataset("clicks").total_records == total, 30, f"{total} records planned")
    job.consume_all(total)
    return job


def scrape(master: MasterProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``/metrics`` parsed by prometheus-client's parser: (sample name, sorted labels) -> value."""
    req = urllib.request.Request(master.dashboard_url + "metrics")
    req.add_header("Authorization", f"Bearer {master.token}")
    with urllib.request.urlopen(req, timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def http_status(url: str, token: str | None = None, method: str = "GET") -> int:
    """The HTTP status of a request (with ``Authorization: Bearer token`` when ``token`` is given)."""
    req = urllib.request.Request(url, method=method)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code
