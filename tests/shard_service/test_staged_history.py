"""A staged dataset's cost follows its live files, not every file it ever committed (issue 32, piece 3).

Two cores, each on its own SQLite journal in this process: one takes 50 committed files, the other 5,000 (100
commits of 50 files: a sink's checkpoints), each file trained and its cut committed twice (two durable
checkpoints: no restore can need it), as a job does. Then both journals' sizes and their cut commits' times are
compared. The work of a cut commit with the same files live is the same in both, so only noise separates them:
the commits are timed alternately, one core then the other, and the medians compared (a machine's drift hits
both alike); 2x is far outside that noise, and far below what history cost before (x30 at 5,000 files).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest

from streamrover.cursor import DataCursor, IntervalSet, PartitionKey
from streamrover.shard_service.api import DatasetSpec, FailedPreconditionError
from streamrover.shard_service.master.bookkeeping import AckItem
from streamrover.shard_service.master.core import ShardCore
from streamrover.shard_service.master.journal import Journal
from streamrover.sources.api import SourceKind
from streamrover.sources.staged import FileFacts
from tests.shard_service.fake_clock import Clock

SCHEMA = '[["id", "int64"]]'
PER_COMMIT = 50
ROWS = 20


def _core(path: Path) -> ShardCore:
    core = ShardCore(Journal(path / "j.db", exclusive=True), lease_ttl=60.0, clock=Clock())
    core.register_dataset(DatasetSpec("s", "staged://s", "parquet", records_per_shard=ROWS), SourceKind.STREAM, [],
                          SCHEMA)  # fmt: skip
    return core


def _round(core: ShardCore, epoch: int) -> None:
    """One sink checkpoint: PER_COMMIT files committed, trained and acked, then two cuts committed."""
    files = [FileFacts(f"/staged/s/{epoch}/f{i}.parquet", ROWS, SCHEMA) for i in range(PER_COMMIT)]
    core.commit_staged("s", "job", "0", epoch, files)
    w = core.join("w").id
    leased = core.lease(w, "s", 10 * PER_COMMIT).leases
    core.ack_batch([AckItem(w, g.shard_id, g.attempt, g.end) for g in leased])
    core.leave(w)
    for _ in range(2):
        core.cut_commit(core.cut_prepare().id)


def _commit_seconds(core: ShardCore) -> float:
    t0 = time.perf_counter()
    core.cut_commit(core.cut_prepare().id)
    return time.perf_counter() - t0


def _journal_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("j.db*"))


def test_journal_and_cut_commit_stay_flat_from_50_to_5000_files(tmp_path: Path) -> None:
    small, large = _core(tmp_path / "small"), _core(tmp_path / "large")
    _round(small, 0)
    for epoch in range(5000 // PER_COMMIT):
        _round(large, epoch)
    for core in (small, large):  # the same live state in both: one more file each, being trained
        _round(core, 10_000)

    times: dict[str, list[float]] = {"small": [], "large": []}
    for _ in range(15):
        times["small"].append(_commit_seconds(small))
        times["large"].append(_commit_seconds(large))
    small_s, large_s = statistics.median(times["small"]), statistics.median(times["large"])
    small.journal.close()
    large.journal.close()
    small_b, large_b = _journal_bytes(tmp_path / "small"), _journal_bytes(tmp_path / "large")
    print(f"journal {small_b:,} -> {large_b:,} bytes; cut commit {small_s * 1e3:.2f} -> {large_s * 1e3:.2f} ms")
    assert large_b <= 2 * small_b, f"the journal grew with history: {small_b:,} -> {large_b:,} bytes"
    assert large_s <= 2 * small_s, f"a cut commit grew with history: {small_s * 1e3:.2f} -> {large_s * 1e3:.2f} ms"

    again = _core(tmp_path / "large")  # replayed: every file's records are committed, none of them is held
    ds = again.dataset("s")
    assert ds.planned_records() == 5050 * ROWS and again.counts(ds).records_committed == 5050 * ROWS
    assert len(list(ds.partitions)) <= PER_COMMIT, "compacted files are not held after a restart"
    committed = again.committed
    assert committed.size() == 5050 * ROWS and len(committed.keys()) <= PER_COMMIT + 1


def test_a_cursor_from_before_compaction_restores_exactly_or_is_refused(tmp_path: Path) -> None:
    core = _core(tmp_path)
    files = [FileFacts(f"/staged/s/0/f{i}.parquet", ROWS, SCHEMA) for i in range(4)]
    core.commit_staged("s", "job", "0", 0, files)
    w = core.join("w").id
    core.ack_batch([AckItem(w, g.shard_id, g.attempt, g.end) for g in core.lease(w, "s", 10).leases])
    core.cut_commit(core.cut_prepare().id)
    before = core.committed  # a checkpoint's cursor: file by file
    assert len(before.keys()) == 4
    core.cut_commit(core.cut_prepare().id)  # a second durable checkpoint: no restore this master takes needs them
    assert len(core.committed.keys()) == 1 and core.committed.size() == 4 * ROWS, "compacted into one interval"
    assert len(list(core.dataset("s").partitions)) == 0

    assert core.restore(cursor=before) == (0, 0), "the files' records are all in it: nothing to read again"
    assert core.committed.size() == 4 * ROWS
    partial = DataCursor({k: v for k, v in before.items() if k.partition != files[0].uri})
    with pytest.raises(FailedPreconditionError, match="compacted its first 80 records .* holds 60 of them"):
        core.restore(cursor=partial)
    with pytest.raises(FailedPreconditionError, match="compacted its first 80 records"):
        core.restore(cursor=DataCursor(), discard_committed=True)
    bad = DataCursor({PartitionKey("s", 0, "<compacted>"): IntervalSet([(0, 81)])})
    with pytest.raises(FailedPreconditionError, match="holds 81 of them"):
        core.restore(cursor=bad)
    later = FileFacts("/staged/s/1/g.parquet", ROWS, SCHEMA)  # the dataset goes on after the compaction
    core.commit_staged("s", "job", "0", 1, [later])
    (g,) = core.lease(w, "s", 10).leases
    assert (g.partition.id, g.partition.index, g.start, g.end) == (later.uri, 4, 0, ROWS)
