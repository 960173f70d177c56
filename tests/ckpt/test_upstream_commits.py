"""Upstream commits never run ahead of durable storage (a real master and a real Kafka-protocol broker).

Upstream commits lag durable storage by one checkpoint: when checkpoint K's cut commits, the broker is
committed to checkpoint K-1's cursor, so a fallback from a corrupt K to K-1 finds every record after K-1
still uncommitted upstream (Pulsar's commit is a cumulative ack that lets the broker delete data).

Checkpoints 1 and 2 are persisted (the group offset goes to 100); the trainer goes on and takes a
memory-only snapshot at step 3 (offset 300), then restarts on the same node and restores that snapshot
from shared memory. The broker's committed offset must not move: storage cannot restore step 3, also
after the master is SIGKILLed and restarted. Durable checkpoints taken afterwards move it on.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from streamrover.ckpt import Checkpointer, CheckpointFallbackWarning, LoadedFrom
from streamrover.ckpt.layout import part_names, step_dir
from streamrover.shard_service import DatasetSpec, ShardClient
from streamrover.testing.procs import MasterProcess
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(300)


def _produce(broker: Any, topic: str, ids: range) -> None:
    from confluent_kafka import Producer

    producer = Producer(broker.producer_config())
    for i in ids:
        producer.produce(topic, value=json.dumps({"id": i}).encode(), partition=0)
    assert producer.flush(60) == 0


def _group_offset(broker: Any, topic: str) -> int:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": f"streamrover-{topic}"})
    try:
        (tp,) = consumer.committed([TopicPartition(topic, 0)], timeout=10)
        return int(tp.offset)
    finally:
        consumer.close()


def _ack_one_shard(client: ShardClient, step: int) -> int:
    _, leased = client.lease("s", max_shards=1, wait=10.0)
    shard = leased[0]
    end = shard.lease.start
    for batch in shard.batches(100):
        end = batch.end
    shard.ack(end, step=step)
    client.flush()
    return end


def _available(client: ShardClient) -> int:
    return int(client.describe_dataset("s").partitions[0].available_end)


def _poller_rounds_done(client: ShardClient, broker: Any, topic: str, next_id: int) -> int:
    """Return once the master's poller finished a round that began after this call: the upstream commit
    handed to it before the call is done. (A round polls, then commits; two records seen one after the
    other mean the round that saw the first one has finished.)"""
    for i in (next_id, next_id + 1):
        _produce(broker, topic, range(i, i + 1))
        wait_until(lambda seen=i + 1: _available(client) >= seen, 60, f"the master to see record {i}")
    return next_id + 2


def _stream(master: MasterProcess, broker: Any) -> tuple[ShardClient, str]:
    """A one-partition topic of 300 records, registered as dataset ``s`` (shards of 100)."""
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = f"t-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    for f in admin.create_topics([NewTopic(topic, 1, 1)]).values():
        f.result(30)
    _produce(broker, topic, range(300))
    client = ShardClient(master.address, token=master.token, timeout=60)
    client.register_dataset(DatasetSpec(
        "s", f"kafka://{broker.bootstrap}/{topic}", records_per_shard=100,
        options={"sr.format": "json", "sr.schema": "id:int64", "sr.max_delay_ms": "200"},
    ))  # fmt: skip
    client.join()
    wait_until(lambda: _available(client) >= 300, 60, "the master to see 300 records")
    return client, topic


def test_a_restore_from_shared_memory_commits_nothing_upstream_beyond_storage(
    tmp_path: Path, master: MasterProcess, tansu_broker: Any
) -> None:
    client, topic = _stream(master, tansu_broker)
    ckpt = Checkpointer(str(tmp_path / "ckpt"), binder=client, saver="thread")
    try:
        for step in (1, 2):  # upstream lags durable storage by one checkpoint: 2's commit takes it to 1's
            assert _ack_one_shard(client, step=step) == 100 * step
            ckpt.save(step, {"w": np.full(4, float(step))})
            ckpt.wait(timeout=60)
        wait_until(lambda: _group_offset(tansu_broker, topic) == 100, 60, "checkpoint 1's offset upstream")

        assert _ack_one_shard(client, step=3) == 300
        ckpt.save(3, {"w": np.full(4, 3.0)}, persist=False)  # in shared memory only
        loaded = ckpt.load()  # the trainer restarts on this node: the memory snapshot is the newest
        assert loaded.source == LoadedFrom.MEMORY and loaded.step == 3
        assert client.get_cursor()[0].size() == 300, "the master resumes from the memory snapshot's cursor"
        next_id = _poller_rounds_done(client, tansu_broker, topic, 300)
        assert _group_offset(tansu_broker, topic) == 100, "committed upstream beyond what storage can restore"
        master.restart()  # SIGKILL: the upstream limit is in the journal, not only in memory
        client.commit_cut(client.status().last_committed_cut)  # a repeated commit: hands positions to the poller
        next_id = _poller_rounds_done(client, tansu_broker, topic, next_id)
        assert _group_offset(tansu_broker, topic) == 100, "after a master restart, upstream ran ahead of storage"

        ckpt.save(4, {"w": np.full(4, 4.0)})  # durable, cursor 300: upstream moves to checkpoint 2's
        ckpt.wait(timeout=60)
        next_id = _poller_rounds_done(client, tansu_broker, topic, next_id)
        assert _group_offset(tansu_broker, topic) == 200, "upstream is at the previous durable checkpoint's"
        ckpt.save(5, {"w": np.full(4, 4.0)})  # a second durable checkpoint of the same cursor: the run's end
        ckpt.wait(timeout=60)
        _poller_rounds_done(client, tansu_broker, topic, next_id)
        assert _group_offset(tansu_broker, topic) == 300, "two durable checkpoints of a cursor commit it upstream"
    finally:
        ckpt.close(unlink=True)
        client.close()


def test_a_fallback_from_a_corrupt_checkpoint_finds_its_records_still_uncommitted_upstream(
    tmp_path: Path, master: MasterProcess, tansu_broker: Any
) -> None:
    """Checkpoint 2's cut commits; the broker is committed only to checkpoint 1's cursor (upstream commits lag
    durable storage by one checkpoint). Checkpoint 2 then rots on storage and the trainer falls back to 1:
    every record in (100, 200] was never committed upstream, so a Pulsar broker (whose commit is a
    cumulative ack that lets it delete data, and cannot go back) still holds them."""
    client, topic = _stream(master, tansu_broker)
    ckpt = Checkpointer(str(tmp_path / "ckpt"), binder=client, saver="thread")
    try:
        for step in (1, 2):
            _ack_one_shard(client, step)
            ckpt.save(step, {"w": np.full(4, float(step))})
            ckpt.wait(timeout=60)
        assert client.status().last_committed_cut, "checkpoint 2's cut committed"
        next_id = _poller_rounds_done(client, tansu_broker, topic, 300)
        assert _group_offset(tansu_broker, topic) == 100, "upstream commit ran ahead of the previous checkpoint"
        tensors = Path(ckpt.storage.join(step_dir(2), part_names(0)[0]))
        tensors.write_bytes(b"\0" * tensors.stat().st_size)  # checkpoint 2 rots on storage
        with pytest.warns(CheckpointFallbackWarning):
            loaded = ckpt.load(memory=False)  # a new node: storage only, and checkpoint 2 is unreadable
        assert loaded.step == 1 and client.get_cursor()[0].size() == 100
        _poller_rounds_done(client, tansu_broker, topic, next_id)
        assert _group_offset(tansu_broker, topic) == 100, "the records after checkpoint 1 are uncommitted upstream"
    finally:
        ckpt.close(unlink=True)
        client.close()
