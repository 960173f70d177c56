"""In which order, and to whom, the shard table leases its shards: queue order, stream time, reader affinity.

A batch dataset's queue is its plan's order (partition then position, or a seeded shuffle). A stream
dataset's queue is **stream-time order** (ARCHITECTURE.md, "Serving and freshness"): each shard has the time of
its first record (``ShardRecord.time``: the broker's timestamp where the source gives one cheaply, Kafka's
CreateTime/LogAppendTime, Pulsar's publish time, RocketMQ's store time: ``MasterSource.first_times``; otherwise
when the master planned it), and its queue priority is that time, so a
backlog is leased across partitions in the order its records were written instead of partition by partition.
``sr.max_skew_ms`` bounds it, as Flink's watermark alignment bounds a source split: no shard is leased whose time
is more than the bound ahead of the oldest shard of its dataset that is not yet acked (:class:`StreamTime`).
Returned leases go first, as they always did (they are the oldest). Reader affinity (a worker gets the shard
that continues the partition it read) chooses only among a stream's oldest waiting shards, those of the same time
(SAME_TIME_MS): shards planned together at the stream's head, where planning order is time order (they follow the
newest time known at once, :meth:`CoreState.add_planned`, and get their records' times from the poller once they
are leased, so that the skew and the oldest shard not yet acked are the broker's; a head shard is judged by the
bound with its provisional time). A backlog's shards have their records' times, read by the poller before they are
leased, and go strictly in time order.

The times are journalled with the shards, so the bound holds after a master restart; a restore re-plans with
the times of the shards it replaces (:func:`times_of`).
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from streamrover.shard_service.api import ShardState
from streamrover.shard_service.master.bookkeeping import DatasetRecord, ShardRecord, WorkerRecord
from streamrover.sources.api import SourceKind
from streamrover.sources.options import planning_options

if TYPE_CHECKING:  # pragma: no cover
    from streamrover.shard_service.master.state import CoreState

# how many queued shards a lease looks past for one of a partition no other worker reads
AFFINITY_SCAN = 64
# shards whose times are this close count as equally old (shards planned in one poll, timed by planning, are a
# microsecond apart): affinity chooses among them freely
SAME_TIME_MS = 1.0
TimeMarks = dict[int, list[tuple[int, float]]]  # per partition index: (shard start, its time), in position order


def skew_bound_ms(ds: DatasetRecord) -> float | None:
    """The dataset's ``sr.max_skew_ms`` (None: no bound: a batch dataset, or a stream with 0)."""
    if ds.kind is not SourceKind.STREAM:
        return None
    bound = planning_options(ds.spec.options).max_skew_ms
    return float(bound) if bound > 0 else None


