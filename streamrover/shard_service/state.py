"""The in-memory state of the shard service core, loaded from and written through to the journal."""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator

from streamrover.cursor import DataCursor, PartitionKey
from streamrover.shard_service.api import DEFAULT_LEASE_TTL, NotFoundError, ShardState, shard_id_for
from streamrover.shard_service.bookkeeping import CutRecord, DatasetRecord, ShardRecord, WorkerRecord
from streamrover.shard_service.journal import Journal
from streamrover.shard_service.kv import KvStore
from streamrover.shard_service.planner import PlannedShard

# shard ids discarded by restores that an ack is told about precisely ("revoked by a restore"); older
# ones get the generic refusal. Memory only (a restarted master remembers none): refusals either way.
MAX_RESTORE_REVOKED = 65_536
RATE_WINDOW = 5.0  # seconds of acks the rates in status cover
RATE_BUCKET = 0.1  # seconds per bucket of the ack rates: their memory is RATE_WINDOW / RATE_BUCKET buckets


class IllegalTransitionError(RuntimeError):
    """A shard state change the transition table does not allow: a bug in the core, never a client's fault."""


#: Every shard state change the core makes, with its guard (what must hold of the shard record when it is made).
#: A shard is born TODO (planned) and leaves the core by being dropped: compacted once inside the committed
#: cursor (ACKED), discarded by a restore or a dataset's removal (any state). Nothing else changes its state.
TRANSITIONS: dict[tuple[ShardState, ShardState], tuple[str, Callable[[ShardRecord], bool]]] = {
    (ShardState.TODO, ShardState.LEASED): ("leased to a worker", lambda s: True),
    (ShardState.LEASED, ShardState.TODO): ("lease returned: expired, worker left or died", lambda s: True),
    (ShardState.LEASED, ShardState.ACKED): ("acked to its end", lambda s: s.acked_to == s.end),
}


class BoundedSet:
    """A set that forgets its oldest members beyond a size (read at each add, so tests may lower it)."""

    def __init__(self, limit: Callable[[], int]) -> None:
        self._limit = limit
        self._items: dict[str, None] = {}

    def add(self, item: str) -> None:
        """Add ``item`` (as the newest member)."""
        self._items.pop(item, None)
        self._items[item] = None
        if len(self._items) > 2 * self._limit():  # adds come in bulk, removals after them: trim lazily
            self._trim()

    def _trim(self) -> None:
        excess = len(self._items) - self._limit()
        if excess > 0:
            for old in list(itertools.islice(self._items, excess)):
                del self._items[old]

    def discard(self, item: str) -> None:
        """Remove ``item`` if present."""
        self._items.pop(item, None)

    def difference_update(self, items: Iterable[str]) -> None:
        """Remove every member of ``items``, then forget the oldest beyond the limit."""
        for item in items:
            self._items.pop(item, None)
        self._trim()

    def __isub__(self, items: Iterable[str]) -> BoundedSet:
        self.difference_update(items)
        return self

    def __contains__(self, item: object) -> bool:
        return item in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)


class AckRates:
    """Records and acks of the last :data:`RATE_WINDOW` seconds, summed per :data:`RATE_BUCKET`: constant memory."""

    def __init__(self) -> None:
        self._buckets: deque[list[float]] = deque()  # [bucket number, records, acks], oldest first
        self.records_total = 0  # since the master started (Prometheus counters)
        self.acks_total = 0

    def add(self, now: float, records: int) -> None:
        """Count an ack of ``records`` records at time ``now``."""
        key = now // RATE_BUCKET
        self.records_total += records
        self.acks_total += 1
        if self._buckets and self._buckets[-1][0] == key:
            self._buckets[-1][1] += records
            self._buckets[-1][2] += 1
        else:
            self._buckets.append([key, float(records), 1.0])
        self._trim(now)

    def _trim(self, now: float) -> None:
        oldest = (now - RATE_WINDOW) // RATE_BUCKET
        while self._buckets and self._buckets[0][0] < oldest:
            self._buckets.popleft()

    def totals(self, now: float) -> tuple[float, float]:
        """(records, acks) in the window that ends ``now``."""
        self._trim(now)
        return sum(b[1] for b in self._buckets), sum(b[2] for b in self._buckets)

    def __len__(self) -> int:
        return len(self._buckets)


