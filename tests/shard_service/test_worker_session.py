"""The worker session stream: fenced exactly as the unary calls, and nothing acked is lost when the master dies.

The same fencing scenario runs once over the ``WorkerSession`` stream and once over unary calls,
and the two must refuse and accept the same acks with the same errors. Then a worker acks over
the stream while the master is SIGKILLed and restarted under it: every ack answered before the
kill is in the restarted master's cursor, and the run ends with each record acked once.
"""

from __future__ import annotations

import itertools
import re
import threading
from pathlib import Path

import pytest

from streamrover.cursor import IntervalSet
from streamrover.shard_service import DatasetSpec, FailedPreconditionError, NotFoundError, ShardClient
from streamrover.shard_service.api import ShardServiceError
from streamrover.shard_service.v1 import shard_service_pb2 as pb
from streamrover.testing.procs import MasterProcess
from tests.helpers import write_parquet_dataset
from tests.shard_service.queued import partition_key, register_rows, stopped


def _client(master: MasterProcess, session: bool, heartbeat: bool = False) -> ShardClient:
    return ShardClient(master.address, token=master.token, heartbeat=heartbeat, timeout=30, session=session)


def _refusal(exc: ShardServiceError) -> tuple[str, str]:
    """(error type, message with the attempt numbers and address taken out): what a worker can see."""
    text = re.sub(r"attempt \d+", "attempt N", str(exc))
    text = re.sub(r"'[su]/", "'D/", re.sub(r"'w-[0-9a-f]+'", "'W'", text))
    return type(exc).__name__, re.sub(r"from 127\.0\.0\.1:\d+", "from the master", text)


def _fencing(master: MasterProcess, tmp_path: Path, session: bool) -> list[object]:
    """Stale ack refused, fresh ack recorded, repeated ack a harmless duplicate, unknown shard refused."""
    name = "s" if session else "u"
    write_parquet_dataset(tmp_path / name, 100, files=1, row_group_size=100)
    seen: list[object] = []
    with _client(master, session) as a, _client(master, session) as b:
        a.register_dataset(DatasetSpec(name, str(tmp_path / name), records_per_shard=50))
        a.join()
        _, (old,) = a.lease(name)
        a.leave()  # the lease goes back: the same shard is leased again as a new attempt
        b.join()
        _, (new,) = b.lease(name)
        assert new.shard_id == old.shard_id and new.lease.attempt > old.lease.attempt
        a.join()
        with pytest.raises(FailedPreconditionError) as stale:
            a.ack(old.lease, old.lease.end, wait=True)
        assert f"leased again as attempt {new.lease.attempt}" in str(stale.value)
        seen.append(_refusal(stale.value))
        first = new.ack(new.lease.end, wait=True)
        again = b.ack(new.lease, new.lease.end, wait=True)
        seen += [(first.shard_done, first.duplicate), (again.shard_done, again.duplicate)]
        ghost = pb.AckRequest(worker_id=b.worker_id, shard_id=f"{name}/0/nope", attempt=1, position=1)
        with pytest.raises(NotFoundError) as unknown:
            b._transport.worker_call("ack", b._stub.Ack, ghost)
        seen.append(_refusal(unknown.value)[0])  # the message names the shard, which differs per run
        beat = b._transport.worker_call("heartbeat", b._stub.Heartbeat, pb.HeartbeatRequest(worker_id=b.worker_id))
        seen.append(len(beat.revoked))
        assert a._transport.streaming is session and b._transport.streaming is session  # no fallback happened
        _, acked = b.get_cursor()
        seen.append(acked.get(partition_key(new)) == IntervalSet([(new.lease.start, new.lease.end)]))
    return seen


def test_a_session_worker_is_fenced_exactly_as_a_unary_one(tmp_path: Path, master: MasterProcess) -> None:
    streamed = _fencing(master, tmp_path, session=True)
    unary = _fencing(master, tmp_path, session=False)
    assert streamed == unary
    assert streamed[1:3] == [(True, False), (True, True)]  # recorded once, then a harmless duplicate


def test_master_sigkill_mid_stream_loses_no_answered_ack(tmp_path: Path) -> None:
    with MasterProcess(tmp_path / "master", lease_ttl=30.0) as master:  # no lease expires while the master restarts
        _stream_through_a_master_kill(tmp_path, master, workers=1)