class StreamTime:
    """Per stream dataset, the oldest shard not yet acked (TODO or LEASED), by stream time: a heap with lazy
    deletion (an entry is dropped when it reaches the top and its shard is gone, ACKED or re-timed)."""

    def __init__(self, shards: dict[str, ShardRecord]) -> None:
        self._shards = shards
        self._heaps: dict[str, list[tuple[float, str]]] = {}
        self._newest: dict[str, float] = {}
        self._provisional: dict[str, set[str]] = {}  # per dataset: head shards timed by the newest time known

    def provisional(self, s: ShardRecord) -> None:
        """Note a head shard leased at once with the newest time known: its records' time is read once it is
        leased (:meth:`to_retime`, :meth:`retime`). Memory only (after a master restart it keeps its time)."""
        self._provisional.setdefault(s.dataset, set()).add(s.id)

    def to_retime(self, name: str) -> list[ShardRecord]:
        """Dataset ``name``'s head shards whose records' time the poller is to read: those leased or acked (one
        still waiting keeps its place among the shards planned with it: affinity, :func:`pop_todo`)."""
        marked = self._provisional.get(name, set())
        for sid in [sid for sid in marked if sid not in self._shards]:
            marked.discard(sid)  # re-planned (a restore)
        return [s for sid in marked if (s := self._shards[sid]).state is not ShardState.TODO]

    def retime(self, s: ShardRecord, t: float | None) -> bool:
        """Give head shard ``s`` its records' time ``t`` (None: not known, it keeps its own). Whether it changed."""
        self._provisional.get(s.dataset, set()).discard(s.id)
        if t is None or s.state is ShardState.TODO or t == s.time:
            return False
        s.time = t
        self.track(s)
        return True

    def track(self, s: ShardRecord) -> None:
        """Note a shard that has a time (planned, loaded, timed)."""
        if s.time is None:
            return
        if s.time > self._newest.get(s.dataset, float("-inf")):
            self._newest[s.dataset] = s.time
        if s.state is not ShardState.ACKED:
            heapq.heappush(self._heaps.setdefault(s.dataset, []), (s.time, s.id))

    def newest(self, name: str) -> float | None:
        """The newest time of a shard of dataset ``name`` (None: none has a time yet)."""
        return self._newest.get(name)

    def oldest(self, name: str) -> float | None:
        """The time of the oldest shard of dataset ``name`` not yet acked (None: none has a time)."""
        heap = self._heaps.get(name)
        while heap:
            t, sid = heap[0]
            s = self._shards.get(sid)
            if s is not None and s.time == t and s.state is not ShardState.ACKED:
                return t
            heapq.heappop(heap)
        return None

    def forget(self, name: str) -> None:
        """Drop dataset ``name``'s entries (removed, or all its shards re-planned)."""
        self._heaps.pop(name, None)
        self._newest.pop(name, None)
        self._provisional.pop(name, None)

    def skew_ms(self, table: CoreState, name: str) -> float:
        """How much stream time the dataset's leased shards span: the newest leased shard's time less the oldest
        shard not yet acked (0 when nothing is leased). Bounded by ``sr.max_skew_ms``."""
        oldest = self.oldest(name)
        leased = [t for sid in table.leased if (s := table.shards[sid]).dataset == name and (t := s.time) is not None]
        return max(max(leased) - oldest, 0.0) if leased and oldest is not None else 0.0


def times_of(shards: Iterable[ShardRecord]) -> TimeMarks:
    """The (start, time) marks of shards that have a time, per partition index, in position order."""
    marks: TimeMarks = {}
    for s in shards:
        if s.time is not None:
            marks.setdefault(s.pindex, []).append((s.start, s.time))
    for ms in marks.values():
        ms.sort()
    return marks


def time_at(marks: TimeMarks, pindex: int, position: int) -> float | None:
    """The time of the record at ``position`` as far as ``marks`` tell: the time of the last mark at or before it
    (a shard's first record; a later one is no older), else the oldest mark of the dataset (records before every
    known shard are older than all of them); None when there are no marks."""
    ms = marks.get(pindex, [])
    i = bisect.bisect_right(ms, (position, float("inf")))
    if i:
        return ms[i - 1][1]
    oldest = [m[0][1] for m in marks.values() if m]
    return min(oldest) if oldest else None


