"""Focused behaviours of the core: queue order, steps in cuts, restore to an older cursor, compaction."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streamrover.cursor import DataCursor, IntervalSet, PartitionKey
from streamrover.shard_service.api import DatasetSpec, LeaseStatus
from streamrover.shard_service.master.core import ShardCore
from streamrover.shard_service.master.journal import Journal
from streamrover.sources.api import Partition, SourceKind
from tests.shard_service.fake_clock import Clock


@pytest.fixture
def clock() -> Clock:
    return Clock()


def _core(path: Path, clock: Clock) -> ShardCore:
    return ShardCore(Journal(path / "j.db"), lease_ttl=5.0, clock=clock)


def _register(core: ShardCore, epochs: int = 1, size: int = 10) -> None:
    spec = DatasetSpec("d", "mem://", records_per_shard=size, epochs=epochs)
    core.register_dataset(spec, SourceKind.BATCH, [Partition("p0", 0, 30), Partition("p1", 0, 25)], "[]")


def test_expired_shard_goes_to_the_front_and_resumes_after_its_ack(tmp_path: Path, clock: Clock) -> None:
    core = _core(tmp_path, clock)
    _register(core)
    a = core.join("a").id
    (first,) = core.lease(a, "d").leases
    core.ack(a, first.shard_id, first.attempt, first.start + 4)
    clock.now += 6  # a misses its heartbeats
    b = core.join("b").id
    (again,) = core.lease(b, "d").leases
    assert again.shard_id == first.shard_id and again.resume == first.start + 4 and again.attempt > first.attempt
    assert a not in core.workers


def test_wait_while_everything_is_leased_then_end(tmp_path: Path, clock: Clock) -> None:
    core = _core(tmp_path, clock)
    _register(core, size=100)
    w = core.join("w").id
    grants = core.lease(w, "d", 5).leases
    assert len(grants) == 2
    waiting = core.lease(w, "d")
    assert waiting.status is LeaseStatus.WAIT and 0 < waiting.retry_after <= 1.0
    for g in grants:
        core.ack(w, g.shard_id, g.attempt, g.end)
    assert core.lease(w, "d").status is LeaseStatus.END


def test_a_retried_lease_request_returns_the_same_leases(tmp_path: Path, clock: Clock) -> None:
    core = _core(tmp_path, clock)
    _register(core)
    w = core.join("w").id
    first = core.lease(w, "d", 2, request_id=7)
    retry = core.lease(w, "d", 2, request_id=7)
    assert [g.shard_id for g in retry.leases] == [g.shard_id for g in first.leases]
    assert [g.attempt for g in retry.leases] == [g.attempt for g in first.leases]


def test_cut_by_step_includes_only_acks_up_to_that_step(tmp_path: Path, clock: Clock) -> None:
    core = _core(tmp_path, clock)
    _register(core)
    w = core.join("w").id
    (g,) = core.lease(w, "d").leases
    core.ack(w, g.shard_id, g.attempt, 3, step=1)
    core.ack(w, g.shard_id, g.attempt, 7, step=2)
    key = PartitionKey("d", 0, "p0")
    assert core.cut_prepare(step=1).cursor.get(key) == IntervalSet([(0, 3)])
    assert core.cut_prepare(step=2).cursor.get(key) == IntervalSet([(0, 7)])
    assert core.cut_prepare().cursor.get(key) == IntervalSet([(0, 7)])


def test_restore_to_an_older_cursor_replans_compacted_shards(tmp_path: Path, clock: Clock) -> None:
    core = _core(tmp_path, clock)
    _register(core)
    w = core.join("w").id
    while (out := core.lease(w, "d")).status is LeaseStatus.OK:
        (g,) = out.leases
        core.ack(w, g.shard_id, g.attempt, g.end)
    done = core.cut_prepare()
    core.cut_commit(done.id)
    assert not core.shards  # compacted
    older = DataCursor()
    older.add(PartitionKey("d", 0, "p0"), 0, 12)  # a checkpoint that had seen only 12 rows of p0
    _revoked, requeued = core.restore(cursor=older)
    assert requeued == 55 - 12
    ranges = sorted((s.pindex, s.start, s.end) for s in core.shards.values())
    assert ranges == [(0, 12, 20), (0, 20, 30), (1, 0, 10), (1, 10, 20), (1, 20, 25)]
    assert core.committed == older


def test_epochs_are_planned_lazily_and_all_consumed(tmp_path: Path, clock: Clock) -> None:
    core = _core(tmp_path, clock)
    _register(core, epochs=3)
    w = core.join("w").id
    seen: dict[int, int] = {}
    while (out := core.lease(w, "d")).status is LeaseStatus.OK:
        (g,) = out.leases
        assert core.datasets["d"].epochs_planned <= g.epoch + 2
        seen[g.epoch] = seen.get(g.epoch, 0) + g.end - g.resume
        core.ack(w, g.shard_id, g.attempt, g.end)
    assert seen == {0: 55, 1: 55, 2: 55}


def test_journal_is_compacted(tmp_path: Path, clock: Clock) -> None:
    """Many epochs through lease/ack/commit: the journal holds no more rows than one epoch's worth."""
    core = _core(tmp_path, clock)
    _register(core, epochs=40, size=5)
    w = core.join("w").id
    peak = 0
    while (out := core.lease(w, "d", 4)).status is LeaseStatus.OK:
        for g in out.leases:
            core.ack(w, g.shard_id, g.attempt, g.end)
        cut = core.cut_prepare()
        core.cut_commit(cut.id)
        rows = core.journal._db.execute("SELECT COUNT(*) FROM shards").fetchone()[0]
        cuts = core.journal._db.execute("SELECT COUNT(*) FROM cuts").fetchone()[0]
        peak = max(peak, rows)
        assert cuts <= 8 + 1
    assert peak <= 11 + 4  # one epoch is 11 shards
    assert core.journal._db.execute("SELECT COUNT(*) FROM shards").fetchone()[0] == 0
    assert core.committed.size() == 40 * 55


