"""DescribeDataset: the full description (counts) for status, the spec alone for a worker opening the source."""

from __future__ import annotations

from pathlib import Path

from streamrover.shard_service import DatasetSpec, ShardClient
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
