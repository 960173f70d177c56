"""Every bad request gets a precise gRPC status and a message that names what was wrong."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streamrover.cursor import DataCursor, PartitionKey
from streamrover.shard_service import (
    AlreadyExistsError,
    DatasetSpec,
    FailedPreconditionError,
    InvalidArgumentError,
    LeaseStatus,
    NotFoundError,
    ShardClient,
    UnauthenticatedError,
)
from streamrover.shard_service.v1 import shard_service_pb2 as pb
from streamrover.shard_service.v1 import shard_service_pb2_grpc as pb_grpc
from streamrover.testing.procs import MasterProcess
from tests.helpers import write_parquet_dataset


@pytest.fixture
def client(master: MasterProcess) -> ShardClient:
    c = ShardClient(master.address, token=master.token, heartbeat=False, timeout=10)
    yield c
    c.close()


@pytest.fixture
def dataset(tmp_path: Path, client: ShardClient) -> str:
    write_parquet_dataset(tmp_path / "data", 1000, files=2, row_group_size=250)
    client.register_dataset(DatasetSpec("rows", str(tmp_path / "data"), records_per_shard=100))
    return "rows"


def _raw_stub(master: MasterProcess) -> pb_grpc.ShardServiceStub:
    return pb_grpc.ShardServiceStub(grpc.insecure_channel(master.address))


def test_missing_or_wrong_token_is_unauthenticated(master: MasterProcess) -> None:
    stub = _raw_stub(master)
    with pytest.raises(grpc.RpcError) as err:
        stub.ListDatasets(pb.ListDatasetsRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        stub.Status(pb.StatusRequest(), metadata=(("authorization", "Bearer wrong"),), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(UnauthenticatedError, match="token"):
        ShardClient(master.address, token="wrong", heartbeat=False).list_datasets()


def test_master_binds_loopback_only(master: MasterProcess) -> None:
    assert master.address.startswith("127.0.0.1:")


def test_missing_files_are_not_found(tmp_path: Path, client: ShardClient) -> None:
    with pytest.raises(NotFoundError, match="does not exist"):
        client.register_dataset(DatasetSpec("a", str(tmp_path / "nope.parquet")))
    with pytest.raises(NotFoundError, match="no files match"):
        client.register_dataset(DatasetSpec("b", str(tmp_path / "nope-*.parquet")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotFoundError, match="holds no"):
        client.register_dataset(DatasetSpec("c", str(tmp_path / "empty")))


def test_unreadable_and_corrupt_files_are_invalid(tmp_path: Path, client: ShardClient) -> None:
    (tmp_path / "bad.parquet").write_bytes(b"this is not parquet")
    with pytest.raises(InvalidArgumentError, match="bad.parquet"):
        client.register_dataset(DatasetSpec("bad", str(tmp_path / "bad.parquet")))
    good = tmp_path / "locked.parquet"
    pq.write_table(pa.table({"id": [1]}), good)
    if os.geteuid() != 0:  # root reads anything; the corrupt-file case above covers unreadable input there
        good.chmod(0)
        with pytest.raises(InvalidArgumentError, match="locked.parquet"):
            client.register_dataset(DatasetSpec("locked", str(good)))
    (tmp_path / "data.txt").write_text("x")
    with pytest.raises(InvalidArgumentError, match="cannot tell the format"):
        client.register_dataset(DatasetSpec("txt", str(tmp_path / "data.txt")))
    (tmp_path / "bad.jsonl").write_text('{"id": 1}\n{"id": \n')
    with pytest.raises(InvalidArgumentError, match="bad.jsonl"):
        client.register_dataset(DatasetSpec("badjson", str(tmp_path / "bad.jsonl")))


def test_schema_mismatch_names_both_files(tmp_path: Path, client: ShardClient) -> None:
    d = tmp_path / "mixed"
    d.mkdir()
    pq.write_table(pa.table({"id": pa.array([1, 2], pa.int64())}), d / "a.parquet")
    pq.write_table(pa.table({"id": pa.array(["x"], pa.string())}), d / "b.parquet")
    with pytest.raises(InvalidArgumentError, match=r"different schemas.*a\.parquet.*b\.parquet"):
        client.register_dataset(DatasetSpec("mixed", str(d)))


def test_bad_dataset_names_and_specs(tmp_path: Path, client: ShardClient, dataset: str) -> None:
    with pytest.raises(InvalidArgumentError, match="dataset name"):
        client.register_dataset(DatasetSpec("no spaces", str(tmp_path / "data")))
    with pytest.raises(InvalidArgumentError, match="records_per_shard"):
        client.register_dataset(DatasetSpec("neg", str(tmp_path / "data"), records_per_shard=-5))
    # Same name, same spec: idempotent. Same name, other spec: ALREADY_EXISTS.
    again = client.register_dataset(DatasetSpec("rows", str(tmp_path / "data"), records_per_shard=100))
    assert not again.created
    with pytest.raises(AlreadyExistsError, match="different spec"):
        client.register_dataset(DatasetSpec("rows", str(tmp_path / "data"), records_per_shard=7))
    with pytest.raises(NotFoundError, match="not registered"):
        client.describe_dataset("nothing")


def test_ack_fencing_statuses(client: ShardClient, dataset: str) -> None:
    client.join()
    status, (shard,) = client.lease(dataset)
    assert status is LeaseStatus.OK
    lease = shard.lease
    with pytest.raises(NotFoundError, match="unknown"):
        client._call(
            client._stub.Ack, pb.AckRequest(worker_id=client.worker_id, shard_id="rows/0/0/1-2", attempt=1, position=2)
        )
    with pytest.raises(InvalidArgumentError, match="outside the shard's range"):
        client.ack(lease, lease.end + 1, wait=True)  # the master's answer
    with pytest.raises(InvalidArgumentError, match="outside the shard's range"):
        client.ack(lease, lease.end + 1, wait=False)  # a queued ack is checked before queueing: its answer comes late
    with pytest.raises(FailedPreconditionError, match="never issued"):
        client._call(
            client._stub.Ack,
            pb.AckRequest(
                worker_id=client.worker_id,
                shard_id=lease.shard_id,
                attempt=lease.attempt + 100,
                position=lease.start + 1,
            ),
        )
    with pytest.raises(FailedPreconditionError, match="held by worker"):
        client._call(
            client._stub.Ack,
            pb.AckRequest(
                worker_id="someone-else", shard_id=lease.shard_id, attempt=lease.attempt, position=lease.start + 1
            ),
        )
    first = client.ack(lease, lease.start + 10, wait=True)  # these check the master's answers: synchronous
    assert not first.duplicate
    again = client.ack(lease, lease.start + 10, wait=True)  # the same ack again: OK, no effect
    assert again.duplicate
    # The worker leaves; another takes the shard: the first lease's new acks are refused, naming both attempts.
    client.leave()
    other = ShardClient(client.address, token=client.token, heartbeat=False, timeout=10)
    other.join()
    _, (taken,) = other.lease(dataset)
    assert taken.shard_id == lease.shard_id and taken.lease.resume == lease.start + 10
    with pytest.raises(FailedPreconditionError) as err:
        client._call(
            client._stub.Ack,
            pb.AckRequest(
                worker_id=client.worker_id, shard_id=lease.shard_id, attempt=lease.attempt, position=lease.start + 20
            ),
        )
    msg = str(err.value)
    assert lease.shard_id in msg and f"attempt {lease.attempt}" in msg and f"attempt {taken.lease.attempt}" in msg
    other.close()


def test_cut_and_restore_errors(client: ShardClient, dataset: str) -> None:
    with pytest.raises(NotFoundError, match="cut 99"):
        client.commit_cut(99)
    first, _ = client.prepare_cut()
    second, _ = client.prepare_cut()
    client.commit_cut(second)
    with pytest.raises(FailedPreconditionError, match="older than the committed cut"):
        client.commit_cut(first)
    bad = DataCursor()
    bad.add(PartitionKey("ghost", 0, "p"), 0, 1)
    with pytest.raises(InvalidArgumentError, match="ghost"):
        client.restore_cursor(bad)
    info = client.describe_dataset(dataset)
    outside = DataCursor()
    outside.add(PartitionKey(dataset, 0, info.partitions[0].id), 0, 10**9)
    with pytest.raises(InvalidArgumentError, match="outside the partition"):
        client.restore_cursor(outside)
    wrong_epoch = DataCursor()
    wrong_epoch.add(PartitionKey(dataset, 5, info.partitions[0].id), 0, 1)
    with pytest.raises(InvalidArgumentError, match="epochs"):
        client.restore_cursor(wrong_epoch)
    with pytest.raises(grpc.RpcError) as err:
        _raw_stub_call(client, pb.RestoreRequest())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _raw_stub_call(client: ShardClient, request: pb.RestoreRequest) -> None:
    stub = pb_grpc.ShardServiceStub(grpc.insecure_channel(client.address))
    stub.Restore(request, metadata=(("authorization", f"Bearer {client.token}"),), timeout=10)


def test_unknown_worker_is_not_found(client: ShardClient, dataset: str) -> None:
    with pytest.raises(NotFoundError, match="join again"):
        client._call(client._stub.Heartbeat, pb.HeartbeatRequest(worker_id="w-ghost"))
    with pytest.raises(InvalidArgumentError, match="worker name"):
        client._call(client._stub.Join, pb.JoinRequest(name=""))


def test_a_retried_finishing_ack_returns_the_same_piggybacked_leases(client: ShardClient, dataset: str) -> None:
    """An ack that finishes a shard can lease the next ones; if its answer is lost and it is retried
    (a duplicate), the same leases come back rather than being held by nobody who knows it."""
    client.join()
    _, (shard,) = client.lease(dataset)
    lease = shard.lease
    request = pb.AckRequest(
        worker_id=client.worker_id, shard_id=lease.shard_id, attempt=lease.attempt, position=lease.end, lease_more=2
    )
    first = client._call(client._stub.Ack, request)
    again = client._call(client._stub.Ack, request)
    assert first.shard_done and not first.duplicate and len(first.leases) == 2
    assert again.duplicate and [(x.shard_id, x.attempt) for x in again.leases] == [
        (x.shard_id, x.attempt) for x in first.leases
    ]
