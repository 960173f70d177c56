"""``streamrover dataset remove NAME`` and its RPC (issue 15, item 2)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from streamrover.shard_service import DatasetSpec, NotFoundError, ShardClient
from streamrover.shard_service.v1 import shard_service_pb2 as pb
from streamrover.testing.procs import MasterProcess, python_env
from tests.brokers.tansu import TansuBroker
from tests.helpers import wait_until, write_parquet_dataset


def test_remove_revokes_leases_forgets_shards_and_survives_a_restart(tmp_path: Path, master: MasterProcess) -> None:
    write_parquet_dataset(tmp_path / "data", 1000, files=2, row_group_size=250)
    spec = DatasetSpec("rows", str(tmp_path / "data"), records_per_shard=100)
    admin = ShardClient(master.address, token=master.token, heartbeat=False)
    admin.register_dataset(spec)
    admin.register_dataset(DatasetSpec("other", str(tmp_path / "data"), records_per_shard=500))
    worker = ShardClient(master.address, token=master.token, heartbeat=False)
    worker.join()
    _, leases = worker.lease("rows", max_shards=2)
    assert len(leases) == 2
    worker.ack(leases[0].lease, leases[0].lease.end, wait=True)  # one shard acked, one still leased
    admin.commit_cut(admin.prepare_cut()[0])

    removed = admin.remove_dataset("rows")
    assert (removed.leases_revoked, removed.shards_removed) == (1, 11)
    assert [d.spec.name for d in admin.list_datasets()] == ["other"]
    assert admin.get_cursor()[0].datasets() == [], "the committed cursor must forget the removed dataset"
    assert admin.status().last_committed_cut > 0
    held = leases[1].lease
    with pytest.raises(NotFoundError):
        worker.ack(held, held.end, wait=True)
    hb = worker._call(worker._stub.Heartbeat, pb.HeartbeatRequest(worker_id=worker.worker_id))
    assert [r.shard_id for r in hb.revoked] == [held.shard_id], "the worker must learn its lease was revoked"
    with pytest.raises(NotFoundError, match="not registered"):
        admin.remove_dataset("rows")

    master.kill()  # the removal was journalled: a restarted master does not bring it back
    master.start()
    assert [d.spec.name for d in admin.list_datasets()] == ["other"]
    again = admin.register_dataset(spec)  # the name is free again: a new dataset, from the start
    assert again.created and again.dataset.shards.todo == 12 and again.dataset.records_acked == 0
    _, fresh = worker.lease("rows", max_shards=1)
    assert fresh[0].lease.attempt > held.attempt, "attempt numbers are never reused across a removal"
    worker.close()
    admin.close()


def test_cli_dataset_remove(tmp_path: Path, master: MasterProcess) -> None:
    write_parquet_dataset(tmp_path / "data", 100, files=1, row_group_size=50)
    base = [sys.executable, "-m", "streamrover.cli", "dataset"]
    auth = ["--master", master.address, "--token", master.token]
    env = {**python_env(), "COLUMNS": "200"}
    added = subprocess.run([*base, "add", "d", str(tmp_path / "data"), *auth], capture_output=True, text=True, env=env)
    assert added.returncode == 0, added.stdout + added.stderr
    gone = subprocess.run([*base, "remove", "d", *auth], capture_output=True, text=True, env=env)
    assert gone.returncode == 0 and "removed" in gone.stdout, gone.stdout + gone.stderr
    again = subprocess.run([*base, "remove", "d", *auth], capture_output=True, text=True, env=env)
    assert again.returncode == 2 and "not registered" in again.stdout, again.stdout


def test_removing_a_stream_stops_its_poller(tansu_broker: TansuBroker, master: MasterProcess) -> None:
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = f"rm-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": tansu_broker.bootstrap})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    producer = Producer(tansu_broker.producer_config(**{"linger.ms": 0}))

    def produce(n: int) -> None:
        for i in range(n):
            producer.produce(topic, value=str(i).encode())
            producer.flush(10)

    uri = f"kafka://{tansu_broker.bootstrap}/{topic}"
    spec = DatasetSpec("s", uri, options={"sr.max_delay_ms": "0"}, records_per_shard=10)
    with ShardClient(master.address, token=master.token, heartbeat=False) as c:
        c.register_dataset(spec)
        produce(10)
        wait_until(lambda: c.describe_dataset("s").shards.todo >= 1, 30, "a shard planned from the stream")
        c.remove_dataset("s")
        produce(10)
        c.register_dataset(DatasetSpec("probe", uri, options={"sr.max_delay_ms": "0"}, records_per_shard=10))
        wait_until(lambda: c.describe_dataset("probe").shards.todo >= 2, 30, "the probe to plan what was produced")
        assert [d.spec.name for d in c.list_datasets()] == ["probe"], "the removed stream's poller came back"
        again = c.register_dataset(spec)
        assert again.created
