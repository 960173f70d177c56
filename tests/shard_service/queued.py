"""What the queued-ack tests share: a client with queued acks, a frozen master, and a record of the batches sent."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from streamrover.cursor import PartitionKey
from streamrover.shard_service import DatasetSpec, LeasedShard, ShardClient
from streamrover.shard_service.client.client_acks import QueuedAck
from streamrover.testing.procs import MasterProcess
from tests.helpers import write_parquet_dataset


def queued_client(master: MasterProcess) -> ShardClient:
    return ShardClient(master.address, token=master.token, heartbeat=False, timeout=30, async_acks=True)


def register_rows(root: Path, client: ShardClient, records_per_shard: int) -> str:
    """A 1,000-row parquet file under ``root`` registered as dataset "rows" in shards of ``records_per_shard``."""
    write_parquet_dataset(root / "data", 1000, files=1, row_group_size=1000)
    client.register_dataset(DatasetSpec("rows", str(root / "data"), records_per_shard=records_per_shard))
    return "rows"


@contextmanager
def stopped(master: MasterProcess) -> Iterator[None]:
    """The master frozen: it answers nothing until the block ends."""
    assert master.proc is not None
    os.kill(master.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(master.proc.pid, signal.SIGCONT)


def partition_key(shard: LeasedShard) -> PartitionKey:
    return PartitionKey(shard.lease.dataset, shard.lease.epoch, shard.lease.partition.id)


def record_batches(client: ShardClient) -> list[list[int]]:
    """From now on, the positions of every AckBatch the client's sender sends, one list per batch, in order."""
    batches: list[list[int]] = []
    send = client._acks._send

    def recording(batch: list[QueuedAck]) -> list[bool | Exception]:
        batches.append([item.request.position for item in batch])
        return send(batch)  # type: ignore[return-value]

    client._acks._send = recording  # type: ignore[assignment]
    return batches
