"""The shard service core against a model of the trained state: a hypothesis state machine (random interleavings).

The model is what a trainer's state would contain: a count per record, raised
only when the service accepts an ack (refused acks are not applied), and the
training step that applied it. Restore puts the model back to a checkpoint's
snapshot. Three datasets: a batch dataset (two epochs, optionally shuffled), a
stream whose partitions grow (and gain a partition) while the job runs, planned
from polls like the master's poller plans them, and a staged dataset fed by a
sink's commits (each key once: retries and replays add nothing).

Invariants: no record is ever applied twice; every cut's cursor is exactly the
model's records at that time — for a cut of step S, the committed records plus
the records applied at steps <= S (acks are tagged with the step that applied
them, like StreamSession's); the committed cursor is the model's committed
snapshot and inside the acked cursor; a master restart (journal replay) changes
nothing observable; a restore to a committed or to a memory-snapshot cut (its
checkpoint never persisted) puts the service exactly at that snapshot, and
offsets committed upstream never pass the newest checkpoint storage holds (a
memory restore moves the committed cursor, not that limit); a reset to an empty
cursor over committed progress is refused unless asked for; after draining,
every record is committed exactly once.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
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
    ShardState,
    StaleLeaseError,
)
from streamrover.shard_service.master.core import AckItem, ShardCore
from streamrover.shard_service.master.cuts import MAX_PREPARED_CUTS
from streamrover.shard_service.master.journal import Journal
from streamrover.sources.api import Partition, SourceKind
from streamrover.sources.staged import FileFacts

TTL = 10.0
PARTITIONS = [Partition("a.parquet#rg0", 0, 23), Partition("a.parquet#rg1", 0, 9), Partition("b.parquet#rg0", 0, 17)]
EPOCHS = 2
STREAM_START = {"t-0": 5, "t-1": 0, "t-2": 3}  # t-0 starts past 0 (retention); t-2 appears mid-run
DATASETS = ("d", "s", "g")  # batch, stream, staged (fed by a sink's commits)
REFUSED = (StaleLeaseError, FailedPreconditionError, NotFoundError)
Key = tuple[str, int, str, int]  # dataset, epoch, partition id, position
Model = dict[Key, int]

ACK_ARGS = {"i": st.integers(0, 100), "frac": st.floats(0.0, 1.0)}
BATCH_ARGS = {
    "picks": st.lists(st.tuples(st.integers(0, 100), st.floats(0.0, 1.0)), min_size=1, max_size=6),
    "w": st.integers(0, 2),
    "more": st.integers(0, 2),
    "ds": st.sampled_from(DATASETS),
}
LEASE_ARGS = {"w": st.integers(0, 2), "n": st.integers(1, 3), "ds": st.sampled_from(DATASETS)}
GROW_ARGS = {"p": st.integers(0, 2), "n": st.integers(0, 15), "force": st.booleans()}
STAGED_ARGS = {"producer": st.sampled_from(["q1", "q2"]), "epoch": st.integers(0, 3),
               "rows": st.lists(st.integers(0, 9), max_size=2)}  # fmt: skip
RESTORE_ARGS = {"i": st.integers(0, 100), "memory": st.booleans(), "by_cursor": st.booleans()}


def cursor_of(model: Model) -> DataCursor:
    cursor = DataCursor()
    for (ds, epoch, part, pos), count in model.items():
        if count:
            cursor.add(PartitionKey(ds, epoch, part), pos, pos + 1)
    return cursor


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
        self.applied: Model = {}
        self.applied_step: dict[Key, int | None] = {}  # the step whose ack applied the record (None: untagged)
        self.step = 0  # the training step the acks of now belong to
        self.checkpoint_step: int | None = None  # the last step that ended with a checkpoint (its cut is taken next)
        self.held: list[Held] = []
        self.old: list[Held] = []  # leases that may have gone stale
        self.snapshots: dict[int, Model] = {}
        self.committed_model: Model = {}  # the snapshot the committed cursor stands for
        self.durable_model: Model = {}  # the newest snapshot storage holds (a memory restore keeps it)
        self.upstream_model: Model = {}  # the durable snapshot before it: upstream commits lag storage by one
        self.committed_cuts: list[int] = []
        self.prepared: list[int] = []  # memory snapshots: prepared, not committed
        self.stream_ends: dict[str, int] = {}  # what the stream's source holds (its partitions' ends)
        self.staged: dict[tuple[str, int], int] = {}  # the staged dataset's committed keys -> their records
        self.staged_files = 0
        self.answers = 0  # state changes the service answered (leases, accepted acks, cuts, commits, restores)

    def _open(self) -> ShardCore:
        return ShardCore(Journal(self.dir / "journal.db"), lease_ttl=TTL, clock=lambda: self.now)

    # -- model helpers --------------------------------------------------------
    def _model_cursor(self) -> DataCursor:
        return cursor_of(self.applied)

    def _worker(self, w: int) -> str:
        if self.workers[w] not in self.core.workers:
            self.workers[w] = self.core.join(f"w{w}").id
        return self.workers[w]

    def _ack_step(self, dataset: str) -> int | None:
        return self.step if self.tagged else None

    def _apply(self, h: Held, pos: int, step: int | None) -> None:
        for p in range(h.acked, pos):
            key = (h.grant.dataset, h.grant.epoch, h.grant.partition.id, p)
            self.applied[key] = self.applied.get(key, 0) + 1
            self.applied_step[key] = step
        h.acked = pos
        h.acks.append(pos)
        self.answers += 1

    def _poll(self) -> list[Partition]:
        return [Partition(pid, STREAM_START[pid], end) for pid, end in sorted(self.stream_ends.items())]

    @initialize(shuffle=st.booleans(), size=st.integers(3, 11), tagged=st.booleans())
    def register(self, shuffle: bool, size: int, tagged: bool) -> None:
        # tagged: acks carry their step and cuts are of steps, like StreamSession's; else neither (plain workers
        # and a cutter of "now", like tests/sources/stream_job.py's)
        self.tagged = tagged
        spec = DatasetSpec("d", "mem://d", records_per_shard=size, epochs=EPOCHS, shuffle=shuffle, seed=7)
        self.core.register_dataset(spec, SourceKind.BATCH, PARTITIONS, "[]")
        self.stream_ends = {"t-0": STREAM_START["t-0"] + 4, "t-1": 0}
        stream = DatasetSpec("s", "mem://s", records_per_shard=size, options={"sr.max_delay_ms": "3000"})
        self.core.register_dataset(stream, SourceKind.STREAM, self._poll(), "[]")
        staged = DatasetSpec("g", "staged://g", "parquet", records_per_shard=size)
        self.core.register_dataset(staged, SourceKind.STREAM, [], "[]")
        self.workers = [self.core.join(f"w{i}").id for i in range(3)]

    # -- rules ----------------------------------------------------------------
    @rule(**LEASE_ARGS)
    def lease(self, w: int, n: int, ds: str) -> None:
        worker = self._worker(w)
        out = self.core.lease(worker, ds, n)
        live = []
        for h in self.held:  # leases lost to expiry or a leaving worker are stale now
            (live if self._alive(h) else self.old).append(h)
        self.held = live
        assert (out.status is LeaseStatus.OK) == bool(out.leases)
        assert out.status is not LeaseStatus.END or ds == "d", "a stream ended"
        for g in out.leases:
            assert g.dataset == ds and g.start <= g.resume < g.end
            assert all(h.grant.shard_id != g.shard_id for h in self.held), "a shard leased twice at once"
            self.held.append(Held(worker, g, g.resume))
            self.answers += 1

    @precondition(lambda self: self.held)
    @rule(**ACK_ARGS)
    def ack(self, i: int, frac: float) -> None:
        h = self.held[i % len(self.held)]
        pos = min(h.acked + max(1, round(frac * (h.grant.end - h.acked))), h.grant.end)
        step = self._ack_step(h.grant.dataset)
        self.last_ack = (h, pos)
        try:
            result = self.core.ack(h.worker, h.grant.shard_id, h.grant.attempt, pos, step)
        except REFUSED:
            self.held.remove(h)
            self.old.append(h)
            return
        assert not result.duplicate
        self._apply(h, pos, step)
        if result.shard_done:
            self.held.remove(h)
            self.old.append(h)

    @precondition(lambda self: self.held or self.old)
    @rule(**BATCH_ARGS)
    def ack_batch(self, picks: list[tuple[int, float]], w: int, more: int, ds: str) -> None:
        """Acks of live and stale leases mixed in one batch: each judged as a lone ack, in order; then leases."""
        pool = self.held + [h for h in self.old if h.acked < h.grant.end]
        if not pool:
            return
        items: list[AckItem] = []
        plan: list[tuple[Held, int, int | None]] = []
        planned: dict[int, int] = {}
        for i, frac in picks:
            h = pool[i % len(pool)]
            cur = planned.get(id(h), h.acked)
            if cur >= h.grant.end:
                continue
            pos = min(cur + max(1, round(frac * (h.grant.end - cur))), h.grant.end)
            planned[id(h)] = pos
            step = self._ack_step(h.grant.dataset)
            items.append(AckItem(h.worker, h.grant.shard_id, h.grant.attempt, pos, step))
            plan.append((h, pos, step))
        worker = self._worker(w)
        results, outcome = self.core.ack_batch(items, worker, ds, more)
        assert len(results) == len(items)
        for (h, pos, step), result in zip(plan, results):
            stale = any(x is h for x in self.old)
            if isinstance(result, ShardServiceError):
                assert isinstance(result, REFUSED), result
                if not stale:
                    self.held.remove(h)
                    self.old.append(h)
                continue
            if result.duplicate:  # a shard compacted after a commit answers every ack as a harmless repeat
                assert self.core.shards.get(h.grant.shard_id) is None, f"a new position answered {result}"
                continue
            assert not stale, f"a stale lease's new ack was accepted in a batch: {result}"
            self._apply(h, pos, step)
            if result.shard_done:
                self.held.remove(h)
                self.old.append(h)
        if outcome is not None:
            assert more > 0 and (outcome.status is LeaseStatus.OK) == bool(outcome.leases)
            for g in outcome.leases:
                assert all(x.grant.shard_id != g.shard_id for x in self.held if self._alive(x)), "leased twice"
                self.held.append(Held(worker, g, g.resume))
                self.answers += 1
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
        except REFUSED:
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
        except REFUSED:
            return
        raise AssertionError(f"a stale lease's new ack was accepted: {result}")

    @rule(**GROW_ARGS)
    def stream_grows(self, p: int, n: int, force: bool) -> None:
        """Records arrive in stream partition ``p`` (t-2 appears on its first arrival); the poller plans them."""
        pid = sorted(STREAM_START)[p]
        self.stream_ends[pid] = self.stream_ends.get(pid, STREAM_START[pid]) + n
        self.core.extend_stream("s", self._poll(), force=force)

    @rule(**STAGED_ARGS)
    def commit_staged(self, producer: str, epoch: int, rows: list[int]) -> None:
        """A sink commits a checkpoint's files (maybe again: a retry, or a replay after the engine restarted)."""
        files = []
        for n in rows:
            self.staged_files += 1
            files.append(FileFacts(f"mem://g/{self.staged_files}.parquet", n, '[["id", "int64"]]'))
        planned = self.core.datasets["g"].planned_records()
        out = self.core.commit_staged("g", producer, "driver", epoch, files)
        first = (producer, epoch) not in self.staged
        assert out.already is not first
        if first:
            self.staged[(producer, epoch)] = sum(rows)
            self.answers += 1
        assert out.records == self.staged[(producer, epoch)], "a key's answer is its first commit's"
        assert self.core.datasets["g"].planned_records() == planned + (sum(rows) if first else 0)

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

    def _expect_cut(self, step: int | None) -> Model:
        """The model's state at the end of ``step`` (None: now): the committed records plus those of steps <= it."""

        def in_cut(k: Key) -> bool:
            applied_at = self.applied_step[k]
            return k in self.committed_model or step is None or applied_at is None or applied_at <= step

        return {k: c for k, c in self.applied.items() if c and in_cut(k)}

    def _take_cut(self, step: int | None) -> None:
        cut = self.core.cut_prepare(step)
        expected = self._expect_cut(step)
        assert cut.cursor == cursor_of(expected), f"the cut of step {step} differs from the model at that step"
        self.snapshots[cut.id] = expected
        if cut.id not in self.prepared:
            self.prepared.append(cut.id)
        self.answers += 1

    @rule(checkpoint=st.booleans())
    def step_ends(self, checkpoint: bool) -> None:
        """A training step ends (every rank acked its records, tagged with it), at a checkpoint or not."""
        if checkpoint:
            self.checkpoint_step = self.step
        self.step += 1

    @rule()
    def cut_prepare(self) -> None:
        """Tagged: the cut of the last checkpoint's step, taken after acks of later steps came in (a rank that
        passed the barrier trains on), maybe again (every rank asks for it). Untagged: a cut of now."""
        if not self.tagged:
            self._take_cut(None)
        elif self.checkpoint_step is not None:
            self._take_cut(self.checkpoint_step)

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
        self.upstream_model = self.durable_model
        self.committed_model = self.durable_model = self.snapshots[cut_id]
        # memory snapshots older than a durable checkpoint are never restored (the newest state wins)
        self.prepared = [c for c in self.prepared if c >= cut_id]
        self.answers += 1
        assert self.core.committed == DataCursor.from_dict(self.core.cuts[cut_id].cursor.to_dict())

    @precondition(lambda self: self.committed_cuts or self.prepared)
    @rule(**RESTORE_ARGS)
    def restore(self, i: int, memory: bool, by_cursor: bool) -> None:
        """Back to a durable checkpoint's cut, or to a memory snapshot's (prepared, never committed: the trainer
        restarted on a live node and found its shared-memory snapshot newer than storage)."""
        memory = (memory and bool(self.prepared)) or not self.committed_cuts
        pool = self.prepared if memory else self.committed_cuts
        cut_id = pool[i % len(pool)]
        snapshot = self.snapshots[cut_id]
        discard = not snapshot and bool(self.core.committed.keys())
        if discard:  # a reset to nothing throws committed progress away: refused unless the caller says so
            with pytest.raises(FailedPreconditionError, match="empty cursor"):
                self.core.restore(cursor=DataCursor(), from_memory=memory)
        if by_cursor:
            self.core.restore(cursor=cursor_of(snapshot), discard_committed=discard, from_memory=memory)
        else:
            try:
                self.core.restore(cut_id=cut_id, discard_committed=discard, from_memory=memory)
            except NotFoundError:  # only cuts the service may forget: committed ones replaced, old prepared ones
                newer = sum(1 for c in self.prepared if c > cut_id)
                assert not memory or newer >= MAX_PREPARED_CUTS, f"cut {cut_id} was forgotten"
                self.core.restore(cursor=cursor_of(snapshot), discard_committed=discard, from_memory=memory)
        self.applied = dict(snapshot)
        self.committed_model = dict(snapshot)
        if not memory:  # storage holds this checkpoint: the broker may be told about it
            self.durable_model = self.upstream_model = dict(snapshot)  # just loaded whole from storage
        self.old.extend(self.held)
        self.held = []
        self.prepared = []
        self.answers += 1

    @rule()
    def master_restarts(self) -> None:
        before = self._durable_view()
        self.core.journal.close()
        self.core = self._open()
        assert before == self._durable_view(), "journal replay changed the state"

    def _durable_view(self) -> tuple[object, ...]:
        return (
            self.core.acked_cursor(),
            self.core.committed,
            sorted((s.id, s.state, s.attempt, s.acked_to, tuple(s.acks)) for s in self.core.shards.values()),
            [(p.id, p.start, p.end) for p in self.core.datasets["s"].partitions],
            [(p.id, p.start, p.end) for p in self.core.datasets["g"].partitions],
            sorted(self.core.staged_commits.items()),
        )

    # -- invariants -----------------------------------------------------------
    @invariant()
    def nothing_applied_twice(self) -> None:
        assert all(c <= 1 for c in self.applied.values())

    @invariant()
    def acked_cursor_is_the_model(self) -> None:
        assert self.core.acked_cursor() == self._model_cursor()

    @invariant()
    def committed_is_the_committed_snapshot(self) -> None:
        assert self.core.committed == cursor_of(self.committed_model)

    @invariant()
    def upstream_commits_never_ahead_of_storage(self) -> None:
        """What the broker is told is committed stays inside the durable checkpoint before the newest (so a
        fallback from a corrupt newest checkpoint finds its records still upstream), and reaches it."""
        upstream = cursor_of(self.upstream_model)
        committed = cursor_of(self.committed_model)
        for ds in DATASETS:
            if ds in self.core.datasets and self.core.datasets[ds].kind is SourceKind.STREAM:
                plans = {p.id: p for p in self.core.datasets[ds].partitions}
                for pid, end in self.core.committed_positions(self.core.datasets[ds]).items():
                    key, start = PartitionKey(ds, 0, pid), plans[pid].start
                    limit = upstream.get(key).prefix_end(start)
                    assert end <= limit, f"{ds}/{pid}: upstream commit {end} beyond the previous checkpoint's {limit}"
                    assert end >= min(limit, committed.get(key).prefix_end(start)), f"{ds}/{pid}: {end} < {limit}"

    @invariant()
    def state_counts_are_exact(self) -> None:
        for ds in DATASETS:
            actual = Counter(s.state for s in self.core.shards.values() if s.dataset == ds)
            assert {k: v for k, v in self.core.state_counts.get(ds, Counter()).items() if v} == dict(actual)
        assert self.core.leased == {s.id for s in self.core.shards.values() if s.state.value == "leased"}

    @invariant()
    def committed_inside_acked(self) -> None:
        acked = self.core.acked_cursor()
        for key, ivs in self.core.committed.items():
            for s, e in ivs:
                assert acked.get(key).covers(s, e)

    @invariant()
    def stream_planned_within_the_source(self) -> None:
        if "s" in self.core.datasets:
            for plan in self.core.datasets["s"].partitions:
                assert STREAM_START[plan.id] == plan.start <= plan.end <= self.stream_ends[plan.id], plan

    def _drain(self, w: str, ds: str) -> None:
        for _ in range(10_000):
            if ds == "s":  # the poller plans what waits, partial shards too
                self.core.extend_stream("s", self._poll(), force=True)
            out = self.core.lease(w, ds, 4)
            if out.status is LeaseStatus.END:
                break
            if out.status is LeaseStatus.WAIT:  # a stream: nothing is left once nothing waits or is leased
                assert ds in ("s", "g") and not self.core.leased, out
                assert self.core.state_counts[ds][ShardState.TODO] == 0, "shards wait, yet a lease waits"
                break
            assert out.status is LeaseStatus.OK, out
            for g in out.leases:
                self.core.ack(w, g.shard_id, g.attempt, g.end)
                for p in range(g.resume, g.end):
                    key = (g.dataset, g.epoch, g.partition.id, p)
                    self.applied[key] = self.applied.get(key, 0) + 1

    def teardown(self) -> None:
        if not hasattr(self, "workers"):
            return
        # Drain: one fresh worker takes and finishes everything; then every record is committed exactly once.
        self.now += TTL + 1
        self.core.expire()
        w = self.core.join("drain").id
        for ds in DATASETS:
            self._drain(w, ds)
        cut = self.core.cut_prepare()
        self.core.cut_commit(cut.id)
        batch = EPOCHS * sum(p.end - p.start for p in PARTITIONS)
        stream = sum(end - STREAM_START[pid] for pid, end in self.stream_ends.items())
        assert self.core.committed.only("d").size() == batch
        assert self.core.committed.only("s").size() == stream
        staged = sum(self.staged.values())
        assert self.core.committed.only("g").size() == staged
        assert len(self.applied) == batch + stream + staged and all(c == 1 for c in self.applied.values())
        assert not self.core.shards, "committed shards must be compacted away"
        self.core.journal.close()
        shutil.rmtree(self.dir, ignore_errors=True)
