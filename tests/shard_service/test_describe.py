"""DescribeDataset: the full description (counts) for status, the spec alone for a worker opening the source;
and a reader's first lease, which brings that spec with it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from streamrover.shard_service import DatasetSpec, NotFoundError, ShardClient
from streamrover.shard_service.client.pacing import BATCH_SHARDS, PREFETCH_RECORDS
from streamrover.shard_service.v1 import shard_service_pb2 as pb
from streamrover.testing.procs import MasterProcess
from tests.helpers import write_parquet_dataset


def test_a_spec_only_description_has_what_a_worker_opens_the_source_with(
    tmp_path: Path, master: MasterProcess
) -> None:
    write_parquet_dataset(tmp_path / "data", 400, files=2, row_group_size=100)
    with ShardClient(master.address, token=master.token, heartbeat=False, timeout=30) as client:
        spec = DatasetSpec("rows", str(tmp_path / "data"), records_per_shard=50, options={"cache_partitions": "1"})
        client.register_dataset(spec)
        client.join()
        _, (shard,) = client.lease("rows")
        shard.ack(shard.lease.end)
        full = client.describe_dataset("rows")
        light = client.describe_dataset("rows", spec_only=True)
        assert light.spec == full.spec and light.kind == full.kind == pb.DATASET_KIND_BATCH
        assert light.schema_json == full.schema_json and "id" in light.schema_json
        assert dict(light.spec.options) == {"cache_partitions": "1"}
        assert len(full.partitions) == 4 and full.records_acked == 50
        assert not light.partitions and light.records_acked == 0  # no counts: they walk every ack
        # the leased shard's records came from a source opened with that spec
        assert client._sources["rows"].partitions()[0].id == full.partitions[0].id


@pytest.mark.parametrize("session", [True, False], ids=["session", "unary"])
def test_a_readers_first_lease_brings_the_spec_and_the_first_shards_in_one_round_trip(
    tmp_path: Path, master: MasterProcess, session: bool
) -> None:
    # 4,096 records per shard, row groups of 10 shards: the first depth is PREFETCH_RECORDS of shards (64), merged
    # in runs of at most BATCH_SHARDS (8): the very grants a client that described the dataset first asks for
    write_parquet_dataset(tmp_path / "data", 100 * 4096, files=1, row_group_size=10 * 4096)
    with ShardClient(
        master.address, token=master.token, heartbeat=False, timeout=30, session=session
    ) as client, ShardClient(master.address, token=master.token, heartbeat=False, timeout=30) as described_first:
        for name in ("rows", "rows-too"):
            client.register_dataset(DatasetSpec(name, str(tmp_path / "data"), records_per_shard=4096))
        described: list[Any] = []
        describe = client._stub.DescribeDataset

        def counted(request: Any, **kwargs: Any) -> Any:
            described.append(request)
            return describe(request, **kwargs)

        client._stub.DescribeDataset = counted
        client.join()
        reader = client.shards("rows")
        first = next(reader)
        assert described == []  # the spec came with the lease
        assert client._records_per_shard["rows"] == 4096 and "rows" in client._sources
        leased = [first, *client.leases.waiting("rows")]  # nothing acked yet: all from the first answer
        assert client.pacing.target("rows", 0) == PREFETCH_RECORDS // 4096 == 64
        assert max(s.lease.shards for s in leased) == BATCH_SHARDS
        # the same dataset leased as before: describe, then a lease sized by the spec's shards
        described_first.join()
        spec = described_first.describe_dataset("rows-too", spec_only=True).spec
        pace = described_first.pacing.start("rows-too", 2, spec.records_per_shard)
        _, before = described_first.lease("rows-too", pace.target)
        assert [(s.lease.start, s.lease.end, s.lease.shards) for s in leased] == [
            (s.lease.start, s.lease.end, s.lease.shards) for s in before
        ]
        assert sum(s.lease.shards for s in leased) >= 64
        assert sum(b.records.num_rows for b in first.batches()) == BATCH_SHARDS * 4096
        reader.close()


def test_an_unknown_dataset_is_refused_even_when_its_name_says_worker(tmp_path: Path, master: MasterProcess) -> None:
    with ShardClient(master.address, token=master.token, heartbeat=False, timeout=30) as client:
        client.join()
        worker = client.worker_id
        with pytest.raises(NotFoundError, match="dataset 'worker-logs' is not registered"):
            client.lease("worker-logs")
        with pytest.raises(NotFoundError, match="dataset 'worker-logs' is not registered"):
            next(client.shards("worker-logs"))
        assert client.worker_id == worker  # not taken for an unknown worker: no join again
