"""Queued acks: order, merging, flush before a cut, refusals reported once, restore, a kill with acks queued.

With ``async_acks=True``, ``ShardClient.ack`` queues and returns; a sender thread sends in order. To hold acks in
the queue deterministically the tests stop the master (SIGSTOP): nothing is answered
until it continues, so what the client does meanwhile is observable.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamrover.cursor import DataCursor, IntervalSet
from streamrover.shard_service import (
    AckFailedError,
    DatasetSpec,
    FailedPreconditionError,
    LeaseGrant,
    LeaseLostError,
    NotFoundError,
    ShardClient,
)
from streamrover.testing.ledger import Ledger
from streamrover.testing.procs import MasterProcess, python_env, start_ledger_worker
from tests.helpers import write_parquet_dataset
from tests.shard_service.queued import partition_key, queued_client, register_rows, stopped

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def client(master: MasterProcess) -> Iterator[ShardClient]:
    with queued_client(master) as c:
        yield c


@pytest.fixture
def dataset(tmp_path: Path, client: ShardClient) -> str:
    return register_rows(tmp_path, client, records_per_shard=500)


def test_acks_with_steps_keep_their_order_and_a_cut_flushes_them_first(
    client: ShardClient, dataset: str, master: MasterProcess
) -> None:
    client.join()
    _, (shard,) = client.lease(dataset)
    start = shard.lease.start
    positions = [start + 50 * i for i in range(1, 9)]
    with stopped(master):
        for step, pos in enumerate(positions, start=1):
            assert shard.ack(pos, step=step) is None  # queued: returns at once
        assert client.acks_pending == len(positions), "nothing can be answered while the master is stopped"
    # The cut for step 5 is taken right away: it must still hold every ack of steps <= 5, and only those.
    _, cursor = client.prepare_cut(step=5)
    assert client.acks_pending == 0
    assert cursor.get(partition_key(shard)) == IntervalSet([(start, positions[4])])
    _, acked = client.get_cursor()
    assert acked.get(partition_key(shard)) == IntervalSet([(start, positions[-1])])
    assert shard.acked == positions[-1]


def test_acks_of_one_lease_and_step_merge_while_the_master_is_slow(
    client: ShardClient, dataset: str, master: MasterProcess
) -> None:
    client.join()
    _, (shard,) = client.lease(dataset)
    start, end = shard.lease.start, shard.lease.end
    with stopped(master):
        for pos in range(start + 10, end + 1, 10):
            shard.ack(pos)
        # at most one in flight and one queued: the queued one now says "up to the end"
        assert 1 <= client.acks_pending <= 2
    client.flush()
    assert shard.done and shard.acked == end
    assert client.get_cursor()[1].get(partition_key(shard)) == IntervalSet([(start, end)])


def test_a_refused_queued_ack_is_reported_once_and_the_lease_stays_lost(
    client: ShardClient, dataset: str, master: MasterProcess
) -> None:
    client.join()
    _, (shard,) = client.lease(dataset)
    client.leave()  # the shard goes back; another worker takes it
    other = ShardClient(master.address, token=master.token, heartbeat=False, timeout=30, async_acks=True)
    try:
        other.join()
        _, (taken,) = other.lease(dataset)
        assert taken.shard_id == shard.shard_id

        assert shard.ack(shard.lease.start + 10) is None  # queued: no error yet
        with pytest.raises(AckFailedError) as err:
            client.flush()
        (failure,) = err.value.failures
        assert failure.shard_id == shard.shard_id and failure.attempt == shard.lease.attempt and failure.lease_lost
        assert isinstance(failure.error, FailedPreconditionError)
        assert f"leased again as attempt {taken.lease.attempt}" in str(err.value)
        client.flush()  # reported once
        assert client.take_ack_failures() == []
        with pytest.raises(LeaseLostError, match=f"leased again as attempt {taken.lease.attempt}"):
            shard.ack(shard.lease.start + 20)  # the lease is lost for good: raised before anything is sent
        other.flush()
        taken.ack(taken.lease.end)
        other.flush()  # the new holder is unaffected
        assert taken.done
    finally:
        other.close()


def test_the_next_ack_of_a_lost_lease_reports_its_queued_refusal(
    client: ShardClient, dataset: str, master: MasterProcess
) -> None:
    client.join()
    _, (shard,) = client.lease(dataset)
    client.leave()
    other = ShardClient(master.address, token=master.token, heartbeat=False, timeout=30, async_acks=True)
    try:
        other.join()
        other.lease(dataset)
        shard.ack(shard.lease.start + 10)
        # waits for the queued ack, finds it refused, raises that: the caller stops applying this shard
        with pytest.raises(LeaseLostError, match="refused when sent from the ack queue"):
            shard.ack(shard.lease.start + 20, wait=True)
        client.flush()  # already reported by the ack
    finally:
        other.close()


def test_other_refusals_wait_for_a_flush_or_take_and_leave_raises_after_leaving(
    client: ShardClient, dataset: str
) -> None:
    client.join()
    _, (shard,) = client.lease(dataset)
    def ghost(start: int) -> LeaseGrant:  # a lease of a shard the service never planned
        return LeaseGrant(f"rows/0/0/{start}-{start + 10}", 1, dataset, 0, shard.lease.partition, start, start + 10,
                          start, 0.0)  # fmt: skip

    client.ack(ghost(900000), 900005)  # an unknown shard: NOT_FOUND, answered in the background
    result = shard.ack(shard.lease.start + 10, wait=True)  # another lease's refusal is not raised here
    assert result is not None and not result.duplicate
    (failure,) = client.take_ack_failures()
    assert failure.shard_id == ghost(900000).shard_id and isinstance(failure.error, NotFoundError)
    assert client.take_ack_failures() == []
    with pytest.raises(NotFoundError):
        client.ack(ghost(900000), 900006)  # that lease is lost for good

    client.ack(ghost(800000), 800006)
    with pytest.raises(AckFailedError, match="unknown"):
        client.leave()  # leaves first (the lease goes back), then reports
    assert client.worker_id == ""


def test_restore_drops_queued_acks_and_their_failures(
    client: ShardClient, dataset: str, master: MasterProcess
) -> None:
    client.join()
    _, (shard,) = client.lease(dataset)
    restored: list[object] = []
    with stopped(master):
        for step in range(1, 5):
            shard.ack(shard.lease.start + 10 * step, step=step)
        restorer = threading.Thread(target=lambda: restored.append(client.restore_cursor(DataCursor())))
        restorer.start()
    restorer.join(timeout=30)
    assert restored, "restore_cursor did not return"
    # Acks of revoked leases were dropped, not sent after the restore (they would have been refused).
    assert client.acks_pending == 0
    client.flush()
    assert client.take_ack_failures() == []
    assert client.get_cursor()[1] == DataCursor()


def test_a_worker_killed_with_queued_acks_is_caught_up_from_the_ledger(tmp_path: Path, master: MasterProcess) -> None:
    """Killed after writing, before its acks left: the shard is leased again from the last recorded ack,
    and the next worker finds the ledger ahead and acks the ledger's position instead of writing again."""
    ids = write_parquet_dataset(tmp_path / "data", 10_000, files=1, row_group_size=5_000)
    ledger_path = tmp_path / "ledger.db"
    Ledger(ledger_path).close()
    with ShardClient(master.address, token=master.token, heartbeat=False) as admin:
        admin.register_dataset(DatasetSpec("rows", str(tmp_path / "data"), records_per_shard=5_000))
        queued = subprocess.Popen(
            [sys.executable, "-m", "tests.shard_service.queued_ack_worker", master.address, master.token, "rows",
             str(ledger_path)],
            cwd=ROOT, env=python_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        assert queued.stdin is not None and queued.stdout is not None
        try:
            line = queued.stdout.readline().decode()
            assert line.startswith("LEASED"), line
            with stopped(master):
                queued.stdin.write(b"go\n")
                queued.stdin.flush()
                line = queued.stdout.readline().decode()
                assert line.startswith("QUEUED"), line
                _, pending, in_flight = line.split()
                assert int(pending) == 5, "five acks (steps 1..5), none answered"
                assert int(in_flight) == 1, "only the first was sent; four die queued with the worker"
                queued.kill()
                queued.wait()
        finally:
            queued.kill()
            queued.wait()
        written = Ledger(ledger_path)
        assert list(written.positions().values()) == [5_000], "the killed worker wrote its whole shard"
        written.close()

        finisher = start_ledger_worker(master, "rows", ledger_path, batch_size=1_000, name="finisher")
        out, _ = finisher.communicate(timeout=120)
        assert finisher.returncode == 0, out.decode()
        info = admin.describe_dataset("rows")
        assert info.finished
        cut_id, cursor = admin.prepare_cut()
        admin.commit_cut(cut_id)
    ledger = Ledger(ledger_path)
    report = ledger.verify(ids)
    ledger.close()
    assert report.exact, str(report)
    assert report.catchups >= 1, "the re-leased shard resumed behind the ledger (its acks died in the queue)"
    assert cursor.size() == 10_000