@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 15)), max_size=30), st.integers(0, 60), st.integers(0, 60))
def test_interval_set_matches_a_python_set(adds: list[tuple[int, int]], a: int, b: int) -> None:
    ivs = IntervalSet()
    model: set[int] = set()
    for start, length in adds:
        ivs.add(start, start + length)
        model.update(range(start, start + length))
    assert ivs.size() == len(model)
    assert all((p in ivs) == (p in model) for p in range(-1, 80))
    runs = ivs.intervals()
    assert all(e1 < s2 for (_, e1), (s2, _) in itertools.pairwise(runs)), "runs are disjoint and not adjacent"
    lo, hi = min(a, b), max(a, b)
    assert ivs.covers(lo, hi) == all(p in model for p in range(lo, hi))
    assert ivs.overlaps(lo, hi) == any(p in model for p in range(lo, hi))
    gaps = ivs.missing(lo, hi)
    assert {p for s, e in gaps for p in range(s, e)} == set(range(lo, hi)) - model
    assert IntervalSet.from_list(ivs.to_list()) == ivs


def test_cursor_json_round_trip_and_errors() -> None:
    cursor = DataCursor()
    cursor.add(PartitionKey("d", 0, "p#rg1"), 0, 10)
    cursor.add(PartitionKey("d", 1, "p#rg1"), 5, 9)
    assert DataCursor.from_json(cursor.to_json()) == cursor
    from streamrover.cursor import CursorError

    with pytest.raises(CursorError, match="version"):
        DataCursor.from_json('{"version": 9}')
    with pytest.raises(CursorError, match="reversed"):
        DataCursor.from_json('{"version": 1, "datasets": {"d": {"0": {"p": [[5, 1]]}}}}')
    with pytest.raises(CursorError, match="not valid JSON"):
        DataCursor.from_json("{")


def test_cut_prepare_is_idempotent_per_step_until_a_commit_or_restore(tmp_path: Path, clock: Clock) -> None:
    core = _core(tmp_path, clock)
    _register(core)
    w = core.join("w").id
    (g,) = core.lease(w, "d").leases
    core.ack(w, g.shard_id, g.attempt, 3, step=1)
    first = core.cut_prepare(step=1)
    core.ack(w, g.shard_id, g.attempt, 5, step=1)  # too late for step 1's cut: the first call fixed it
    again = core.cut_prepare(step=1)
    assert again.id == first.id and again.cursor == first.cursor
    assert core.cut_prepare(step=2).id != first.id
    core.cut_commit(first.id)
    assert core.cut_prepare(step=1).id == first.id  # the committed cut of that step, committing it is a no-op
    core.restore(DataCursor(), discard_committed=True)
    assert core.cut_prepare(step=1).id != first.id  # a new timeline: a new cut


def test_lost_positions_travel_with_the_cursor_apart_from_the_trained_ones() -> None:
    key = PartitionKey("s", 0, "t-0")
    cursor = DataCursor()
    cursor.add(key, 300, 1000)
    cursor.add_lost(key, 0, 300)
    text = cursor.to_json()
    back = DataCursor.from_json(text)
    assert back == cursor
    assert back.get(key) == IntervalSet([(300, 1000)]) and back.get_lost(key) == IntervalSet([(0, 300)])
    assert back.size() == 700 and back.lost_size() == 300  # lost is never counted as trained
    assert back != DataCursor({key: IntervalSet([(300, 1000)])})
    merged = DataCursor()
    merged.update(back.only("s"))
    assert merged.lost_items() == [(key, IntervalSet([(0, 300)]))]
    assert "lost" not in DataCursor({key: IntervalSet([(0, 1)])}).to_json()  # unchanged format without losses
