"""Nothing the master keeps grows without bound (issue 15, item 10): ack rates, restore bookkeeping, KV tombstones."""

from __future__ import annotations

import sqlite3
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streamrover.cursor import IntervalSet
from streamrover.shard_service import InvalidArgumentError, ShardClient
from streamrover.shard_service.api import DatasetSpec, PartitionPlan
from streamrover.shard_service.master import state as core_state
from streamrover.shard_service.master.core import ShardCore
from streamrover.shard_service.master.journal import Journal
from streamrover.shard_service.master.planner import plan_epoch
from streamrover.sources.api import Partition, SourceKind
from streamrover.sources.positions import RecordRuns
from streamrover.testing.procs import MasterProcess
from tests.helpers import write_parquet_dataset
from tests.shard_service.fake_clock import Clock


def _journal_rows(master: MasterProcess, sql: str) -> list[tuple[object, ...]]:
    """The rows of ``sql`` in the master's journal, read by another connection: the master holds its journal
    exclusively (SQLite EXCLUSIVE locking), so it is stopped (SIGTERM) for the read and started again."""
    master.stop()
    try:
        db = sqlite3.connect(f"file:{master.state_dir / 'journal.db'}?mode=ro", uri=True)
        try:
            return db.execute(sql).fetchall()
        finally:
            db.close()
    finally:
        master.start()


def _core(path: Path, clock: Clock, size: int = 100_000, end: int = 100_000) -> ShardCore:
    core = ShardCore(Journal(path / "j.db"), lease_ttl=1e6, clock=clock)
    spec = DatasetSpec("d", "mem://", records_per_shard=size)
    core.register_dataset(spec, SourceKind.BATCH, [Partition("p0", 0, end)], "[]")
    return core


def test_ack_rates_keep_constant_memory_without_status_calls(tmp_path: Path) -> None:
    clock = Clock()
    core = _core(tmp_path, clock)
    w = core.join("w").id
    (grant,) = core.lease(w, "d").leases
    for position in range(1, 5001):  # 5,000 acks over 50 s, nobody asks for status
        clock.now += 0.01
        core.ack(w, grant.shard_id, grant.attempt, position)
    assert len(core.ack_log) <= 64, f"the ack log holds {len(core.ack_log)} entries after 5,000 acks"
    acks = core.shards[grant.shard_id].acks  # journalled with the shard at every ack: one entry per step
    assert acks == [(None, 5000)], f"{len(acks)} ack entries kept for one shard"
    records_per_second, acks_per_second = core.rates()
    assert records_per_second == pytest.approx(100, rel=0.05) and acks_per_second == pytest.approx(100, rel=0.05)
    clock.now += 60  # idle: the rates fall to zero
    assert core.rates() == (0.0, 0.0)


def test_restore_bookkeeping_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core_state, "MAX_RESTORE_REVOKED", 50, raising=False)
    clock = Clock()
    core = _core(tmp_path, clock, size=1000, end=5000)
    w = core.join("w").id
    for i in range(120):  # each restore discards a shard id that is never planned again
        (grant,) = core.lease(w, "d").leases
        core.ack(w, grant.shard_id, grant.attempt, grant.start + 1)
        cut = core.cut_prepare()
        core.cut_commit(cut.id)
        core.restore(cut_id=cut.id)
        assert grant.shard_id in core.restore_revoked, i  # the newest are remembered (precise ack errors)
    assert len(core.restore_revoked) <= 50, f"{len(core.restore_revoked)} revoked shard ids remembered"


def test_deleted_kv_keys_leave_no_rows_and_versions_are_never_reused(master: MasterProcess) -> None:
    from streamrover.trainers.torch.rendezvous import MasterStore

    client = ShardClient(master.address, token=master.token, heartbeat=False)
    store = MasterStore(client, "rdzv/job/store")
    for i in range(50):
        store.set(f"k{i}", b"v")
        assert store.delete_key(f"k{i}")
    assert not store.check(["k0"])
    ((rows,),) = _journal_rows(master, "SELECT COUNT(*) FROM kv")
    assert rows == 0, f"{rows} key-value rows left after every key was deleted"

    assert client.kv_set("again", b"1", 0)[:2] == (True, b"1")
    _, _, first = client.kv_set("again", b"2", client.kv_get("again")[1])  # type: ignore[index]
    assert client.kv_delete("again", first) == (True, b"", 0)
    ok, _, reborn = client.kv_set("again", b"3", 0)
    assert ok and reborn > first, "a key created again must not reuse an old version (a stale CAS would win)"
    assert client.kv_set("again", b"stale", first)[0] is False
    client.close()


