"""Small shards merged at lease time (``merge_records``): one lease for a run of never-leased shards.

The core is driven directly (exact grants, a restart on the same journal, expiry and stale acks);
then through a master and ShardClient.shards(), whose pace asks for merging once it is known.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from streamrover.cursor import IntervalSet, PartitionKey
from streamrover.shard_service import StaleLeaseError
from streamrover.shard_service.api import DatasetSpec, LeaseStatus, ShardState, shard_id_for
from streamrover.shard_service.master.core import ShardCore
from streamrover.shard_service.master.merging import sized_by_records
from streamrover.sources.api import Partition, SourceKind
from streamrover.testing.procs import MasterProcess
from tests.helpers import write_parquet_dataset
from tests.shard_service.fake_clock import Clock, core_on
from tests.shard_service.queued import queued_client


def _register(core: ShardCore, shuffle: bool = False) -> None:
    """p0: six shards of 5 records, p1: five."""
    spec = DatasetSpec("d", "mem://", records_per_shard=5, shuffle=shuffle)
    core.register_dataset(spec, SourceKind.BATCH, [Partition("p0", 0, 30), Partition("p1", 0, 25)], "[]")


def _spans(core: ShardCore) -> list[tuple[int, int, int, str]]:
    return sorted((s.pindex, s.start, s.end, s.state.value) for s in core.shards.values())


def test_a_run_of_fresh_shards_is_leased_as_one_shard_and_journalled_so(tmp_path: Path) -> None:
    clock = Clock()
    core = core_on(tmp_path, clock)
    _register(core)
    w = core.join("w").id
    (g,) = core.lease(w, "d", 4, merge_records=100).leases
    assert (g.shard_id, g.start, g.end, g.resume, g.shards) == (shard_id_for("d", 0, 0, 0, 20), 0, 20, 0, 4)
    states = core.state_counts["d"]
    assert (states[ShardState.TODO], states[ShardState.LEASED]) == (7, 1)  # 11 planned: 4 became one
    # the journal holds the merged shard and not its members: a master restarted on it agrees
    core.journal.close()
    again = core_on(tmp_path, clock)
    assert _spans(again) == _spans(core)
    assert (0, 0, 20, "leased") in _spans(again) and not any(s[1] in (5, 10, 15) and s[0] == 0 for s in _spans(again))
    # acking the merged shard's end finishes it; its records are acked once, as a shard's
    assert again.ack(w, g.shard_id, g.attempt, 20).shard_done
    assert again.acked_cursor().get(PartitionKey("d", 0, "p0")) == IntervalSet([(0, 20)])


def test_merging_stops_at_the_record_cap_the_partition_and_the_shards_asked_for(tmp_path: Path) -> None:
    core = core_on(tmp_path, Clock())
    _register(core)
    w = core.join("w").id
    grants = core.lease(w, "d", 9, merge_records=15).leases  # at most 3 shards' records per merged shard
    assert [(g.partition.id, g.start, g.end, g.shards) for g in grants] == [
        ("p0", 0, 15, 3),
        ("p0", 15, 30, 3),  # the partition ends: p1 starts a new shard
        ("p1", 0, 15, 3),
    ]
    assert sum(g.shards for g in grants) == 9
    (single,) = core.lease(w, "d", 1, merge_records=15).leases  # one asked for: one planned shard
    assert (single.start, single.end, single.shards) == (15, 20, 1)


def test_far_from_the_end_the_last_merge_runs_past_the_shards_asked_for_to_its_records_limit(tmp_path: Path) -> None:
    """A refill asks for the few shards its reader is short of; granted only those, a row group's run of 14 went as
    3 + 11: a lease and an ack more, per row group. Near the end the share still binds (the tests above)."""
    core = core_on(tmp_path, Clock())
    spec = DatasetSpec("d", "mem://", records_per_shard=5)
    core.register_dataset(spec, SourceKind.BATCH, [Partition("p0", 0, 70), Partition("p1", 0, 500)], "[]")
    w = core.join("w").id
    (g,) = core.lease(w, "d", 3, merge_records=100).leases
    assert (g.partition.id, g.start, g.end, g.shards) == ("p0", 0, 70, 14), "the run goes on to its partition's end"
    grants = core.lease(w, "d", 3, merge_records=50).leases
    assert [(g.partition.id, g.start, g.end, g.shards) for g in grants] == [("p1", 0, 50, 10)], "to the records cap"
    assert [g.shards for g in core.lease(w, "d", 3).leases] == [1, 1, 1], "no merge_records: no merging, no more"


def test_a_retried_lease_request_answers_a_merged_lease_as_first_answered(tmp_path: Path) -> None:
    """A lease request whose answer was lost is retried with its request id: the same leases come back, a merged one
    with its planned shards (it said one, and the reader's pace and depth counted 4 shards of work as one)."""
    core = core_on(tmp_path, Clock())
    _register(core)
    w = core.join("w").id
    (first,) = core.lease(w, "d", 4, request_id=7, merge_records=20).leases
    (again,) = core.lease(w, "d", 4, request_id=7, merge_records=20).leases
    assert (again.shard_id, again.attempt, again.shards) == (first.shard_id, first.attempt, 4)


def test_nothing_merges_without_merge_records_when_shuffled_or_once_leased(tmp_path: Path) -> None:
    clock = Clock()
    core = core_on(tmp_path / "a", clock)
    _register(core)
    w = core.join("w").id
    assert [g.end - g.start for g in core.lease(w, "d", 3).leases] == [5, 5, 5]  # the default: no merging

    shuffled = core_on(tmp_path / "b", clock)
    _register(shuffled, shuffle=True)
    v = shuffled.join("v").id
    assert all(g.shards == 1 for g in shuffled.lease(v, "d", 4, merge_records=100).leases)

    # a shard leased once (expired, back at the front) is never merged again, nor merged into
    once = core_on(tmp_path / "c", clock)
    _register(once)
    a = once.join("a").id
    (first,) = once.lease(a, "d", 1).leases
    clock.now += 6  # a misses its heartbeats: its lease returns
    b = once.join("b").id
    grants = once.lease(b, "d", 3, merge_records=100).leases
    assert (grants[0].shard_id, grants[0].shards) == (first.shard_id, 1)
    assert [(g.start, g.end) for g in grants[1:]] == [(5, 15)]  # the fresh ones after it merge


def test_a_merged_shard_is_fenced_as_one_shard(tmp_path: Path) -> None:
    clock = Clock()
    core = core_on(tmp_path, clock)
    _register(core)
    a = core.join("a").id
    (g,) = core.lease(a, "d", 3, merge_records=100).leases
    assert not core.ack(a, g.shard_id, g.attempt, 7).shard_done  # progress inside the merged shard
    clock.now += 6  # a is lost: the merged shard goes back, resuming at 7, and is never split or merged again
    b = core.join("b").id
    (again,) = core.lease(b, "d", 3, merge_records=100).leases[:1]
    assert (again.shard_id, again.resume, again.shards) == (g.shard_id, 7, 1) and again.attempt > g.attempt
    with pytest.raises(StaleLeaseError, match="expired"):
        core.ack(a, g.shard_id, g.attempt, 15)  # the stale attempt is refused, changing nothing
    assert core.ack(b, again.shard_id, again.attempt, 15).shard_done
    assert core.ack(b, again.shard_id, again.attempt, 15).duplicate  # a repeat is harmless
    key = PartitionKey("d", 0, "p0")
    assert core.acked_cursor().get(key) == IntervalSet([(0, 15)])


def test_shards_reader_gets_merged_shards_and_every_record_once(tmp_path: Path, master: MasterProcess) -> None:
    """Through the master: ShardClient.shards() asks for merging; each record is read and acked exactly once."""
    with queued_client(master) as client:
        write_parquet_dataset(tmp_path / "data", 20_000, files=2, row_group_size=5_000)
        dataset = "rows"
        client.register_dataset(DatasetSpec(dataset, str(tmp_path / "data"), records_per_shard=100))
        client.join()
        seen: list[tuple[str, int, int]] = []
        merged = 0
        for shard in client.shards(dataset):
            rows = sum(b.records.num_rows for b in shard.batches(4096))
            assert rows == shard.lease.end - shard.lease.start
            seen.append((shard.lease.partition.id, shard.lease.start, shard.lease.end))
            merged += shard.lease.shards > 1
            shard.ack()
        client.flush()
        info = client.describe_dataset(dataset)
        assert client.lease(dataset)[0] is LeaseStatus.END
    assert merged > 0, "no lease was merged"
    assert len(seen) == len(set(seen)) and sum(e - s for _, s, e in seen) == 20_000
    assert info.records_acked == 20_000


def test_the_guided_end_counts_a_merged_lease_as_its_planned_shards(tmp_path: Path) -> None:
    core = core_on(tmp_path, Clock())
    spec = DatasetSpec("d", "mem://", records_per_shard=5)
    core.register_dataset(spec, SourceKind.BATCH, [Partition("p0", 0, 120)], "[]")  # 24 planned shards
    a, b = core.join("a").id, core.join("b").id
    (big,) = core.lease(a, "d", 12, merge_records=100).leases
    assert big.shards == 12  # half the dataset, as one shard
    assert [g.shards for g in core.lease(b, "d", 1).leases] == [1]  # 11 left to lease
    # a holds 12 planned shards of the 24 (counted as one lease, its share looked like 6 more); it gets one
    assert sum(g.shards for g in core.lease(a, "d", 8).leases) == 1
    # b, holding one, gets its share of a call near the end: ceil(10 left / 2 readers)
    assert sum(g.shards for g in core.lease(b, "d", 8).leases) == 5


def test_a_first_lease_sized_in_records_becomes_counts_of_the_datasets_shards(tmp_path: Path) -> None:
    core = core_on(tmp_path, Clock())
    _register(core)  # 5 records per shard
    ds = core.dataset("d")
    # about 22 records of shards: 5 (ceil); merges of at most 2 shards: 10 records, under the 40 asked
    assert sized_by_records(ds, 128, 40, 22, 2) == (5, 10)
    assert sized_by_records(ds, 3, 40, 22, 2) == (3, 10)  # max_shards still caps it
    assert sized_by_records(ds, 128, 40, 1, 0) == (1, 40)  # less than a shard: one
    assert sized_by_records(ds, 7, 40, 0, 0) == (7, 40)  # no limit in records: as asked
