"""Property-based test of the shard service core: random interleavings against a model of the trained state.

The model is what a trainer's state would contain: a count per record, raised
only when the service accepts an ack (refused acks are not applied). Restore
puts the model back to a checkpoint's snapshot. Invariants: no record is ever
applied twice; every cut's cursor is exactly the model's records at that time;
the committed cursor is inside the acked cursor; a master restart (journal
replay) changes nothing observable; after draining, every record is committed
exactly once.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from streamrover.cursor import DataCursor, PartitionKey
from streamrover.shard_service.api import (
    DatasetSpec,
    FailedPreconditionError,
    LeaseGrant,
    LeaseStatus,
    NotFoundError,
    ShardServiceError,
    StaleLeaseError,
)
from streamrover.shard_service.core import AckItem, ShardCore
from streamrover.shard_service.journal import Journal
from streamrover.sources.api import Partition, SourceKind

TTL = 10.0
PARTITIONS = [Partition("a.parquet#rg0", 0, 23), Partition("a.parquet#rg1", 0, 9), Partition("b.parquet#rg0", 0, 17)]
EPOCHS = 2


@dataclass
class Held:
    worker: str
    grant: LeaseGrant
    acked: int  # highest position this lease acked (starts at resume)
    acks: list[int] = field(default_factory=list)


class ShardServiceMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="sm-"))
        self.now = 1_000.0
        self.core = self._open()
        self.applied: dict[tuple[int, str, int], int] = {}
        self.held: list[Held] = []
        self.old: list[Held] = []  # leases that may have gone stale
        self.snapshots: dict[int, dict[tuple[int, str, int], int]] = {}
        self.committed_cuts: list[int] = []
        self.prepared: list[int] = []

    def _open(self) -> ShardCore:
        return ShardCore(Journal(self.dir / "journal.db"), lease_ttl=TTL, clock=lambda: self.now)

    # -- model helpers --------------------------------------------------------
    def _model_cursor(self) -> DataCursor:
        cursor = DataCursor()
        for (epoch, part, pos), count in self.applied.items():
            if count:
                cursor.add(PartitionKey("d", epoch, part), pos, pos + 1)
        return cursor

    @initialize(shuffle=st.booleans(), size=st.integers(min_value=3, max_value=11))
    def register(self, shuffle: bool, size: int) -> None:
        spec = DatasetSpec("d", "mem://d", records_per_shard=size, epochs=EPOCHS, shuffle=shuffle, seed=7)
        self.core.register_dataset(spec, SourceKind.BATCH, PARTITIONS, "[]")
        self.workers = [self.core.join(f"w{i}").id for i in range(3)]

    # -- rules ----------------------------------------------------------------
    @rule(w=st.integers(0, 2), n=st.integers(1, 3))
    def lease(self, w: int, n: int) -> None:
        worker = self.workers[w]
        if worker not in self.core.workers:
            worker = self.workers[w] = self.core.join(f"w{w}").id
        out = self.core.lease(worker, "d", n)
        live = []
        for h in self.held:  # leases lost to expiry or a leaving worker are stale now
            s = self.core.shards.get(h.grant.shard_id)
            alive = s is not None and s.state.value == "leased" and s.attempt == h.grant.attempt
            (live if alive else self.old).append(h)
        self.held = live
        assert (out.status is LeaseStatus.OK) == bool(out.leases)
        for g in out.leases:
            assert g.start <= g.resume < g.end
            assert all(h.grant.shard_id != g.shard_id for h in self.held), "a shard leased twice at once"
            self.held.append(Held(worker, g, g.resume))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100), frac=st.floats(0.0, 1.0), step=st.none() | st.integers(0, 5))
    def ack(self, i: int, frac: float, step: int | None) -> None:
        h = self.held[i % len(self.held)]
        pos = h.acked + max(1, round(frac * (h.grant.end - h.acked)))
        pos = min(pos, h.grant.end)
        try:
            result = self.core.ack(h.worker, h.grant.shard_id, h.grant.attempt, pos, step)
        except (StaleLeaseError, FailedPreconditionError, NotFoundError):
            self.held.remove(h)
            self.old.append(h)
            return
        assert not result.duplicate
        part = PARTITIONS[h.grant.partition.index].id
        for p in range(h.acked, pos):
            key = (h.grant.epoch, part, p)
            self.applied[key] = self.applied.get(key, 0) + 1
        h.acked = pos
        h.acks.append(pos)
        if result.shard_done:
            self.held.remove(h)
            self.old.append(h)

    @precondition(lambda self: self.held or self.old)
    @rule(
        picks=st.lists(st.tuples(st.integers(0, 100), st.floats(0.0, 1.0)), min_size=1, max_size=6),
        step=st.none() | st.integers(0, 5),
        w=st.integers(0, 2),
        more=st.integers(0, 2),
    )
    def ack_batch(self, picks: list[tuple[int, float]], step: int | None, w: int, more: int) -> None:
        """Acks of live and stale leases mixed in one batch: each judged as a lone ack, in order; then leases."""
        pool = self.held + [h for h in self.old if h.acked < h.grant.end]
        if not pool:
            return
        items: list[AckItem] = []
        plan: list[tuple[Held, int]] = []
        planned: dict[int, int] = {}
        for i, frac in picks:
            h = pool[i % len(pool)]
            cur = planned.get(id(h), h.acked)
            if cur >= h.grant.end:
                continue
            pos = min(cur + max(1, round(frac * (h.grant.end - cur))), h.grant.end)
            planned[id(h)] = pos
            items.append(AckItem(h.worker, h.grant.shard_id, h.grant.attempt, pos, step))
            plan.append((h, pos))
        worker = self.workers[w]
        if worker not in self.core.workers:
            worker = self.workers[w] = self.core.join(f"w{w}").id
        results, outcome = self.core.ack_batch(items, worker, "d", more)
        assert len(results) == len(items)
        for (h, pos), result in zip(plan, results):
            stale = any(x is h for x in self.old)
            if isinstance(result, ShardServiceError):
                assert isinstance(result, (StaleLeaseError, FailedPreconditionError, NotFoundError)), result
                if not stale:
                    self.held.remove(h)
                    self.old.append(h)
                continue
            if result.duplicate:  # a shard compacted after a commit answers every ack as a harmless repeat
                assert self.core.shards.get(h.grant.shard_id) is None, f"a new position answered {result}"
                continue
            assert not stale, f"a stale lease's new ack was accepted in a batch: {result}"
            part = PARTITIONS[h.grant.partition.index].id
            for p in range(h.acked, pos):
                key = (h.grant.epoch, part, p)
                self.applied[key] = self.applied.get(key, 0) + 1
            h.acked = pos
            h.acks.append(pos)
            if result.shard_done:
                self.held.remove(h)
                self.old.append(h)
        if outcome is not None:
            assert more > 0 and (outcome.status is LeaseStatus.OK) == bool(outcome.leases)
            for g in outcome.leases:
                assert all(x.grant.shard_id != g.shard_id for x in self.held if self._alive(x)), "leased twice"
                self.held.append(Held(worker, g, g.resume))
        else:
            assert more == 0

    def _alive(self, h: Held) -> bool:
        s = self.core.shards.get(h.grant.shard_id)
        return s is not None and s.state.value == "leased" and s.attempt == h.grant.attempt

    @precondition(lambda self: any(h.acks for h in self.held + self.old))
    @rule(i=st.integers(0, 100))
    def repeat_ack(self, i: int) -> None:
        done = [h for h in self.held + self.old if h.acks]
        h = done[i % len(done)]
        try:
            result = self.core.ack(h.worker, h.grant.shard_id, h.grant.attempt, h.acks[-1])
        except (StaleLeaseError, FailedPreconditionError, NotFoundError):
            # Only a restore (which discards every lease and its ack history) may refuse a repeat.
            assert self.snapshots, "a repeated ack was refused without any restore"
            return
        assert result.duplicate

    @precondition(lambda self: self.old)
    @rule(i=st.integers(0, 100))
    def stale_ack(self, i: int) -> None:
        h = self.old[i % len(self.old)]
        s = self.core.shards.get(h.grant.shard_id)
        if s is None or h.acked >= h.grant.end:
            return
        try:
            result = self.core.ack(h.worker, h.grant.shard_id, h.grant.attempt, h.acked + 1)
        except (StaleLeaseError, FailedPreconditionError, NotFoundError):
            return
        raise AssertionError(f"a stale lease's new ack was accepted: {result}")

    @rule(w=st.integers(0, 2))
    def heartbeat(self, w: int) -> None:
        if self.workers[w] in self.core.workers:
            self.core.heartbeat(self.workers[w])

    @rule(seconds=st.sampled_from([1.0, TTL / 2, TTL + 1]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        self.core.expire()

    @rule(w=st.integers(0, 2))
    def worker_leaves(self, w: int) -> None:
        if self.workers[w] in self.core.workers:
            self.core.leave(self.workers[w])

    @rule(step=st.none() | st.integers(0, 5))
    def cut_prepare(self, step: int | None) -> None:
        cut = self.core.cut_prepare(step)
        if step is None:
            assert cut.cursor == self._model_cursor(), "a cut's cursor differs from the records in the model"
            self.snapshots[cut.id] = dict(self.applied)
            self.prepared.append(cut.id)

    @precondition(lambda self: self.prepared)
    @rule(i=st.integers(0, 100))
    def cut_commit(self, i: int) -> None:
        cut_id = self.prepared[i % len(self.prepared)]
        before = self.core.committed
        if cut_id in self.committed_cuts:  # committing a committed cut again is a no-op
            self.core.cut_commit(cut_id)
            assert self.core.committed == before
            return
        try:
            self.core.cut_commit(cut_id)
        except (FailedPreconditionError, NotFoundError):
            assert (self.committed_cuts and cut_id < max(self.committed_cuts)) or cut_id not in self.core.cuts
            return
        self.committed_cuts.append(cut_id)
        assert self.core.committed == DataCursor.from_dict(self.core.cuts[cut_id].cursor.to_dict())

    @precondition(lambda self: self.committed_cuts)
    @rule(i=st.integers(0, 100), by_cursor=st.booleans())
    def restore(self, i: int, by_cursor: bool) -> None:
        cut_id = self.committed_cuts[i % len(self.committed_cuts)]
        snapshot = self.snapshots[cut_id]
        cursor = DataCursor()
        for (epoch, part, pos), count in snapshot.items():
            if count:
                cursor.add(PartitionKey("d", epoch, part), pos, pos + 1)
        self.core.restore(cursor=cursor)
        self.applied = dict(snapshot)
        self.old.extend(self.held)
        self.held = []
        self.prepared = []

    @rule()
    def master_restarts(self) -> None:
        before = (
            self.core.acked_cursor(),
            self.core.committed,
            sorted((s.id, s.state, s.attempt, s.acked_to) for s in self.core.shards.values()),
        )
        self.core.journal.close()
        self.core = self._open()
        after = (
            self.core.acked_cursor(),
            self.core.committed,
            sorted((s.id, s.state, s.attempt, s.acked_to) for s in self.core.shards.values()),
        )
        assert before == after, "journal replay changed the state"

    # -- invariants -----------------------------------------------------------
    @invariant()
    def nothing_applied_twice(self) -> None:
        assert all(c <= 1 for c in self.applied.values())

    @invariant()
    def acked_cursor_is_the_model(self) -> None:
        assert self.core.acked_cursor() == self._model_cursor()

    @invariant()
    def state_counts_are_exact(self) -> None:
        from collections import Counter

        actual = Counter(s.state for s in self.core.shards.values())
        assert {k: v for k, v in self.core.state_counts.get("d", Counter()).items() if v} == dict(actual)
        assert self.core.leased == {s.id for s in self.core.shards.values() if s.state.value == "leased"}

    @invariant()
    def committed_inside_acked(self) -> None:
        acked = self.core.acked_cursor()
        for key, ivs in self.core.committed.items():
            for s, e in ivs:
                assert acked.get(key).covers(s, e)

    def teardown(self) -> None:
        # Drain: one fresh worker takes and finishes everything; then every record is committed exactly once.
        self.now += TTL + 1
        self.core.expire()
        w = self.core.join("drain").id
        for _ in range(10_000):
            out = self.core.lease(w, "d", 4)
            if out.status is LeaseStatus.END:
                break
            assert out.status is LeaseStatus.OK, out
            for g in out.leases:
                self.core.ack(w, g.shard_id, g.attempt, g.end)
                part = PARTITIONS[g.partition.index].id
                for p in range(g.resume, g.end):
                    self.applied[(g.epoch, part, p)] = self.applied.get((g.epoch, part, p), 0) + 1
        cut = self.core.cut_prepare()
        self.core.cut_commit(cut.id)
        total = EPOCHS * sum(p.end - p.start for p in PARTITIONS)
        assert self.core.committed.size() == total
        assert len(self.applied) == total and all(c == 1 for c in self.applied.values())
        assert not self.core.shards, "committed shards must be compacted away"
        self.core.journal.close()
        shutil.rmtree(self.dir, ignore_errors=True)


TestShardServiceMachine = ShardServiceMachine.TestCase
TestShardServiceMachine.settings = settings(
    max_examples=int(os.environ.get("SR_SM_EXAMPLES", "60")),
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.parametrize("n", [1])
def test_model_is_sensitive(n: int) -> None:
    """The invariant that guards double application fails when a record is applied twice."""
    m = ShardServiceMachine()
    m.register(shuffle=False, size=5)
    m.applied[(0, "a.parquet#rg0", 0)] = 2
    with pytest.raises(AssertionError):
        m.nothing_applied_twice()
    m.core.journal.close()