def test_a_sparse_partitions_runs_stay_bounded_once_committed(tmp_path: Path) -> None:
    """One run per Pulsar ledger: the runs below the committed positions are folded, counts stay exact."""
    bits, per_ledger, ledgers = 16, 10, 60
    spec = DatasetSpec("p", "pulsar://x/t", options={"sr.max_delay_ms": "0"}, records_per_shard=per_ledger)
    clock = Clock()
    core = ShardCore(Journal(tmp_path / "j.db"), lease_ttl=60.0, clock=clock)
    start = 1 << bits
    core.register_dataset(spec, SourceKind.STREAM, [Partition("t", start, start)], "[]")
    w = core.join("w").id
    seen: list[tuple[int, int]] = []
    for ledger in range(1, ledgers + 1):  # a rollover every poll; the source reports every ledger it saw
        seen.append((ledger << bits, ledger << bits | per_ledger))
        core.extend_stream("p", [Partition("t", start, seen[-1][1], segments=tuple(seen))], force=True)
        for grant in core.lease(w, "p", 16).leases:
            core.ack(w, grant.shard_id, grant.attempt, grant.end)
        core.cut_commit(core.cut_prepare().id)  # upstream commits lag one checkpoint
    ds = core.datasets["p"]
    total = ledgers * per_ledger
    assert len(ds.runs[0]) <= 4, f"{len(ds.runs[0])} runs kept for {ledgers} ledgers, all committed"
    counts = core.counts(ds)
    assert (counts.records_acked, counts.records_committed, core.lag(ds)[0][2]) == (total, total, 0)
    assert core.planned_records(ds) == total
    core.journal.close()

    again = ShardCore(Journal(tmp_path / "j.db"), lease_ttl=60.0, clock=clock)  # a restarted master
    ds = again.datasets["p"]
    rows = again.journal._db.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
    assert rows <= 4 and len(ds.runs[0]) <= 4, f"{rows} rows of runs journalled"
    # a restarted source reports the first ledger's first entry again (and everything it walks): ignored
    newest = seen[-1][1]
    again.extend_stream("p", [Partition("t", start, newest, segments=((start, start + 1), *seen[-2:]))])
    assert again.planned_records(ds) == total and again.counts(ds).records_committed == total
    seen.append(((ledgers + 1) << bits, (ledgers + 1) << bits | 5))  # records still arrive, counted as records
    again.extend_stream("p", [Partition("t", start, seen[-1][1], segments=tuple(seen))], force=True)
    assert again.lag(ds)[0][2] == 5 and again.planned_records(ds) == total + 5


@given(st.lists(st.tuples(st.integers(0, 300), st.integers(1, 20)), max_size=8), st.integers(0, 330))
def test_folded_runs_keep_every_rank_from_the_floor_and_ignore_what_is_reported_below(
    raw: list[tuple[int, int]], floor: int
) -> None:
    runs = RecordRuns((s, s + n) for s, n in raw)
    before = RecordRuns(list(runs))
    runs.compact(floor)
    assert sum(1 for a, _ in runs if a < floor) <= 1  # folded into one
    runs.add((s, s + n) for s, n in raw)  # reported again (a restarted source): nothing below the floor comes back
    first = next(iter(before), (0, 0))[0]
    for x in range(floor, 340):
        assert runs.rank(x) == before.rank(x) and runs.count(first, x) == before.count(first, x)


