"""Every call of the Python client, its connection reset mid-call, is retried and lands exactly once.

A real master process; the client reaches it through :class:`tests.netcut.CutProxy`, which resets the TCP
connection as the call's answer (the master ran it, the client never hears) or its request (the master never
saw it) passes. The rule retried here is :mod:`streamrover.shard_service.client.retry`; what each call's "exactly
once" means is checked against the master through a second, direct client.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streamrover.shard_service import DatasetSpec, LeaseStatus, ShardClient
from streamrover.shard_service.client.retry import transient
from streamrover.shard_service.v1 import shard_service_pb2 as pb
from streamrover.sources.staged import encode_schema
from streamrover.testing.procs import MasterProcess
from tests.helpers import write_parquet_dataset
from tests.netcut import CutProxy

SCHEMA = pa.schema([("id", pa.int64())])


@pytest.fixture
def proxy(master: MasterProcess) -> Iterator[CutProxy]:
    p = CutProxy(master.address)
    yield p
    p.close()


@pytest.fixture
def direct(master: MasterProcess) -> Iterator[ShardClient]:
    c = ShardClient(master.address, token=master.token, heartbeat=False, timeout=10)
    yield c
    c.close()


def _client(master: MasterProcess, proxy: CutProxy, session: bool) -> ShardClient:
    c = ShardClient(proxy.address, token=master.token, heartbeat=False, timeout=20)
    if not session:
        c._transport._stream = None  # per-shard calls as unary calls
    return c


def _cut(proxy: CutProxy, client: ShardClient, where: str, call: Callable[[], object]) -> object:
    """Run ``call`` with the proxy armed to cut at ``where``; the call's answer (after its retries)."""
    retries = client._transport.retries
    fired = proxy.arm(where)
    answer = call()
    assert fired.is_set(), "the proxy did not cut the call"
    assert client._transport.retries > retries, "the cut call was not retried"
    # what the stack said of the cut: grpc-core (Python) says UNAVAILABLE for a reset connection
    assert set(client._transport.statuses) <= {"UNAVAILABLE", "UNKNOWN", "INTERNAL"}, client._transport.statuses
    return answer


@pytest.mark.parametrize("where", ["answer", "request"])
@pytest.mark.parametrize("session", [True, False], ids=["session", "unary"])
def test_worker_calls_cut_mid_call_land_once(
    tmp_path: Path, master: MasterProcess, proxy: CutProxy, direct: ShardClient, where: str, session: bool
) -> None:
    write_parquet_dataset(tmp_path / "data", 400, files=1, row_group_size=100)
    client = _client(master, proxy, session)
    try:
        _cut(proxy, client, where, lambda: client.register_dataset(DatasetSpec("rows", str(tmp_path / "data"),
                                                                               records_per_shard=100)))  # fmt: skip
        assert [d.spec.name for d in direct.list_datasets()] == ["rows"]
        _cut(proxy, client, where, client.join)
        assert len(direct.status().workers) == 1

        # a lease: the retry answers the same grant (one lease held, the same attempt)
        status, got = _cut(proxy, client, where, lambda: client.lease("rows", max_shards=1))  # type: ignore[misc]
        assert status is LeaseStatus.OK and len(got) == 1
        assert direct.describe_dataset("rows").shards.leased == 1
        _, again = client.lease("rows", max_shards=1)  # the next lease is another shard
        assert again[0].shard_id != got[0].shard_id

        # an ack: applied once (the retry of the same attempt is a no-op), the shard done
        shard = got[0]
        _cut(proxy, client, where, lambda: client.ack(shard.lease, shard.lease.end, wait=True))
        info = direct.describe_dataset("rows")
        assert info.records_acked == 100 and info.shards.leased == 1

        # a heartbeat, then a cut's commit
        beat = pb.HeartbeatRequest(worker_id=client.worker_id)
        _cut(proxy, client, where, lambda: client._transport.worker_call("heartbeat", client._stub.Heartbeat, beat))
        client.ack(again[0].lease, again[0].lease.end, wait=True)
        cut_id, _ = client.prepare_cut()
        committed = _cut(proxy, client, where, lambda: client.commit_cut(cut_id))
        assert committed == direct.get_cursor()[0]
        assert direct.describe_dataset("rows").records_committed == 200

        # the key-value store and reported metrics
        # a compare-and-set retried after it landed is answered written, not "the version moved" (a
        # read-modify-write such as the rendezvous store's add would otherwise write twice)
        assert _cut(proxy, client, where, lambda: client.kv_set("k", b"v", 0)) == (True, b"v", 1)
        assert direct.kv_get("k") == (b"v", 1)
        assert _cut(proxy, client, where, lambda: client.kv_set("k", b"w", 1)) == (True, b"w", 2)
        assert _cut(proxy, client, where, lambda: client.kv_delete("k", 2)) == (True, b"", 0)
        assert direct.kv_get("k") is None
        assert client.kv_set("k", b"x", 2)[0] is False, "a stale version is still refused"

        # calls that are not idempotent but guarded: a remove and a leave repeated after the first landed
        _cut(proxy, client, where, client.leave)
        assert len(direct.status().workers) == 0
        _cut(proxy, client, where, lambda: client.remove_dataset("rows"))
        assert direct.list_datasets() == []
    finally:
        client.close()


@pytest.mark.parametrize("where", ["answer", "request"])
def test_commit_staged_cut_mid_call_lands_once(
    tmp_path: Path, master: MasterProcess, proxy: CutProxy, direct: ShardClient, where: str
) -> None:
    staging = tmp_path / "staging"
    options = {"sr.staging_dir": str(staging), "sr.schema": encode_schema(SCHEMA)}
    direct.register_dataset(DatasetSpec("staged", "staged://staged", "parquet", options, 50))
    path = staging / "job" / "0" / "1" / "f.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(pa.table({"id": list(range(120))}, schema=SCHEMA), path)
    client = _client(master, proxy, session=False)
    try:
        answer = _cut(proxy, client, where,
                      lambda: client.commit_staged("staged", "job", "0", 1, [(str(path), 120)]))  # fmt: skip
        assert answer.records == 120  # type: ignore[attr-defined]
        assert answer.already_committed is (where == "answer")  # type: ignore[attr-defined]
        assert direct.describe_dataset("staged").total_records == 120
        assert path.exists()
    finally:
        client.close()


def test_the_retry_rule() -> None:
    """What the transport retries: transient statuses, not a handler that raised nor a message over the limit."""
    code = grpc.StatusCode
    assert transient(code.UNAVAILABLE, "Connection reset by peer")
    assert transient(code.UNKNOWN, "channel closed")
    assert not transient(code.UNKNOWN, "Exception calling application: boom")
    assert transient(code.INTERNAL, "Received RST_STREAM with error code 2")
    assert transient(code.RESOURCE_EXHAUSTED, "the master serves as many sessions as it will")
    assert not transient(code.RESOURCE_EXHAUSTED, "Received message larger than max (9 vs. 4)")
    assert transient(code.DEADLINE_EXCEEDED, "")
    assert not transient(code.DEADLINE_EXCEEDED, "", own_deadline=True)
    for final in (code.INVALID_ARGUMENT, code.NOT_FOUND, code.FAILED_PRECONDITION, code.UNAUTHENTICATED,
                  code.PERMISSION_DENIED, code.CANCELLED, code.ALREADY_EXISTS):  # fmt: skip
        assert not transient(final, "")