def pop_todo(table: CoreState, ds: DatasetRecord, w: WorkerRecord | None = None) -> ShardRecord | None:
    """The next shard to lease: queue order, with lease affinity for ``w`` unless the dataset is shuffled, inside
    the stream-time bound (None when the next shard is beyond it: the caller answers WAIT).

    Affinity: a worker gets the shard that starts where the last shard it was granted ends
    (its reader is positioned there: a Kafka consumer keeps its prefetched records), unless
    a returned shard waits (those go first); otherwise the first shard in queue order of a
    partition that no other worker is reading, so that workers do not leapfrog along one
    partition. Neither changes what is leased, only in which order and to whom.
    """
    queue = table.queues[ds.name]
    prefer = w is not None and not ds.spec.shuffle
    mine: Counter[tuple[str, int, int] | None] = Counter()  # w's leases per partition, counted once if needed
    bound = skew_bound_ms(ds)
    oldest = table.stream_time.oldest(ds.name) if bound is not None else None
    limit = float("inf") if bound is None or oldest is None else oldest + bound

    def within(s: ShardRecord, bound: float = limit) -> bool:
        return s.time is None or s.time <= bound

    while True:
        head = _queue_head(table, queue)
        near = _horizon(queue, table) if prefer and ds.kind is SourceKind.STREAM else limit  # affinity's reach
        if prefer and w is not None and (head is None or head[0] >= 0):  # (front priorities are < 0)
            tail = table.tails.get((w.id, ds.name))
            sid = table.todo_at.get((ds.name, *tail)) if tail is not None else None
            if sid is not None and not table.held(table.shards[sid]) and within(table.shards[sid], min(limit, near)):
                return table.shards[sid]  # its queue entry is now stale and skipped later
        skipped: list[tuple[float, str]] = []
        found: ShardRecord | None = None
        while queue:
            prio, sid = queue[0]
            s = table.shards.get(sid)
            if s is None or s.state is not ShardState.TODO or s.priority != prio:
                heapq.heappop(queue)
                continue  # stale
            heapq.heappop(queue)
            if not within(s):
                if prio < 0:  # a returned shard beyond the bound (an older one was planned since): look past it
                    skipped.append((prio, sid))
                    continue
                heapq.heappush(queue, (prio, sid))
                break  # beyond the bound: so is every shard after it (the queue is in stream-time order)
            if skipped and prio >= 0 and not within(s, near):  # past the readers' horizon: take what was looked past
                heapq.heappush(queue, (prio, sid))
                break
            if prefer and prio >= 0 and len(skipped) < AFFINITY_SCAN and _read_by_others(table, s, w, mine):
                skipped.append((prio, sid))
                continue
            found = s
            break
        if found is None:  # the first shard looked past for affinity's sake, if any is inside the bound
            i = next((i for i, (_, sid) in enumerate(skipped) if within(table.shards[sid])), None)
            found = None if i is None else table.shards[skipped.pop(i)[1]]
        for item in skipped:
            heapq.heappush(queue, item)
        if found is not None:
            return found
        if ds.kind is SourceKind.BATCH and ds.epochs_planned < ds.spec.epochs:
            table.plan_next_epoch(ds)
            continue
        return None


def _horizon(queue: list[tuple[float, str]], table: CoreState) -> float:
    """The time of the oldest shard waiting, give or take SAME_TIME_MS (inf when none waits): a stream's affinity
    picks only among shards this old (those planned together at the head), so a backlog goes in time order."""
    live: tuple[float, str] | None = None  # the least live entry of priority >= 0: a walk down the heap that
    stack = [0] if queue else []  # skips every subtree whose root is no less than the best found (heap order),
    while stack:  # so it visits the front entries and the stale ones before it, not the whole queue
        i = stack.pop()
        e = queue[i]
        if live is not None and e >= live:
            continue
        if e[0] >= 0 and _live(table, e):
            live = e  # its subtree holds nothing less
            continue
        stack.extend(c for c in (2 * i + 1, 2 * i + 2) if c < len(queue))
    return live[0] + SAME_TIME_MS if live is not None else float("inf")


def _live(table: CoreState, entry: tuple[float, str]) -> bool:
    s = table.shards.get(entry[1])
    return s is not None and s.state is ShardState.TODO and s.priority == entry[0]


def _queue_head(table: CoreState, queue: list[tuple[float, str]]) -> tuple[float, str] | None:
    """The first live entry of a queue (stale entries in front of it are dropped)."""
    while queue:
        if _live(table, queue[0]):
            return queue[0]
        heapq.heappop(queue)
    return None


def _read_by_others(
    table: CoreState, s: ShardRecord, w: WorkerRecord | None, mine: Counter[tuple[str, int, int] | None]
) -> bool:
    """Whether another worker than ``w`` holds a lease on ``s``'s partition (in ``s``'s epoch).

    ``mine``: ``w``'s leases per partition, filled here on first use (empty: not counted yet; the
    caller keeps it for one lease, while ``w``'s leases do not change).
    """
    key = (s.dataset, s.epoch, s.pindex)
    readers = table.reading.get(key, 0)
    if readers == 0:
        return False
    if w is not None and not mine and w.leases:
        mine.update(_reading_key(table, sid) for sid in w.leases)
    return readers > mine[key]


def _reading_key(table: CoreState, sid: str) -> tuple[str, int, int] | None:
    s = table.shards.get(sid)
    return None if s is None else (s.dataset, s.epoch, s.pindex)
