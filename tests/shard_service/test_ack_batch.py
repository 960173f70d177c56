"""Batched acks (``AckBatch``): each ack judged as a lone Ack, in order; refusals answered per ack; one commit.

The RPC is driven directly (exact batches), then through the client's ack queue, whose
sender batches whatever was queued while the master was stopped (SIGSTOP).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamrover.cursor import IntervalSet
from streamrover.shard_service import (
    AckFailedError,
    FailedPreconditionError,
    LeasedShard,
    ShardClient,
)
from streamrover.shard_service.v1 import shard_service_pb2 as pb
from streamrover.testing.procs import MasterProcess
from tests.shard_service.queued import partition_key, queued_client, record_batches, register_rows, stopped


@pytest.fixture
def client(master: MasterProcess) -> Iterator[ShardClient]:
    with queued_client(master) as c:
        yield c


@pytest.fixture
def dataset(tmp_path: Path, client: ShardClient) -> str:
    return register_rows(tmp_path, client, records_per_shard=100)


def _ack(
    client: ShardClient, shard: LeasedShard, position: int, step: int | None = None, attempt: int = 0
) -> pb.AckRequest:
    return pb.AckRequest(
        worker_id=client.worker_id,
        shard_id=shard.shard_id,
        attempt=attempt or shard.lease.attempt,
        position=position,
        has_step=step is not None,
        step=step or 0,
    )


def _batch(client: ShardClient, *acks: pb.AckRequest, **kw: object) -> pb.AckBatchResponse:
    return client._call(client._stub.AckBatch, pb.AckBatchRequest(worker_id=client.worker_id, acks=acks, **kw))


def test_a_refused_ack_in_the_middle_of_a_batch_stops_nothing_after_it(client: ShardClient, dataset: str) -> None:
    client.join()
    _, (a, b, c) = client.lease(dataset, 3)
    resp = _batch(
        client,
        _ack(client, a, a.lease.start + 40),
        _ack(client, b, b.lease.start + 10, attempt=b.lease.attempt + 1000),  # never issued: stale
        _ack(client, c, c.lease.end + 1),  # outside the shard
        _ack(client, a, a.lease.end),
        _ack(client, c, c.lease.end),
    )
    codes = [r.error_code for r in resp.results]
    assert codes == ["", "FAILED_PRECONDITION", "INVALID_ARGUMENT", "", ""]
    assert "was never issued" in resp.results[1].error and "outside the shard's range" in resp.results[2].error
    assert [r.shard_done for r in resp.results] == [False, False, False, True, True]
    acked = client.get_cursor()[1]
    # one partition, shards a, b, c in a row: a and c recorded, b (between them) not
    assert (a.lease.end, c.lease.start) == (b.lease.start, b.lease.end)
    assert acked.get(partition_key(a)) == IntervalSet([(a.lease.start, a.lease.end), (c.lease.start, c.lease.end)])
    # b's lease is untouched by the refusal: its real attempt still acks
    (again,) = _batch(client, _ack(client, b, b.lease.end)).results
    assert again.shard_done and not again.error_code


def test_acks_of_a_lease_apply_in_batch_order_with_their_steps(client: ShardClient, dataset: str) -> None:
    client.join()
    _, (a,) = client.lease(dataset)
    s = a.lease.start
    resp = _batch(
        client,
        _ack(client, a, s + 10, step=1),
        _ack(client, a, s + 30, step=2),
        _ack(client, a, s + 20, step=3),  # behind what this attempt acked: a harmless repeat, as a lone Ack
        _ack(client, a, s + 30, step=3),  # a repeat
        _ack(client, a, s + 50, step=4),
    )
    assert [(r.duplicate, r.error_code) for r in resp.results] == [
        (False, ""), (False, ""), (True, ""), (True, ""), (False, "")
    ]  # fmt: skip
    _, cut1 = client.prepare_cut(step=1)
    _, cut3 = client.prepare_cut(step=3)
    assert cut1.get(partition_key(a)) == IntervalSet([(s, s + 10)])
    assert cut3.get(partition_key(a)) == IntervalSet([(s, s + 30)])


def test_a_stale_ack_in_a_batch_is_refused_and_the_new_holders_are_recorded(
    client: ShardClient, dataset: str, master: MasterProcess
) -> None:
    client.join()
    _, (old,) = client.lease(dataset)
    client.leave()  # the lease goes back: the same shard is leased again as a new attempt
    other = ShardClient(master.address, token=master.token, heartbeat=False, timeout=30)
    try:
        other.join()
        _, (new,) = other.lease(dataset)
        assert new.shard_id == old.shard_id and new.lease.attempt > old.lease.attempt
        client.join()
        _, (mine,) = client.lease(dataset)
        resp = _batch(client, _ack(client, old, old.lease.end), _ack(client, mine, mine.lease.end))
        assert resp.results[0].error_code == "FAILED_PRECONDITION"
        assert f"leased again as attempt {new.lease.attempt}" in resp.results[0].error
        assert resp.results[1].shard_done and not resp.results[1].error_code
        (held,) = _batch(other, _ack(other, new, new.lease.end)).results
        assert held.shard_done and not held.duplicate
    finally:
        other.close()


def test_a_retried_batch_is_recorded_once_and_gets_the_same_leases(client: ShardClient, dataset: str) -> None:
    client.join()
    _, (a, b) = client.lease(dataset, 2)
    request = pb.AckBatchRequest(
        worker_id=client.worker_id,
        acks=[_ack(client, a, a.lease.end), _ack(client, b, b.lease.start + 5)],
        lease_dataset=dataset,
        lease_more=3,
        request_id=77,
    )
    first = client._call(client._stub.AckBatch, request)
    again = client._call(client._stub.AckBatch, request)  # the answer was lost: the client sends it again
    assert [(r.shard_done, r.duplicate) for r in first.results] == [(True, False), (False, False)]
    assert [(r.shard_done, r.duplicate) for r in again.results] == [(True, True), (False, True)]
    assert len(first.leases) == 3
    assert [(x.shard_id, x.attempt) for x in again.leases] == [(x.shard_id, x.attempt) for x in first.leases]
    assert client.status().records_per_second >= 0  # the master is fine
    info = client.describe_dataset(dataset)
    assert info.shards.leased == 4 and info.shards.acked == 1  # b and the three leased, none twice


def test_a_batch_is_durable_when_answered(client: ShardClient, dataset: str, master: MasterProcess) -> None:
    client.join()
    _, (a, b) = client.lease(dataset, 2)
    _batch(client, _ack(client, a, a.lease.end), _ack(client, b, b.lease.start + 60))
    master.restart()  # SIGKILL, then a new master from the journal
    acked = client.get_cursor()[1]
    expected = IntervalSet([(a.lease.start, a.lease.end), (b.lease.start, b.lease.start + 60)])
    assert acked.get(partition_key(a)) == expected


def test_queued_acks_of_several_leases_go_in_one_batch_and_a_refusal_is_reported_once(
    client: ShardClient, dataset: str, master: MasterProcess
) -> None:
    client.join()
    _, (a, b, c) = client.lease(dataset, 3)
    sent = record_batches(client)
    ghost = dataclasses.replace(b.lease, attempt=b.lease.attempt + 1000)
    with stopped(master):
        a.ack(a.lease.start + 30, step=1)
        client.ack(ghost, b.lease.start + 10, step=1)  # refused: that attempt was never issued
        c.ack(c.lease.end, step=1)
        a.ack(a.lease.start + 60, step=2)
        a.ack(a.lease.end, step=3)
        b.ack(b.lease.end, step=3)
    with pytest.raises(AckFailedError) as err:
        client.flush()
    (failure,) = err.value.failures
    assert failure.shard_id == b.shard_id and failure.attempt == ghost.attempt and failure.lease_lost
    assert isinstance(failure.error, FailedPreconditionError) and "never issued" in str(failure.error)
    client.flush()  # reported once
    batches = [len(positions) for positions in sent]
    assert sum(batches) == 6 and len(batches) <= 2, batches  # at most one in flight when the master stopped
    assert a.done and b.done and c.done
    _, cut = client.prepare_cut(step=2)
    assert cut.get(partition_key(a)) == IntervalSet([(a.lease.start, a.lease.start + 60), (c.lease.start, c.lease.end)])
    with pytest.raises(FailedPreconditionError, match="never issued"):
        client.ack(ghost, b.lease.start + 20)  # that lease is lost for good: raised before sending
    assert client.acks_pending == 0


def test_small_shards_are_read_through_few_batches(client: ShardClient, dataset: str) -> None:
    """shards() leases deeper when the caller gets through shards quickly, and queued acks gather into batches.

    Its leases may merge runs of the 10 planned shards (merging.py): one ack per lease, covering all 10.
    """
    sent = record_batches(client)
    rows, leases, planned = 0, 0, 0
    for shard in client.shards(dataset):
        for batch in shard.batches():
            rows += batch.records.num_rows
        shard.ack()
        leases, planned = leases + 1, planned + shard.lease.shards
    client.flush()
    assert rows == 1000 and planned == 10 and sum(len(positions) for positions in sent) == leases
    assert client.describe_dataset(dataset).finished


def test_a_reader_the_master_has_no_more_shards_for_sends_its_acks_in_one_batch(
    client: ShardClient, dataset: str
) -> None:
    """Once the reader's lease request got fewer shards than it asked for, its finishing acks would bring none.

    They gather (the reader is dry: ``Pacing.granted``) until its queue runs out and ``shards()`` waits for
    them, then go in one batch; before, each was sent at once (a round trip per shard at the end of a dataset).
    """
    sent = record_batches(client)
    client._acks._linger = 60.0  # longer than this test: only the reader's own wait sends them
    rows, holding, ends = 0, [], []
    for shard in client.shards(dataset):  # the first lease asks for more than the 10 shards there are
        for batch in shard.batches():
            rows += batch.records.num_rows
        shard.ack()
        holding.append(client.pacing.readers_supplied())  # may the sender let this ack wait for company?
        ends.append(shard.lease.end)  # (runs of the 10 may come merged: merging.py)
    client.flush()
    assert rows == 1000 and ends[-1] == 1000
    assert holding == [True] * len(ends)
    assert [sorted(b) for b in sent] == [sorted(ends)]
    assert client.describe_dataset(dataset).finished


def test_progress_acks_wait_for_company_and_a_finishing_ack_takes_them_at_once(
    client: ShardClient, dataset: str
) -> None:
    """Acks inside a shard (nothing waits on them) gather; the ack that ends the shard sends them all at once."""
    client.join()
    _, (a, b) = client.lease(dataset, 2)
    batches = record_batches(client)
    client._acks._progress_linger = 60.0  # longer than this test: only a finishing ack or a flush sends them
    for step in range(1, 6):
        a.ack(a.lease.start + 10 * step, step=step)
    t0 = time.monotonic()
    a.ack(a.lease.end, step=6)  # ends the shard: sent at once, with the progress acks before it
    client.flush()
    assert time.monotonic() - t0 < 30, "the finishing ack waited for the progress linger"
    assert batches == [[a.lease.start + 10 * s for s in range(1, 6)] + [a.lease.end]]
    assert a.done

    batches.clear()
    for step in range(1, 4):
        b.ack(b.lease.start + 10 * step, step=step)
    client.flush()  # a flush sends progress acks at once
    assert batches == [[b.lease.start + 10 * s for s in range(1, 4)]]
    assert client.get_cursor()[1].size() == 130  # every ack recorded: shard a whole, 30 records of b
