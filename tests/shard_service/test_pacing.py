"""The prefetch depth of a ShardClient.shards() reader, from the pace it measures (pure: no processes)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from streamrover.shard_service.client.lease_table import LeaseTable
from streamrover.shard_service.client.pacing import MAX_PREFETCH, RAMP_SHARDS, Pacing, PrefetchPace


def _lease() -> Any:
    """A waiting lease as pacing sees one: of one planned shard."""
    return SimpleNamespace(lease=SimpleNamespace(shards=1))


def _feed(pace: PrefetchPace, seconds: list[float], rounds: int) -> None:
    for _ in range(rounds):
        for s in seconds:
            pace.took(s)


def test_a_reader_whose_shards_share_row_groups_is_paced_by_its_fast_shards() -> None:
    """10,000-record shards of 128k-row row groups: one shard in 13 decodes the row group (80 ms), 12 take 0.5 ms.

    Sized by the mean (6.6 ms) the depth was 4: the reader got through those in 2 ms and waited for the
    round trip that brings the next leases, 13 times per row group. Sized by the median it covers a round
    trip of ~20 ms at the fast pace.
    """
    pace = PrefetchPace(prefetch=2, records_per_shard=10_000)
    _feed(pace, [0.08] + [0.0005] * 12, rounds=4)
    assert pace.target >= 20, pace.target


def test_a_steady_reader_keeps_its_prefetch_and_a_fast_one_is_capped() -> None:
    slow = PrefetchPace(prefetch=2, records_per_shard=10_000)
    _feed(slow, [0.05], rounds=RAMP_SHARDS * 2)  # 50 ms per shard: 20 ms of work is less than one shard
    assert slow.target == 2
    fast = PrefetchPace(prefetch=2, records_per_shard=1)
    _feed(fast, [0.0], rounds=RAMP_SHARDS * 2)  # no measurable time per shard
    assert fast.target == MAX_PREFETCH


def test_the_first_shards_are_leased_by_records_until_the_pace_is_known() -> None:
    pace = PrefetchPace(prefetch=2, records_per_shard=10_000)
    assert pace.target == 27  # 256k records ahead
    _feed(pace, [0.05], rounds=RAMP_SHARDS - 2)
    assert pace.target == 27
    _feed(pace, [0.05], rounds=2)
    assert pace.target == 2


def test_a_reader_that_got_fewer_leases_than_it_asked_for_lets_its_acks_gather_until_it_gets_all() -> None:
    """Dry (the master had no more to give): sending acks at once would bring nothing, so they may gather."""
    pacing = Pacing(LeaseTable())
    pace = pacing.start("d", prefetch=2, records_per_shard=10_000)
    assert pace.target == 27 and not pacing.readers_supplied()  # nothing waiting: acks go at once
    pacing.granted("d", asked=27, got=5)
    assert pacing.readers_supplied()
    pacing.granted("d", asked=0, got=0)  # asked for nothing: says nothing
    assert pacing.readers_supplied()
    pacing.granted("d", asked=10, got=10)
    assert not pacing.readers_supplied()


def test_a_reader_of_whole_row_group_shards_leases_several_ahead_so_one_ack_batch_serves_several() -> None:
    """One 128k-row row group per shard, ~8 ms each: 20 ms ahead was 3 shards, so every AckBatch carried 2-3 acks.

    At least 8 ahead (they are less than 100 ms of work), and acks held while 12 ms of work waits: a batch
    carries ~7 acks, sent with one shard waiting besides the one being read; the bench's 32-shard pass went
    from 11-35 AckBatch messages to ~6. A slow reader (50 ms a shard) keeps its 2, a fast one its 20 ms.
    """
    pacing = Pacing(LeaseTable())
    pace = pacing.start("d", prefetch=2, records_per_shard=128 * 1024)
    _feed(pace, [0.008], rounds=4)
    assert pace.target == 8, pace.target
    slow = PrefetchPace(prefetch=2, records_per_shard=128 * 1024)
    _feed(slow, [0.05], rounds=4)
    assert slow.target == 2, slow.target
    fast = PrefetchPace(prefetch=2, records_per_shard=10_000)
    _feed(fast, [0.0005], rounds=RAMP_SHARDS)
    assert fast.target == 40, fast.target


def test_acks_may_gather_while_the_reader_has_12_ms_of_work_waiting() -> None:
    table = LeaseTable()
    pacing = Pacing(table)
    pace = pacing.start("d", prefetch=2, records_per_shard=128 * 1024)
    _feed(pace, [0.008], rounds=4)  # depth 8
    queue = table.waiting("d")
    queue.extend(cast(Any, [_lease() for _ in range(2)]))  # 2 of 8 waiting: ~16 ms of work
    assert pacing.readers_supplied()
    queue.popleft()
    assert not pacing.readers_supplied()  # 1 (~8 ms): send now, the answer brings the next leases
    table = LeaseTable()
    pacing = Pacing(table)
    fast = pacing.start("e", prefetch=2, records_per_shard=10_000)
    _feed(fast, [0.0005], rounds=RAMP_SHARDS)  # depth 40, 12 ms of work is 24 shards (less than 2/3 of 40)
    table.waiting("e").extend(cast(Any, [_lease() for _ in range(23)]))
    assert not pacing.readers_supplied()
    table.waiting("e").append(cast(Any, _lease()))
    assert pacing.readers_supplied()
