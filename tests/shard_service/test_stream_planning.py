"""Stream planning in the core: full shards, partial shards after the max delay, backpressure, new partitions, gaps."""

from __future__ import annotations

from pathlib import Path

from streamrover.shard_service.api import DatasetSpec, LeaseStatus, ShardState
from streamrover.shard_service.master.core import ShardCore
from streamrover.shard_service.master.journal import Journal
from streamrover.shard_service.master.streams import full_shards
from streamrover.sources.api import Partition, SourceKind
from tests.shard_service.fake_clock import Clock


def _stream(tmp_path: Path, clock: Clock, **options: str) -> ShardCore:
    core = ShardCore(Journal(tmp_path / "j.db"), lease_ttl=5.0, clock=clock)
    spec = DatasetSpec("s", "kafka://x/t", options={"sr.max_delay_ms": "500", **options}, records_per_shard=100)
    core.register_dataset(spec, SourceKind.STREAM, [Partition("t-0", 10, 10)], "[]")
    return core


def _ranges(core: ShardCore) -> list[tuple[int, int, int]]:
    return sorted((s.pindex, s.start, s.end) for s in core.shards.values())


def test_full_shards_then_a_partial_one_after_the_max_delay(tmp_path: Path) -> None:
    clock = Clock()
    core = _stream(tmp_path, clock)
    core.extend_stream("s", [Partition("t-0", 10, 260)])
    assert _ranges(core) == [(0, 10, 110), (0, 110, 210)]  # 50 records wait for more or for the delay
    clock.now += 0.3
    core.extend_stream("s", [Partition("t-0", 10, 270)])
    assert len(core.shards) == 2
    clock.now += 0.3  # the first unplanned record has waited 0.6 s > 0.5 s
    core.extend_stream("s", [Partition("t-0", 10, 280)])
    assert _ranges(core)[-1] == (0, 210, 280)


def test_backpressure_bounds_unleased_shards(tmp_path: Path) -> None:
    clock = Clock()
    core = _stream(tmp_path, clock, **{"sr.max_pending_shards": "3"})
    core.extend_stream("s", [Partition("t-0", 10, 10 + 100 * 10)])
    assert len(core.shards) == 3
    w = core.join("w").id
    (g,) = core.lease(w, "s").leases
    core.ack(w, g.shard_id, g.attempt, g.end)
    core.extend_stream("s", [Partition("t-0", 10, 10 + 100 * 10)])
    assert core.state_counts["s"][ShardState.TODO] == 3  # one more planned once one was taken
    assert core.lag(core.datasets["s"])[0] == (1010, 10, 900)  # nothing committed yet; 100 applied (acked)


def test_partitions_added_later_start_at_their_first_position(tmp_path: Path) -> None:
    clock = Clock()
    core = _stream(tmp_path, clock)
    core.extend_stream("s", [Partition("t-0", 10, 110), Partition("t-1", 0, 100)])
    assert _ranges(core) == [(0, 10, 110), (1, 0, 100)]
    assert [p.id for p in core.datasets["s"].partitions] == ["t-0", "t-1"]
    w = core.join("w").id
    assert core.lease(w, "s", 5).status is LeaseStatus.OK


def test_gaps_between_runs_are_folded_into_the_next_shard() -> None:
    # A sparse source (Pulsar ledgers): runs [0, 150) and [1_000_000, 1_000_120); the gap holds nothing.
    shards, nxt = full_shards(0, 1_000_120, 100, [(0, 150), (1_000_000, 1_000_120)], limit=100)
    assert shards == [(0, 100), (100, 1_000_050)]
    assert nxt == 1_000_050
    dense, nxt = full_shards(0, 250, 100, None, limit=100)
    assert dense == [(0, 100), (100, 200)] and nxt == 200
    limited, nxt = full_shards(0, 1000, 100, None, limit=2)
    assert limited == [(0, 100), (100, 200)] and nxt == 200
