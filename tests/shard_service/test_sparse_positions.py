"""Sparse positions (Pulsar ledgers) are planned and counted as records, never as position differences.

A stream partition whose positions are ``ledger << 16 | entry`` over ledgers 3, 5 and 8 (150, 120 and
50 records) reports its runs the way the sources/api.py contract says (``Partition.segments``). The gaps
between ledgers are 2**16 positions wide: planning, the restore's re-plan, the shard and record counts,
the lag and the ack rates must all count the 320 records, and the runs must survive a master restart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from streamrover.cursor import DataCursor, IntervalSet, PartitionKey
from streamrover.shard_service.api import DatasetSpec, PartitionPlan
from streamrover.shard_service.master.bookkeeping import DatasetRecord
from streamrover.shard_service.master.core import ShardCore
from streamrover.shard_service.master.journal import Journal
from streamrover.shard_service.master.planner import plan_epoch
from streamrover.sources.api import Partition, SourceKind
from streamrover.sources.positions import RecordRuns
from tests.shard_service.fake_clock import Clock

BITS = 16
LEDGERS = {3: 150, 5: 120, 8: 50}  # ledger id -> entries
TOTAL = sum(LEDGERS.values())
KEY = PartitionKey("p", 0, "t")


def pos(ledger: int, entry: int) -> int:
    return ledger << BITS | entry


def runs(upto: int) -> tuple[tuple[int, int], ...]:
    """The runs of the first ``upto`` ledgers."""
    return tuple((pos(lg, 0), pos(lg, n)) for lg, n in list(LEDGERS.items())[:upto])


def records_in(a: int, b: int) -> int:
    return sum(max(0, min(b, e) - max(a, s)) for s, e in runs(len(LEDGERS)))


def _core(tmp_path: Path, clock: Clock) -> ShardCore:
    return ShardCore(Journal(tmp_path / "j.db"), lease_ttl=60.0, clock=clock)


def _polled_stream(tmp_path: Path, clock: Clock) -> ShardCore:
    """A stream that saw its partition grow over three ledgers, everything planned."""
    core = _core(tmp_path, clock)
    spec = DatasetSpec("p", "pulsar://x/t", options={"sr.max_delay_ms": "500"}, records_per_shard=100)
    core.register_dataset(spec, SourceKind.STREAM, [Partition("t", pos(3, 0), pos(3, 0))], "[]")
    for upto in (1, 2, 3):
        last = list(LEDGERS.items())[upto - 1]
        core.extend_stream("p", [Partition("t", pos(3, 0), pos(last[0], last[1]), segments=runs(upto))])
    clock.now += 1.0  # past the max delay: the next poll plans the partial tail
    core.extend_stream("p", [Partition("t", pos(3, 0), pos(8, 50), segments=runs(3))])
    return core


def _shards(core: ShardCore) -> list[tuple[int, int]]:
    return sorted((s.start, s.end) for s in core.shards.values())


def _ack_all(core: ShardCore) -> str:
    w = core.join("w").id
    while True:
        grants = core.lease(w, "p", 16).leases
        if not grants:
            return w
        for g in grants:
            core.ack(w, g.shard_id, g.attempt, g.end, step=1)


def test_stream_shards_hold_records_not_gaps(tmp_path: Path) -> None:
    core = _polled_stream(tmp_path, Clock())
    shards = _shards(core)
    assert [records_in(a, b) for a, b in shards] == [100, 100, 100, 20]
    assert shards[0][0] == pos(3, 0) and shards[-1][1] == pos(8, 50)


def test_counts_lag_and_rates_count_records(tmp_path: Path) -> None:
    core = _polled_stream(tmp_path, Clock())
    ds = core.datasets["p"]
    assert core.lag(ds)[0][2] == TOTAL  # nothing committed: every record is lag
    assert core.planned_records(ds) == TOTAL
    w = _ack_all(core)
    assert core.workers[w].records_acked == TOTAL
    assert core.ack_log.totals(core.clock())[0] == TOTAL  # what rates() sums
    counts = core.counts(ds)
    assert counts.records_acked == TOTAL and counts.records_committed == 0
    core.cut_commit(core.cut_prepare().id)
    counts = core.counts(ds)
    assert (counts.records_committed, counts.committed) == (TOTAL, 4)
    assert core.lag(ds)[0][2] == 0


def test_restore_replans_records_not_positions_and_survives_a_master_restart(tmp_path: Path) -> None:
    clock = Clock()
    core = _polled_stream(tmp_path, clock)
    _ack_all(core)
    core.cut_commit(core.cut_prepare().id)
    first = DataCursor({KEY: IntervalSet([(pos(3, 0), pos(3, 100))])})
    _revoked, requeued = core.restore(cursor=first)
    shards = _shards(core)
    assert requeued == TOTAL - 100
    assert len(shards) == 3, f"{len(shards)} shards planned after the restore"
    assert [records_in(a, b) for a, b in shards] == [100, 100, 20]
    assert shards[0][0] == pos(3, 100) and shards[-1][1] == pos(8, 50)
    assert core.lag(core.datasets["p"])[0][2] == TOTAL - 100
    core.journal.close()

    again = _core(tmp_path, clock)  # a restarted master knows the runs from its journal
    assert again.lag(again.datasets["p"])[0][2] == TOTAL - 100
    _revoked, requeued = again.restore(cursor=first)
    assert requeued == TOTAL - 100 and len(_shards(again)) == 3


_RUNS = st.lists(st.tuples(st.integers(0, 300), st.integers(1, 20)), max_size=8)


@given(_RUNS, st.integers(0, 330), st.integers(0, 330))
def test_record_runs_count_rank_and_select_agree_with_a_set_of_positions(
    raw: list[tuple[int, int]], a: int, b: int
) -> None:
    runs = RecordRuns((s, s + n) for s, n in raw)
    positions = sorted({p for s, n in raw for p in range(s, s + n)})
    assert runs.count(a, b) == sum(1 for p in positions if a <= p < b)
    assert runs.rank(a) == sum(1 for p in positions if p < a)
    for k, p in enumerate(positions):
        assert runs.select(k) == p
    assert RecordRuns.from_list(runs.to_list()) == runs
    assert sum(y - x for x, y in runs.between(a, b)) == runs.count(a, b)
    assert all(a <= x < y <= b for x, y in runs.between(a, b))


@given(_RUNS, st.lists(st.tuples(st.integers(0, 330), st.integers(1, 40)), max_size=4), st.integers(1, 30))
def test_a_replan_covers_exactly_what_is_missing_in_pieces_of_at_most_size_records(
    raw: list[tuple[int, int]], done: list[tuple[int, int]], size: int
) -> None:
    runs = RecordRuns((s, s + n) for s, n in raw)
    part = PartitionPlan(0, "t", 0, 330)
    covered = IntervalSet([(s, s + n) for s, n in done])
    planned = plan_epoch([part], 0, size, False, 0, {(0, "t"): covered}, {0: runs})
    pieces = sorted((p.start, p.end) for p in planned)
    assert IntervalSet(pieces).to_list() == IntervalSet(covered.missing(0, 330)).to_list()
    assert sum(b - a for a, b in pieces) == sum(b - a for a, b in covered.missing(0, 330))  # no overlap
    for p in planned:
        assert p.records == runs.count(p.start, p.end) <= size
        assert p.records > 0 or all(runs.count(a, b) == 0 for a, b in covered.missing(p.start, p.end))
    assert len(planned) <= sum(-(-runs.count(a, b) // size) + 1 for a, b in covered.missing(0, 330))


@settings(max_examples=40, deadline=None)
@given(st.lists(_RUNS, min_size=1, max_size=6))
def test_the_journal_keeps_the_runs_writing_only_what_changed(tmp_path_factory: Any, polls: list[Any]) -> None:
    journal = Journal(tmp_path_factory.mktemp("runs") / "j.db")
    ds = DatasetRecord(DatasetSpec("p", "pulsar://x/t"), SourceKind.STREAM, [PartitionPlan(0, "t", 0, 400)], "[]")
    ds.runs[0] = RecordRuns()
    for raw in polls:
        ds.runs[0].add((s, s + n) for s, n in raw)
        with journal.transaction():
            journal.put_dataset(ds)
        [loaded] = journal.load_datasets()
        assert loaded.runs.get(0, RecordRuns()) == ds.runs[0]
    journal.close()


def test_a_grown_run_rewrites_one_row_not_all(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.db")
    ds = DatasetRecord(DatasetSpec("p", "pulsar://x/t"), SourceKind.STREAM, [PartitionPlan(0, "t", 0, 0)], "[]")
    ds.runs[0] = RecordRuns((pos(lg, 0), pos(lg, 50)) for lg in range(1, 1001))  # a thousand rolled ledgers
    with journal.transaction():
        journal.put_dataset(ds)
    before = journal._db.total_changes
    ds.runs[0].add([(pos(1000, 0), pos(1000, 60))])  # the newest ledger grew
    with journal.transaction():
        journal.put_dataset(ds)
    assert journal._db.total_changes - before <= 3  # the dataset row, one run deleted and written again
    [(row_bytes,)] = journal._db.execute("SELECT length(partitions) FROM datasets").fetchall()
    assert row_bytes < 100  # the dataset's row does not carry the runs (it is rewritten at every planning)
    assert len(journal.load_datasets()[0].runs[0]) == 1000
    journal.close()