class CoreState:
    """Indexes over the records (by dataset, queue order, leased, unfolded acks) and the journal counters."""

    def __init__(self, journal: Journal, lease_ttl: float = DEFAULT_LEASE_TTL, clock: Callable[[], float] = time.time):
        self.journal = journal
        self.kv = KvStore(journal)  # a part of its own: touches only its rows (kv.py)
        self.lease_ttl = lease_ttl
        self.clock = clock
        self.datasets: dict[str, DatasetRecord] = {}
        self.shards: dict[str, ShardRecord] = {}
        self.by_dataset: dict[str, set[str]] = {}
        self.queues: dict[str, list[tuple[float, str]]] = {}
        self.state_counts: dict[str, Counter[ShardState]] = {}
        self.leased: set[str] = set()
        # lease affinity (core.lease): leased shards per (dataset, epoch, partition index), shards
        # waiting by (dataset, epoch, partition index, start), and per worker and dataset where the
        # last shard it was granted ends, (epoch, partition index, end). Memory only.
        self.reading: Counter[tuple[str, int, int]] = Counter()
        self.todo_at: dict[tuple[str, int, int, int], str] = {}
        self.tails: dict[tuple[str, str], tuple[int, int, int]] = {}
        self.unfolded: set[str] = set()  # shards with acks not yet in the committed cursor
        self.workers: dict[str, WorkerRecord] = {}
        self.committed = DataCursor()
        self.cuts: dict[int, CutRecord] = {}
        self.forgotten_cuts: dict[int, str] = {}  # recently forgotten uncommitted cuts -> why (memory only, bounded)
        self.cut_commit_error = ""  # the last refused cut commit since the last successful one, and why
        self.restore_revoked = BoundedSet(lambda: MAX_RESTORE_REVOKED)
        self.ack_log = AckRates()
        self.events: Counter[str] = Counter()  # since start, memory only (metrics): leases_granted, joins, workers_lost
        self.last_commit_time = 0.0  # when the last cut committed (memory only)
        self.available: dict[tuple[str, int], int] = {}  # streams: (dataset, partition index) -> end at last poll
        self.pending_since: dict[tuple[str, int], float] = {}  # streams: since when unplanned records wait
        self.source_errors: dict[str, tuple[str, float]] = {}  # dataset -> (last source error, since)
        # streams, data deleted upstream and ends that go back (upstream.py)
        lost = journal.get_meta("lost_cursor")
        self.lost = DataCursor.from_json(lost) if lost else DataCursor()  # its lost part: positions skipped as lost
        self.end_warnings: dict[str, str] = {}  # dataset -> the last end that went back (memory only)
        self.earliest_seen: dict[tuple[str, int], tuple[int, int]] = {}  # (dataset, pindex) -> (earliest, cut seq)
        self.skip_lost_once: set[str] = set()  # datasets resumed with skip_lost (memory only)
        # staged datasets (staged.py): (dataset, producer, part, epoch) -> (records, file URIs) of each commit
        self.staged_commits: dict[tuple[str, str, str, int], tuple[int, list[str]]] = {}
        self.retired_staged: set[tuple[str, str]] = set()  # (dataset, file uri) handed to retention (staged.py)
        self.started = clock()
        self._lease_seq = int(journal.get_meta("lease_seq") or 0)
        self._cut_seq = int(journal.get_meta("cut_seq") or 0)
        self._front = float(journal.get_meta("front_priority") or 0.0)
        self._back = float(journal.get_meta("back_priority") or 0.0)
        self.last_committed_cut = int(journal.get_meta("last_committed_cut") or 0)
        self._load()
        durable = journal.get_meta("durable_cursor")  # the newest checkpoint storage holds: the upstream limit
        self.durable = DataCursor.from_json(durable) if durable else self.committed.copy()
        upstream = journal.get_meta("upstream_cursor")  # the durable checkpoint before it: what upstream may hold
        self.upstream = DataCursor.from_json(upstream) if upstream else self.durable.copy()

    # ------------------------------------------------------------------ loading
    def _load(self) -> None:
        now = self.clock()
        for ds in self.journal.load_datasets():
            self.datasets[ds.name] = ds
            self._new_dataset_indexes(ds.name)
        for w in self.journal.load_workers():
            w.last_seen = now
            self.workers[w.id] = w
        for s in self.journal.load_shards():
            self._index(s)
            if s.state is ShardState.LEASED:
                s.deadline = now + self.lease_ttl
                worker = self.workers.get(s.worker or "")
                if worker is None:  # worker row gone with the lease still recorded: return the shard
                    self._set_state(s, ShardState.TODO)
                    s.worker = None
                    self._push(s)
                else:
                    worker.leases.add(s.id)
        self.committed = self.journal.load_cursor()
        for cut in self.journal.load_cuts():
            self.cuts[cut.id] = cut
        for dataset, producer, part, epoch, records, files in self.journal.load_staged():
            self.staged_commits[(dataset, producer, part, epoch)] = (records, files)

    def _index(self, s: ShardRecord) -> None:
        self.shards[s.id] = s
        self.by_dataset[s.dataset].add(s.id)
        self.state_counts[s.dataset][s.state] += 1
        if s.state is ShardState.TODO:
            heapq.heappush(self.queues[s.dataset], (s.priority, s.id))
        elif s.state is ShardState.LEASED:
            self.leased.add(s.id)
        self._track(s, s.state, +1)
        if s.acks:
            self.unfolded.add(s.id)

    def _set_state(self, s: ShardRecord, state: ShardState) -> None:
        """Every shard state change goes through here, so the per-dataset counts stay exact.

        Only the changes in :data:`TRANSITIONS` are made, and only when their guard holds;
        anything else raises :class:`IllegalTransitionError` before anything changes.
        """
        rule = TRANSITIONS.get((s.state, state))
        if rule is None or not rule[1](s):
            what = "no such transition" if rule is None else f"its guard failed ({rule[0]})"
            raise IllegalTransitionError(
                f"shard {s.id!r}: {s.state.value} -> {state.value}: {what} "
                f"(acked to {s.acked_to} of [{s.start}, {s.end}))"
            )
        counts = self.state_counts[s.dataset]
        counts[s.state] -= 1
        counts[state] += 1
        self._track(s, s.state, -1)
        self._track(s, state, +1)
        s.state = state
        if state is ShardState.LEASED:
            self.leased.add(s.id)
        else:
            self.leased.discard(s.id)

    def _drop_shard(self, sid: str) -> ShardRecord:
        """Remove a shard from memory (the caller deletes its journal row)."""
        s = self.shards.pop(sid)
        self.by_dataset[s.dataset].discard(sid)
        self.unfolded.discard(sid)
        self.leased.discard(sid)
        self.state_counts[s.dataset][s.state] -= 1
        self._track(s, s.state, -1)
        return s

    def _track(self, s: ShardRecord, state: ShardState, delta: int) -> None:
        """Keep the affinity indexes (``reading``, ``todo_at``) as ``s`` enters (+1) or leaves (-1) ``state``."""
        if state is ShardState.LEASED:
            key = (s.dataset, s.epoch, s.pindex)
            self.reading[key] += delta
            if self.reading[key] <= 0:
                del self.reading[key]
        elif state is ShardState.TODO:
            at = (s.dataset, s.epoch, s.pindex, s.start)
            if delta > 0:
                self.todo_at[at] = s.id
            elif self.todo_at.get(at) == s.id:
                del self.todo_at[at]

    def _new_dataset_indexes(self, name: str) -> None:
        self.by_dataset[name] = set()
        self.queues[name] = []
        self.state_counts[name] = Counter()

    def _push(self, s: ShardRecord, front: bool = False) -> None:
        if front:
            self._front -= 1
            s.priority = self._front
        heapq.heappush(self.queues[s.dataset], (s.priority, s.id))

    def _save_counters(self) -> None:
        j = self.journal
        j.put_meta("lease_seq", str(self._lease_seq))
        j.put_meta("cut_seq", str(self._cut_seq))
        j.put_meta("front_priority", repr(self._front))
        j.put_meta("back_priority", repr(self._back))
        j.put_meta("last_committed_cut", str(self.last_committed_cut))

    def dataset(self, name: str) -> DatasetRecord:
        """The record of dataset ``name``; :class:`NotFoundError` naming the registered ones otherwise."""
        ds = self.datasets.get(name)
        if ds is None:
            known = ", ".join(sorted(self.datasets)) or "none"
            raise NotFoundError(f"dataset {name!r} is not registered (registered: {known})")
        return ds

    def _add_planned(self, ds: DatasetRecord, planned: Iterable[PlannedShard]) -> None:
        for p in planned:
            self._back += 1
            sid = shard_id_for(ds.name, p.epoch, p.partition.index, p.start, p.end)
            s = ShardRecord(sid, ds.name, p.epoch, p.partition.index, p.start, p.end, priority=self._back)
            self._index(s)
            self.journal.put_shard(s)

    def _key(self, s: ShardRecord) -> PartitionKey:
        return PartitionKey(s.dataset, s.epoch, self.datasets[s.dataset].partitions[s.pindex].id)
