"""Stream-time order in the shard table: held shards wait for their times, the queue follows them, the skew
bound (sr.max_skew_ms) refuses shards too far ahead of the oldest one not yet acked, and all of it survives a
master restart (the times are journalled)."""

from __future__ import annotations

from pathlib import Path

from streamrover.shard_service.api import DatasetSpec, LeaseStatus
from streamrover.shard_service.master.core import ShardCore
from streamrover.shard_service.master.journal import Journal
from streamrover.sources.api import Partition, SourceKind
from tests.shard_service.fake_clock import Clock


def _core(path: Path, clock: Clock) -> ShardCore:
    return ShardCore(Journal(path / "j.db"), lease_ttl=5.0, clock=clock)


def _timed_stream(core: ShardCore, skew_ms: int) -> dict[str, float]:
    """Two partitions of 3 shards each, held, then timed: p1's records are all older than p0's second shard."""
    spec = DatasetSpec("d", "mem://", records_per_shard=10, options={"sr.max_skew_ms": str(skew_ms)})
    parts = [Partition(f"p{i}", 0, 0) for i in range(2)]
    core.register_dataset(spec, SourceKind.STREAM, parts, "[]", timed=True)
    core.extend_stream("d", [Partition(f"p{i}", 0, 30) for i in range(2)], timed=True)
    times = {"d/0/0/0-10": 0.0, "d/0/0/10-20": 5_000.0, "d/0/0/20-30": 9_000.0,
             "d/0/1/0-10": 1_000.0, "d/0/1/10-20": 2_000.0, "d/0/1/20-30": 3_000.0}  # fmt: skip
    assert {s.id for s in core.untimed("d")} == set(times)
    return times


def test_held_shards_wait_for_their_times_then_go_in_time_order(tmp_path: Path) -> None:
    core = _core(tmp_path, Clock())
    times = _timed_stream(core, 0)  # no bound: order only
    w = core.join("a").id
    assert core.lease(w, "d").status is LeaseStatus.WAIT  # nothing timed yet: nothing leased
    core.set_times("d", times)
    got = [g.shard_id for g in core.lease(w, "d", 6).leases]
    assert got == sorted(times, key=times.__getitem__)


def test_no_shard_is_leased_beyond_the_bound_even_after_a_restart(tmp_path: Path) -> None:
    clock = Clock()
    core = _core(tmp_path, clock)
    core.set_times("d", _timed_stream(core, 2_500))
    a, b = core.join("a").id, core.join("b").id
    first = core.lease(a, "d").leases[0]
    assert first.shard_id == "d/0/0/0-10"  # time 0: the oldest
    # within 2.5 s of the oldest not acked: p1's 1 s and 2 s shards; not its 3 s one, nor p0's 5 s
    got = [g.shard_id for g in core.lease(b, "d", 4).leases]
    assert got == ["d/0/1/0-10", "d/0/1/10-20"]
    core.journal.close()
    core = _core(tmp_path, clock)  # a master restart: times and bound from the journal
    assert core.lease(b, "d").status is LeaseStatus.WAIT  # (b's leases are kept; still nothing within the bound)
    core.ack(a, first.shard_id, first.attempt, first.end)  # the oldest is now 1 s: up to 3.5 s
    assert [g.shard_id for g in core.lease(b, "d", 4).leases] == ["d/0/1/20-30"]
    assert core.stream_time.skew_ms(core, "d") == 2_000.0  # leased: 1 s, 2 s, 3 s


def test_shards_at_the_head_are_leased_at_once_after_the_newest_time(tmp_path: Path) -> None:
    core = _core(tmp_path, Clock())
    times = _timed_stream(core, 0)
    core.set_times("d", times)
    w = core.join("a").id
    assert len(core.lease(w, "d", 6).leases) == 6
    # the head: less than a shard's worth waiting in each partition (a partial shard at once, sr.max_delay_ms 0
    # is forced here): planning order is time order, so nothing waits for the poller to read times
    core.extend_stream("d", [Partition(f"p{i}", 0, 35) for i in range(2)], force=True, timed=True)
    assert core.untimed("d") == []
    got = core.lease(w, "d", 2).leases
    assert [g.shard_id for g in got] == ["d/0/0/30-35", "d/0/1/30-35"]
    assert all(core.shards[g.shard_id].time > max(times.values()) for g in got)  # after every known time
    # a backlog again (more than a shard's worth waiting): held until its times are read
    core.extend_stream("d", [Partition(f"p{i}", 0, 50) for i in range(2)], force=True, timed=True)
    assert {s.id for s in core.untimed("d")} == {"d/0/0/35-45", "d/0/1/35-45", "d/0/0/45-50", "d/0/1/45-50"}
    assert core.lease(w, "d").status is LeaseStatus.WAIT


def test_a_small_backlog_is_split_for_idle_workers_but_not_into_tiny_shards(tmp_path: Path) -> None:
    core = _core(tmp_path, Clock())
    core.register_dataset(DatasetSpec("d", "mem://", records_per_shard=10_000), SourceKind.STREAM,
                          [Partition("p0", 0, 0)], "[]")  # fmt: skip
    core.join("a"), core.join("b")
    core.extend_stream("d", [Partition("p0", 0, 2_000)], force=True)  # two idle workers: a piece each
    assert sorted((s.start, s.end) for s in core.shards_of("d")) == [(0, 1_000), (1_000, 2_000)]
    core.extend_stream("d", [Partition("p0", 0, 2_600)], force=True)  # two shards wait: no worker idle
    core.lease(core.join("c").id, "d", 2)
    core.extend_stream("d", [Partition("p0", 0, 3_200)], force=True)  # 600: not cut under MIN_SPLIT (500)
    assert sorted((s.start, s.end) for s in core.shards_of("d"))[2:] == [(2_000, 2_600), (2_600, 3_200)]


def test_the_lag_follows_the_acks_not_the_checkpoints(tmp_path: Path) -> None:
    core = _core(tmp_path, Clock())
    core.register_dataset(DatasetSpec("d", "mem://", records_per_shard=10), SourceKind.STREAM,
                          [Partition("p0", 0, 0)], "[]")  # fmt: skip
    core.extend_stream("d", [Partition("p0", 0, 30)], force=True)
    w = core.join("a").id
    first = core.lease(w, "d").leases[0]
    assert core.lag(core.datasets["d"])[0][2] == 30
    core.ack(w, first.shard_id, first.attempt, first.end)  # applied, no cut committed yet
    assert core.lag(core.datasets["d"])[0][2] == 20