def test_rendezvous_rounds_leave_the_keys_of_two_rounds_at_most(master: MasterProcess) -> None:
    """torch's dynamic rendezvous prefixes every round's store keys with the round: done rounds are removed."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from streamrover.trainers.torch.rendezvous import create_rdzv_handler

    handler = create_rdzv_handler(RendezvousParameters("streamrover", master.address, "job", 1, 1, token=master.token))
    for round_ in range(12):  # an agent's restarts: each one a new round, its ranks assigned through the store
        store = handler.next_rendezvous().store
        store.set("torchelastic/role_info/0", f"role-{round_}")
        store.multi_set(["torchelastic/assigned_ranks/0"], [f"[{round_}, 1, 0, 1]"])
        assert store.get("torchelastic/assigned_ranks/0") == f"[{round_}, 1, 0, 1]".encode()
    keys = [k for (k,) in _journal_rows(master, "SELECT key FROM kv WHERE key LIKE 'rdzv/job/store/%' ORDER BY key")]
    assert len(keys) <= 6, f"{len(keys)} rendezvous store keys kept after 12 rounds: {keys}"
    assert store.get("torchelastic/role_info/0") == b"role-11"  # the current round's keys are all there

    client = ShardClient(master.address, token=master.token, heartbeat=False)
    _, _, first = client.kv_set("r/a", b"1", 0)
    with pytest.raises(InvalidArgumentError, match="range end above it"):
        client.kv_delete_range("r/b", "r/a")
    assert client.kv_delete_range("r/", "r0") == 1 and client.kv_get("r/a") is None
    ok, _, reborn = client.kv_set("r/a", b"2", 0)
    assert ok and reborn > first, "a key removed by a range delete must not see its version reused"
    client.close()


def test_a_restores_replan_of_a_long_stream_costs_what_is_left_not_its_history() -> None:
    # The soak's master grew ~200 bytes per ack for 40 minutes: every restore re-planned a stream by building the
    # whole grid of the partition's history (one PlannedShard per shard since the stream began, to rank the few
    # left), a peak that grew with the stream and that the allocators kept. 4M records planned, 100 left.
    size, end = 20, 4_000_000
    parts = [PartitionPlan(i, f"t-{i}", 0, end) for i in range(2)]
    done = {(0, p.id): IntervalSet([(0, end - 100)]) for p in parts}
    tracemalloc.start()
    try:
        planned = plan_epoch(parts, 0, size, False, 0, done)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [(p.partition.index, p.start, p.end) for p in planned] == [
        (i, s, s + size) for i in range(2) for s in range(end - 100, end, size)
    ]
    assert peak < 256 << 10, f"re-planning 10 shards left of a 4M-record stream took {peak / 2**20:.1f} MiB"


@given(
    st.lists(st.tuples(st.integers(0, 50), st.integers(0, 400)), min_size=1, max_size=4),
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 400), st.integers(1, 60)), max_size=6),
    st.integers(1, 30),
)
def test_an_unshuffled_replan_leases_in_partition_then_position_order(
    extents: list[tuple[int, int]], done: list[tuple[int, int, int]], size: int
) -> None:
    parts = [PartitionPlan(i, f"p{i}", s, s + n) for i, (s, n) in enumerate(extents)]
    covered: dict[tuple[int, str], IntervalSet] = {}
    for i, s, n in done:
        if i < len(parts):
            covered.setdefault((0, parts[i].id), IntervalSet()).update(IntervalSet([(s, s + n)]))
    planned = plan_epoch(parts, 0, size, False, 0, covered)
    order = [(p.partition.index, p.start) for p in planned]
    assert order == sorted(order)
    for p in parts:
        missing = IntervalSet(list(covered.get((0, p.id), IntervalSet()).missing(p.start, p.end)))
        mine = [(s.start, s.end) for s in planned if s.partition.index == p.index]
        assert IntervalSet(mine).to_list() == missing.to_list()
        assert all(b - a <= size for a, b in mine)


def test_shards_acked_through_the_clients_ack_leave_its_lease_table(tmp_path: Path, master: MasterProcess) -> None:
    # The soak's workers lease with ShardClient.lease and ack with ShardClient.ack(lease, ...) (not LeasedShard.ack):
    # no finished shard left the client's lease table, so every heartbeat carried all of them (158 KB a second
    # after 3 minutes), which the master decoded and its allocators kept ever bigger holes for.
    write_parquet_dataset(tmp_path / "d", 200, files=1, row_group_size=200)
    with ShardClient(master.address, token=master.token, heartbeat=False, timeout=30) as c:
        c.register_dataset(DatasetSpec("d", str(tmp_path / "d"), records_per_shard=10))
        c.join()
        shards = []
        for i in range(20):
            _, (shard,) = c.lease("d")
            shards.append(shard)
            lease = shard.lease
            c.ack(lease, lease.start + 5, wait=True)
            c.ack(lease, lease.end, wait=i % 2 == 0)  # synchronous, and queued
        c.flush()
        held = c.leases.progress()
        assert held == [], f"{len(held)} finished shards still held (and sent with every heartbeat)"
        assert all(s.done and s.acked == s.lease.end for s in shards)
