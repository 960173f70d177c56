"""Lease affinity: a worker is leased the shard that continues the partition it just read.

Its reader is positioned there (a Kafka consumer keeps its prefetched records), so the
master prefers that shard; a worker with no continuation gets the first queued shard of a
partition no other worker reads (workers do not leapfrog along one partition); a returned
shard goes first; shuffled datasets keep their order. The affinity indexes stay exact
through every kind of state change.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from streamrover.cursor import DataCursor
from streamrover.shard_service.api import DatasetSpec, ShardState
from streamrover.shard_service.master.core import ShardCore
from streamrover.shard_service.master.journal import Journal
from streamrover.sources.api import Partition, SourceKind
from tests.shard_service.fake_clock import Clock


def _core(path: Path, clock: Clock) -> ShardCore:
    return ShardCore(Journal(path / "j.db"), lease_ttl=5.0, clock=clock)


def _stream(core: ShardCore, partitions: int = 2, records: int = 40, size: int = 10) -> None:
    """A stream dataset whose first poll plans every partition's shards, partition after partition."""
    spec = DatasetSpec("d", "mem://", records_per_shard=size)
    core.register_dataset(spec, SourceKind.STREAM, [Partition(f"p{i}", 0, 0) for i in range(partitions)], "[]")
    core.extend_stream("d", [Partition(f"p{i}", 0, records) for i in range(partitions)])


def _where(core: ShardCore, shard_id: str) -> tuple[int, int]:
    s = core.shards[shard_id]
    return s.pindex, s.start


def test_workers_keep_their_partitions_instead_of_leapfrogging(tmp_path: Path) -> None:
    clock = Clock()
    core = _core(tmp_path, clock)
    _stream(core)  # queue order: p0 0,10,20,30 then p1 0,10,20,30
    a, b = core.join("a").id, core.join("b").id
    read: dict[str, list[tuple[int, int]]] = {a: [], b: []}
    held: dict[str, object] = {}
    for w in [a, b] * 4:  # alternate: each leases, then acks when it comes back
        if w in held:
            g = held.pop(w)
            core.ack(w, g.shard_id, g.attempt, g.end)  # type: ignore[attr-defined]
        (g,) = core.lease(w, "d").leases
        held[w] = g
        read[w].append(_where(core, g.shard_id))
    assert read[a] == [(0, 0), (0, 10), (0, 20), (0, 30)]
    assert read[b] == [(1, 0), (1, 10), (1, 20), (1, 30)]


def test_several_shards_in_one_lease_follow_each_other(tmp_path: Path) -> None:
    core = _core(tmp_path, Clock())
    _stream(core, partitions=3)
    a, b = core.join("a").id, core.join("b").id
    first = [_where(core, g.shard_id) for g in core.lease(a, "d", 2).leases]
    second = [_where(core, g.shard_id) for g in core.lease(b, "d", 2).leases]
    assert first == [(0, 0), (0, 10)]
    assert second == [(1, 0), (1, 10)]


def test_a_returned_shard_goes_before_the_continuation(tmp_path: Path) -> None:
    clock = Clock()
    core = _core(tmp_path, clock)
    _stream(core)
    a, b = core.join("a").id, core.join("b").id
    (mine,) = core.lease(a, "d").leases
    (lost,) = core.lease(b, "d").leases  # p1's first shard; b then dies
    for _ in range(2):
        clock.now += 3
        core.heartbeat(a)  # b misses its heartbeats, a does not
    core.ack(a, mine.shard_id, mine.attempt, mine.end)
    assert b not in core.workers
    (nxt,) = core.lease(a, "d").leases
    assert nxt.shard_id == lost.shard_id and nxt.attempt > lost.attempt
    (then,) = core.lease(a, "d").leases  # and the continuation of what a read
    assert _where(core, then.shard_id) in ((0, 10), (1, 10))


def test_shuffled_datasets_keep_their_order(tmp_path: Path) -> None:
    core = _core(tmp_path, Clock())
    spec = DatasetSpec("d", "mem://", records_per_shard=10, shuffle=True, seed=3)
    core.register_dataset(spec, SourceKind.BATCH, [Partition("p0", 0, 50), Partition("p1", 0, 50)], "[]")
    queued = sorted(core.queues["d"])
    w = core.join("w").id
    got = []
    for _ in range(len(queued)):
        (g,) = core.lease(w, "d").leases
        core.ack(w, g.shard_id, g.attempt, g.end)
        got.append(g.shard_id)
    assert got == [sid for _, sid in queued]


def _check_indexes(core: ShardCore) -> None:
    reading = Counter((s.dataset, s.epoch, s.pindex) for s in core.shards.values() if s.state is ShardState.LEASED)
    assert core.reading == reading
    todo = {(s.dataset, s.epoch, s.pindex, s.start): s.id for s in core.shards.values() if s.state is ShardState.TODO}
    assert core.todo_at == todo
    assert all(k[0] in core.workers for k in core.tails)


@pytest.mark.parametrize("seed", range(8))
def test_affinity_indexes_stay_exact(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    clock = Clock()
    core = _core(tmp_path, clock)
    _stream(core, partitions=3, records=30, size=7)
    workers = [core.join(f"w{i}").id for i in range(3)]
    held: list[tuple[str, object]] = []
    ends = {f"p{i}": 30 for i in range(3)}
    for _ in range(300):
        op = rng.random()
        if op < 0.35:
            w = rng.choice(workers)
            if w in core.workers:
                held += [(w, g) for g in core.lease(w, "d", rng.randint(1, 2)).leases]
        elif op < 0.7 and held:
            w, g = held.pop(rng.randrange(len(held)))
            s = core.shards.get(g.shard_id)  # type: ignore[attr-defined]
            if s is not None and s.state is ShardState.LEASED and s.attempt == g.attempt:  # type: ignore[attr-defined]
                pos = g.end if rng.random() < 0.8 else (g.start + g.end) // 2  # type: ignore[attr-defined]
                core.ack(w, g.shard_id, g.attempt, pos)  # type: ignore[attr-defined]
        elif op < 0.8:
            for pid in ends:
                ends[pid] += rng.randint(0, 9)
            core.extend_stream("d", [Partition(pid, 0, end) for pid, end in ends.items()])
        elif op < 0.87:
            clock.now += 6  # every worker misses its heartbeats
            core.expire()
            workers = [core.join(f"w{i}").id for i in range(3)]
        elif op < 0.93:
            cut = core.cut_prepare()
            core.cut_commit(cut.id)
        else:
            empty = rng.random() >= 0.5  # a reset to empty throws away the committed cut: on purpose here
            core.restore(cursor=DataCursor() if empty else core.committed.copy(), discard_committed=empty)
        _check_indexes(core)
        for w in workers:
            if w in core.workers:
                core.heartbeat(w)
    # everything planned is leased and acked in the end, by one worker once the others died
    clock.now += 6
    core.expire()
    _check_indexes(core)
    w = core.join("last").id
    while True:
        grants = core.lease(w, "d", 4).leases
        if not grants:
            break
        for g in grants:
            core.ack(w, g.shard_id, g.attempt, g.end)
    _check_indexes(core)
    assert core.state_counts["d"][ShardState.TODO] == 0 and not core.leased
