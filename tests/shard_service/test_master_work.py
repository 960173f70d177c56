"""The master's own work per lease: expiry checks look at what may have expired, and near the end of a
pass the shards left are shared between the readers instead of all going to whoever asks first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from streamrover.shard_service.api import DatasetSpec, StaleLeaseError
from streamrover.shard_service.master.core import ShardCore
from streamrover.shard_service.master.journal import Journal
from streamrover.sources.api import Partition, SourceKind
from tests.shard_service.test_core_units import Clock


class CountingDict(dict[str, Any]):
    """A dict that counts the entries read from it (by key, or all of them by a values() walk)."""

    def __init__(self, items: dict[str, Any]) -> None:
        super().__init__(items)
        self.reads = 0

    def __getitem__(self, key: str) -> Any:
        self.reads += 1
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.reads += 1
        return super().get(key, default)

    def values(self) -> Any:
        self.reads += len(self)
        return super().values()


@pytest.fixture
def clock() -> Clock:
    return Clock()


def _core(path: Path, clock: Clock, shards: int) -> ShardCore:
    core = ShardCore(Journal(path / "j.db"), lease_ttl=5.0, clock=clock)
    spec = DatasetSpec("d", "mem://", records_per_shard=1)
    core.register_dataset(spec, SourceKind.BATCH, [Partition("p0", 0, shards)], "[]")
    return core


def test_expiry_checks_read_no_lease_or_worker_until_one_may_be_due(tmp_path: Path, clock: Clock) -> None:
    core = _core(tmp_path, clock, 128)  # far from the end: no share binds (test_near_the_end...)
    workers = [core.join(f"w{i}").id for i in range(20)]
    for w in workers:
        assert len(core.lease(w, "d", 2).leases) == 2  # 40 leases out, every deadline at 1005
    clock.now += 1
    shards, live = CountingDict(core.shards), CountingDict(core.workers)
    core.shards, core.workers = shards, live
    assert [core.expire() for _ in range(100)] == [0] * 100
    assert (shards.reads, live.reads) == (0, 0)  # nothing can have expired: nothing is looked at
    assert core.next_deadline() == 1005.0
    clock.now = 1003.0
    for w in workers[:10]:
        core.heartbeat(w)  # these ten and their leases now live until 1008
    assert core.next_deadline() == 1005.0  # exact, not a bound: the others still expire at 1005
    clock.now = 1006.0
    assert core.expire() == 20  # the other ten's leases return, the ten are dead
    assert sorted(core.workers) == sorted(workers[:10]) and len(core.leased) == 20
    assert core.next_deadline() == 1008.0
    assert core.expire() == 0


def test_near_the_end_the_shards_left_are_shared_between_the_readers(tmp_path: Path, clock: Clock) -> None:
    core = _core(tmp_path, clock, 10)
    a, b = core.join("a").id, core.join("b").id
    core.lease(a, "d", 1)
    core.lease(b, "d", 1)  # both read d: 8 shards left
    # not all 8 to a while b idles: at most ceil(todo / readers) per call, so that the grants shrink as the end
    # nears and both lease-ahead queues drain together
    grants = [len(core.lease(w, "d", 128).leases) for w in (a, b, a, b, a, b)]
    assert grants == [4, 2, 1, 1, 0, 0]  # ceil(8/2), ceil(4/2), ceil(2/2), 1: every shard out, none twice
    assert core.lease(a, "d", 128).leases == [] and core.lease(b, "d", 128).leases == []
    (tmp_path / "alone").mkdir()
    alone = _core(tmp_path / "alone", clock, 600)
    c, d = alone.join("c").id, alone.join("d").id
    assert len(alone.lease(c, "d", 128).leases) == 128  # far from the end nothing is held back...
    assert len(alone.lease(d, "d", 128).leases) == 128
    assert len(alone.lease(c, "d", 128).leases) == 128
    assert len(alone.lease(d, "d", 128).leases) == 108  # ...but 216 left between two readers: ceil(216 / 2)
    alone.leave(d)  # d's 236 return: c, the one reader left, may take them all
    assert [len(alone.lease(c, "d", 128).leases) for _ in range(3)] == [128, 128, 88]  # nobody to share with


class CountingConnection:
    """Stands in for the journal's SQLite connection: counts the statements that write the meta table."""

    def __init__(self, db: Any) -> None:
        self._db = db
        self.meta_writes = 0

    def execute(self, sql: str, *args: Any) -> Any:
        if "meta" in sql and not sql.lstrip().upper().startswith("SELECT"):
            self.meta_writes += 1
        return self._db.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)


def test_leases_do_not_write_the_counter_each_and_attempts_stay_fenced_across_a_restart(
    tmp_path: Path, clock: Clock
) -> None:
    core = _core(tmp_path, clock, 300)
    a = core.join("a").id
    counting = CountingConnection(core.journal._db)
    core.journal._db = counting  # type: ignore[assignment]
    grants = [core.lease(a, "d", 1).leases[0] for _ in range(100)]
    assert counting.meta_writes <= 1  # one reservation of attempt numbers, not one write per lease
    core.journal._db = counting._db
    attempts = [g.attempt for g in grants]
    assert attempts == sorted(set(attempts))
    core.journal.close()
    again = ShardCore(Journal(tmp_path / "j.db"), lease_ttl=5.0, clock=clock)  # the journal as a crash left it
    clock.now += 6  # a's leases expire: b leases one of them again
    b = again.join("b").id
    (regrant,) = again.lease(b, "d", 1).leases
    old = {g.shard_id: g for g in grants}[regrant.shard_id]
    assert regrant.attempt > max(attempts)
    with pytest.raises(StaleLeaseError):
        again.ack(a, old.shard_id, old.attempt, old.end)


def test_a_lease_counts_the_workers_own_leases_per_partition_once(tmp_path: Path, clock: Clock) -> None:
    core = _core(tmp_path, clock, 200)  # one partition: every waiting shard is of a partition others read
    a, b = core.join("a").id, core.join("b").id
    assert len(core.lease(a, "d", 32).leases) == 32
    core.lease(b, "d", 1)  # b reads the partition too
    del core.tails[(a, "d")]  # a's reader moved on (no shard follows its last): a looks along the queue
    shards = CountingDict(core.shards)
    core.shards = shards
    (mine,) = core.lease(a, "d", 1).leases
    assert mine.start == 97  # looked past AFFINITY_SCAN (64) waiting shards of a partition b reads, 32-95
    assert shards.reads < 300  # ~64 candidates + a's 32 leases counted once, not 32 per candidate
