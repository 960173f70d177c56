"""How a stream dataset fails, waits and resumes, against real Apache Kafka (KRaft).

- A poller that raises anything fails its dataset with the reason in status; it neither dies
  silently nor keeps the master from starting.
- A deleted topic fails the dataset only after ``sr.missing_grace_ms``; once the topic is back,
  ``streamrover dataset resume`` makes it usable again; an end that went back is reported.
- Records deleted upstream (``AdminClient.delete_records``) before they were trained fail the
  dataset, or with ``sr.on_data_loss=skip`` (or ``resume --skip-lost``) are accounted as lost in
  the cursor, apart from what was trained.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from streamrover.cursor import IntervalSet, PartitionKey
from streamrover.shard_service import DatasetSpec, FailedPreconditionError, ShardClient
from streamrover.shard_service.master.core import ShardCore
from streamrover.shard_service.master.journal import Journal
from streamrover.sources.api import Partition, SourceKind
from streamrover.testing.procs import MasterProcess, python_env
from tests.helpers import wait_until
from tests.sources.stream_job import StreamJob

pytestmark = pytest.mark.slow


def _create_topic(broker: Any, partitions: int, topic: str = "") -> str:
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = topic or f"t-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    for f in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        f.result(30)
    return topic


def _delete_topic(broker: Any, topic: str) -> None:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    for f in admin.delete_topics([topic]).values():
        f.result(30)


def _produce(broker: Any, topic: str, ids: range, partitions: int) -> None:
    from confluent_kafka import Producer

    producer = Producer(broker.client_config(**{"acks": "all", "enable.idempotence": True}))
    for i in ids:
        producer.produce(topic, value=json.dumps({"id": i}).encode(), partition=i % partitions)
    assert producer.flush(60) == 0


def _group_offsets(broker: Any, topic: str) -> int:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": f"streamrover-{topic}"})
    try:
        return int(consumer.committed([TopicPartition(topic, 0)], timeout=10)[0].offset)
    finally:
        consumer.close()


def _worker(job: StreamJob) -> ShardClient:
    """A client that keeps its leases alive (heartbeats), as a worker does."""
    return ShardClient(job.master.address, token=job.master.token, heartbeat=True, timeout=90)


def _cli(master: MasterProcess, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "streamrover.cli", *args, "--master", master.address, "--token", master.token]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**python_env(), "COLUMNS": "200"})


def test_a_poller_that_raises_fails_its_dataset_and_the_master_still_starts(tmp_path: Path, kafka_broker: Any) -> None:
    """Datasets journalled with options the poller cannot use (as an older master may have accepted them)."""
    topic = _create_topic(kafka_broker, 1)
    _produce(kafka_broker, topic, range(10), 1)
    uri = f"kafka://{kafka_broker.bootstrap}/{topic}"
    state = tmp_path / "master"
    state.mkdir()
    journal = Journal(state / "journal.db")
    core = ShardCore(journal)
    parts = [Partition(f"{topic}-0", 0, 0)]
    # raises when its poller starts (master start) ... (options are validated at registration now: written as
    # an older build would have journalled them)
    early, _ = core.register_dataset(DatasetSpec("at-start", uri), SourceKind.STREAM, parts, "[]")
    early.spec = replace(early.spec, options={"sr.poll_interval_ms": "abc"})
    with journal.transaction():
        journal.put_dataset(early)
    # ... and when its poller plans the first records it polled (mid-run)
    ds, _ = core.register_dataset(DatasetSpec("mid-run", uri), SourceKind.STREAM, parts, "[]")
    ds.spec = replace(ds.spec, options={"sr.max_delay_ms": "soon"})
    with journal.transaction():
        journal.put_dataset(ds)
    journal.close()

    master = MasterProcess(state)
    try:
        master.start()
        with ShardClient(master.address, token=master.token, heartbeat=False, timeout=30) as admin:
            wait_until(lambda: all(d.failed for d in admin.list_datasets()), 60, "both datasets to fail")
            errors = {d.spec.name: d.error for d in admin.list_datasets()}
            assert "sr.poll_interval_ms='abc'" in errors["at-start"], errors
            assert "sr.max_delay_ms='soon'" in errors["mid-run"], errors
            assert all("poller" in e for e in errors.values()), errors
        with ShardClient(master.address, token=master.token, heartbeat=True, timeout=30) as worker:
            with pytest.raises(FailedPreconditionError, match="max_delay_ms"):
                worker.lease("mid-run", wait=0)
    finally:
        master.stop()


def test_deleted_topic_fails_after_the_grace_period_and_resumes_once_back(tmp_path: Path, kafka_broker: Any) -> None:
    topic = _create_topic(kafka_broker, 2)
    _produce(kafka_broker, topic, range(100), 2)
    opts = {"sr.format": "json", "sr.schema": "id:int64", "sr.max_delay_ms": "200", "sr.missing_grace_ms": "1000"}
    job = StreamJob(tmp_path, f"kafka://{kafka_broker.bootstrap}/{topic}", opts, records_per_shard=500)
    job.workers = 0
    try:
        job.start()
        with job.admin() as admin:
            wait_until(lambda: sum(p.end for p in admin.describe_dataset("stream").partitions) == 100, 60,
                       "the records to be planned")  # fmt: skip
            _delete_topic(kafka_broker, topic)
            wait_until(lambda: admin.describe_dataset("stream").failed, 60, "the dataset to fail")
            info = admin.describe_dataset("stream")
            assert topic in info.error and "does not exist" in info.error, info.error
            assert "sr.missing_grace_ms=1000" in info.error, info.error  # failed after the grace, and says so
            with _worker(job) as worker, pytest.raises(FailedPreconditionError, match="does not exist"):
                worker.lease("stream", wait=0)

            _create_topic(kafka_broker, 2, topic)  # the cause is fixed
            resumed = _cli(job.master, "dataset", "resume", "stream")
            assert resumed.returncode == 0 and "resumed" in resumed.stdout, resumed.stdout + resumed.stderr
            assert not admin.describe_dataset("stream").failed
            # the new topic's partitions end at 0, below the 50 planned from the old one's: reported
            wait_until(lambda: "went back from 50 to 0" in admin.describe_dataset("stream").error, 60,
                       "status to report the end that went back")  # fmt: skip
            with _worker(job) as worker:
                _, leases = worker.lease("stream", wait=10)
                assert leases, "a resumed dataset leases shards again"
            again = _cli(job.master, "dataset", "resume", "stream")
            assert again.returncode == 0 and "was not failed" in again.stdout, again.stdout
    finally:
        job.stop()


def _delete_records(broker: Any, topic: str, before: int) -> None:
    """AdminClient.delete_records: partition 0 of ``topic`` keeps only offsets ``before`` and on."""
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    for f in admin.delete_records([TopicPartition(topic, 0, before)]).values():
        f.result(30)


def _trained_and_lost(cursor: Any, pid: str) -> tuple[IntervalSet, IntervalSet]:
    key = PartitionKey("stream", 0, pid)
    return cursor.get(key), cursor.get_lost(key)


def test_records_deleted_upstream_fail_the_dataset_then_resume_skipping_them(tmp_path: Path, kafka_broker: Any) -> None:
    """delete_records removes records no shard has read yet: the dataset fails naming them (no worker reads a
    shard that is gone); resumed with --skip-lost they are accounted as lost and the rest is trained once."""
    total = 1_000
    topic = _create_topic(kafka_broker, 1)
    _produce(kafka_broker, topic, range(total), 1)  # one partition: record i at offset i
    opts = {"sr.format": "json", "sr.schema": "id:int64", "sr.max_delay_ms": "200"}
    job = StreamJob(tmp_path, f"kafka://{kafka_broker.bootstrap}/{topic}", opts, records_per_shard=200)
    job.workers = 0
    pid = f"{topic}-0"
    try:
        job.start()
        with job.admin() as admin:
            wait_until(lambda: admin.describe_dataset("stream").partitions[0].end == total, 60, "records planned")
            _delete_records(kafka_broker, topic, 300)
            wait_until(lambda: admin.describe_dataset("stream").failed, 60, "the dataset to fail")
            info = admin.describe_dataset("stream")
            assert f"{pid} positions [0, 300)" in info.error and "deleted upstream" in info.error, info.error
            assert "--skip-lost" in info.error, info.error  # says how to go on
            with _worker(job) as worker, pytest.raises(FailedPreconditionError, match="deleted upstream"):
                worker.lease("stream", wait=0)

            resumed = _cli(job.master, "dataset", "resume", "stream", "--skip-lost")
            assert resumed.returncode == 0 and "resumed" in resumed.stdout, resumed.stdout + resumed.stderr
            wait_until(lambda: admin.describe_dataset("stream").lost_records == 300, 60, "the loss to be recorded")
            noted = f"{pid} positions [0, 300)"
            wait_until(lambda: noted in admin.describe_dataset("stream").error, 60, "status to show the lost range")
            assert not admin.describe_dataset("stream").failed
        job.start_worker("w0")
        report, cursor, info = job.finish(total - 300, ids=np.arange(300, total))
        assert report.exact, f"{report}\n{job.logs()}"
        assert _trained_and_lost(cursor, pid) == (IntervalSet([(300, total)]), IntervalSet([(0, 300)]))
        assert info.lag == 0 and info.records_committed == total - 300
        group = _group_offsets(kafka_broker, topic)
        wait_until(lambda: _group_offsets(kafka_broker, topic) == total, 30, f"group offset {total} (was {group})")
    finally:
        job.stop()


def test_records_deleted_under_a_lease_are_skipped_with_on_data_loss_skip(tmp_path: Path, kafka_broker: Any) -> None:
    """sr.on_data_loss=skip: delete_records takes the records of a leased shard and half of a queued one. The leased
    shard is decided once its lease ends (its worker may have read it first): its read fails clearly, the worker
    leaves, and the shard is accounted as lost; the queued one is re-planned from the first record still there."""
    from streamrover.sources.api import SourceDataLostError

    total = 1_000
    topic = _create_topic(kafka_broker, 1)
    _produce(kafka_broker, topic, range(total), 1)
    opts = {"sr.format": "json", "sr.schema": "id:int64", "sr.max_delay_ms": "200", "sr.on_data_loss": "skip"}
    job = StreamJob(tmp_path, f"kafka://{kafka_broker.bootstrap}/{topic}", opts, records_per_shard=200)
    job.workers = 0
    pid = f"{topic}-0"
    try:
        job.start()
        with _worker(job) as reader:
            wait_until(lambda: reader.describe_dataset("stream").partitions[0].end == total, 60, "records planned")
            reader.join()
            _, leased = reader.lease("stream", wait=10)
            assert [(s.lease.start, s.lease.end) for s in leased] == [(0, 200)]
            _delete_records(kafka_broker, topic, 300)
            # [200, 300) is lost at once; [0, 200) waits for its lease
            wait_until(lambda: reader.describe_dataset("stream").lost_records == 100, 60, "[200, 300) lost")
            with pytest.raises(SourceDataLostError, match="gone from Kafka"):
                list(leased[0].batches(50))
            reader.leave()
            wait_until(lambda: reader.describe_dataset("stream").lost_records == 300, 60, "[0, 300) lost")
            # status keeps the lost range (once no transient source error, such as a group commit's, is shown)
            noted = f"{pid} positions [0, 300)"
            wait_until(lambda: noted in reader.describe_dataset("stream").error, 60, "status to show the lost range")
            assert not reader.describe_dataset("stream").failed
        job.start_worker("w0")
        job.start_worker("w1")
        report, cursor, info = job.finish(total - 300, ids=np.arange(300, total))
        assert report.exact, f"{report}\n{job.logs()}"
        assert _trained_and_lost(cursor, pid) == (IntervalSet([(300, total)]), IntervalSet([(0, 300)]))
        assert info.lag == 0 and info.records_committed == total - 300
    finally:
        job.stop()
