"""A staged file deleted by hand before it is trained is reported, and fails the dataset; never skipped in silence.

A real master; a worker (ShardClient) reads the committed files' shards. One file is deleted before it is
read. With the default ``sr.on_data_loss=fail`` the worker's read raises DataLostError, the dataset is FAILED
naming the file (status, /metrics) and leases are refused; with ``skip`` the file's records are accounted as
lost (status, the cursor's lost part) and every other record is trained once.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streamrover.shard_service import DataLostError, DatasetSpec, FailedPreconditionError, LeaseLostError, ShardClient
from streamrover.sources.staged import encode_schema
from streamrover.testing.procs import MasterProcess

SCHEMA = pa.schema([("id", pa.int64())])


def _staged(tmp_path: Path, client: ShardClient, policy: str) -> tuple[Path, Path]:
    staging = tmp_path / "staging"
    options = {"sr.staging_dir": str(staging), "sr.schema": encode_schema(SCHEMA), "sr.on_data_loss": policy}
    client.register_dataset(DatasetSpec("s", "staged://s", "parquet", options, 100))
    paths = []
    for epoch, ids in ((1, range(0, 300)), (2, range(300, 500))):
        path = staging / "job" / "0" / str(epoch) / "f.parquet"
        path.parent.mkdir(parents=True)
        pq.write_table(pa.table({"id": list(ids)}, schema=SCHEMA), path, row_group_size=50)
        client.commit_staged("s", "job", "0", epoch, [(str(path), len(ids))])
        paths.append(path)
    return paths[0], paths[1]


def _train(client: ShardClient) -> tuple[list[int], list[str]]:
    """Read and ack every shard; returns the ids trained and the errors met (by type name)."""
    trained: list[int] = []
    errors: list[str] = []
    for shard in client.shards("s", wait=0.5):
        try:
            ids = [i for b in shard.batches() for i in b.records.column("id").to_pylist()]
        except LeaseLostError as exc:
            errors.append(type(exc).__name__)
            continue
        trained += ids
        shard.ack(wait=True)
        if client.describe_dataset("s").records_acked + client.describe_dataset("s").lost_records >= 500:
            break
    return trained, errors


def test_a_deleted_staged_file_fails_the_dataset(tmp_path: Path, master: MasterProcess) -> None:
    client = ShardClient(master.address, token=master.token, heartbeat=False, timeout=10)
    try:
        first, _ = _staged(tmp_path, client, "fail")
        first.unlink()  # by hand, before a record of it was trained
        with pytest.raises(DataLostError, match="f.parquet"):
            _train(client)
        info = client.describe_dataset("s")
        assert info.failed and str(first) in info.error and "sr.on_data_loss=skip" in info.error
        with pytest.raises(FailedPreconditionError, match="can no longer be read"):
            client.lease("s")
        request = urllib.request.Request(f"{master.dashboard_url.split('#')[0].rstrip('/')}/metrics",
                                         headers={"Authorization": f"Bearer {master.token}"})  # fmt: skip
        metrics = urllib.request.urlopen(request, timeout=10).read().decode()
        assert 'streamrover_dataset_failed{dataset="s"} 1.0' in metrics
    finally:
        client.close()


def test_a_deleted_staged_file_is_accounted_lost_with_skip(tmp_path: Path, master: MasterProcess) -> None:
    client = ShardClient(master.address, token=master.token, heartbeat=False, timeout=10)
    try:
        first, _ = _staged(tmp_path, client, "skip")
        first.unlink()
        trained, errors = _train(client)
        assert sorted(trained) == list(range(300, 500))  # the other file's records, each once
        assert errors and set(errors) == {"LeaseLostError"}
        info = client.describe_dataset("s")
        assert not info.failed and info.lost_records == 300
        _, cursor = client.get_cursor()  # committed plus acked: its lost part holds the skipped file
        lost = dict(cursor.lost_items())
        assert [ivs.intervals() for k, ivs in lost.items() if k.partition == str(first)] == [[(0, 300)]]
    finally:
        client.close()