def test_master_sigkill_under_concurrent_acks_loses_no_answered_ack(tmp_path: Path) -> None:
    """Four workers ack at once: their acks share group commits (journal.py), and still none answered is lost."""
    with MasterProcess(tmp_path / "master", lease_ttl=30.0) as master:
        _stream_through_a_master_kill(tmp_path, master, workers=4)


def _stream_through_a_master_kill(tmp_path: Path, master: MasterProcess, workers: int) -> None:
    clients = [_client(master, session=True, heartbeat=True) for _ in range(workers)]
    try:
        dataset = register_rows(tmp_path, clients[0], records_per_shard=10)  # 100 shards of 10 rows
        answered: list[tuple[int, int]] = []  # (start, end) of every shard whose finishing ack was answered
        planned = [0]  # the planned shards they cover (a lease may merge several: merging.py)
        errors: list[BaseException] = []
        thirty = threading.Event()  # set by the worker that records the 30th answer: the kill follows at once

        def work(client: ShardClient) -> None:
            try:
                for shard in client.shards(dataset, prefetch=1):
                    result = shard.ack(shard.lease.end, wait=True)
                    assert result is not None and result.shard_done
                    answered.append((shard.lease.start, shard.lease.end))
                    planned[0] += shard.lease.shards
                    if planned[0] >= 30:
                        thirty.set()
            except BaseException as exc:  # reported by the test thread
                errors.append(exc)
                thirty.set()

        threads = [threading.Thread(target=work, args=(c,), name=f"session-worker-{i}") for i, c in enumerate(clients)]
        for t in threads:
            t.start()
        # an event, not a poll: a poll's 50 ms let a fast run ack all 100 shards before the kill
        assert thirty.wait(60), "30 shards acked over the stream"
        assert not errors, errors
        master.kill()  # SIGKILL while the workers stream acks
        before_kill, planned_before_kill = list(answered), planned[0]
        master.start()  # same state dir and port: the streams reconnect and the workers go on
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a worker did not finish after the master restart"
        assert not errors, errors
        assert all(c._transport.streaming for c in clients)
        with _client(master, session=False) as admin:
            _, acked = admin.get_cursor()
            info = admin.describe_dataset(dataset)
    finally:
        for c in clients:
            c.close()
    assert 30 <= planned_before_kill < 100, "the kill came after the run had ended"
    ((_, intervals),) = list(acked.items())
    assert all(intervals.covers(a, b) for a, b in before_kill)  # nothing answered before the kill was lost
    assert intervals.covers(0, 1000) and info.finished and info.records_acked == 1000
    spans = sorted(answered)  # each record read and acked once: the finished shards (some merged) tile the rows
    assert spans[0][0] == 0 and spans[-1][1] == 1000 and all(a[1] == b[0] for a, b in itertools.pairwise(spans)), spans


def test_join_opens_the_session_stream_so_the_first_lease_pays_no_stream_set_up(
    tmp_path: Path, master: MasterProcess
) -> None:
    """Opening the stream (and the master's session) is a once-per-worker cost, like the join: not the first lease's."""
    with _client(master, session=True, heartbeat=True) as client:
        dataset = register_rows(tmp_path, client, records_per_shard=10)
        stub, opened = client._transport.stub, []

        def counted(*args: object, **kwargs: object) -> object:
            opened.append(1)
            return real(*args, **kwargs)

        real = stub.WorkerSession
        stub.WorkerSession = counted
        client.join()
        assert len(opened) == 1  # the stream is open once join() returns
        _, leased = client.lease(dataset, 2)
        assert len(leased) == 2 and len(opened) == 1 and client._transport.streaming  # the same stream


def test_a_session_message_unanswered_within_the_timeout_raises_deadline_exceeded(
    tmp_path: Path, master: MasterProcess
) -> None:
    """The client's deadline on a message: a frozen master (SIGSTOP) gets it refused as DEADLINE_EXCEEDED."""
    client = ShardClient(master.address, token=master.token, heartbeat=False, timeout=1.0)
    try:
        register_rows(tmp_path, client, 20)
        client.join()
        assert client.lease("rows", 1, wait=0)[1]  # the stream is open and answered
        with stopped(master), pytest.raises(ShardServiceError, match=r"no answer within 1.0s \[DEADLINE_EXCEEDED"):
            client.lease("rows", 1, wait=0)
        assert client.lease("rows", 1, wait=0)[1]  # a new stream opens with the next call
    finally:
        client.close()
