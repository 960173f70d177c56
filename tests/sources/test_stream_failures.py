"""How a stream dataset fails, waits and resumes, against real Apache Kafka (KRaft).

- A poller that raises anything fails its dataset with the reason in status; it neither dies
  silently nor keeps the master from starting.
- A deleted topic fails the dataset only after ``sr.missing_grace_ms``; once the topic is back,
  ``streamrover dataset resume`` makes it usable again.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from streamrover.shard_service import DatasetSpec, FailedPreconditionError, ShardClient
from streamrover.shard_service.core import ShardCore
from streamrover.shard_service.journal import Journal
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
    # raises when its poller starts (master start) ...
    core.register_dataset(DatasetSpec("at-start", uri, options={"sr.poll_interval_ms": "abc"}), SourceKind.STREAM,
                          parts, "[]")  # fmt: skip
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
            admin.join()
            with pytest.raises(FailedPreconditionError, match="max_delay_ms"):
                admin.lease("mid-run", wait=0)
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
            admin.join()
            with pytest.raises(FailedPreconditionError, match="does not exist"):
                admin.lease("stream", wait=0)

            _create_topic(kafka_broker, 2, topic)  # the cause is fixed
            resumed = _cli(job.master, "dataset", "resume", "stream")
            assert resumed.returncode == 0 and "resumed" in resumed.stdout, resumed.stdout + resumed.stderr
            assert not admin.describe_dataset("stream").failed
            _, leases = admin.lease("stream", wait=10)
            assert leases, "a resumed dataset leases shards again"
            again = _cli(job.master, "dataset", "resume", "stream")
            assert again.returncode == 0 and "was not failed" in again.stdout, again.stdout
    finally:
        job.stop()
