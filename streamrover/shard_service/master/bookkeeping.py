"""The service's bookkeeping: the mutable records of datasets, shards, workers and cuts (not data records).

The core keeps them in memory, the journal on disk; the core's answers (a lease's outcome, a dataset's counts)
and its batched ack are at the end.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from streamrover.cursor import DataCursor, IntervalSet
from streamrover.shard_service.api import (
    DEFAULT_RECORDS_PER_SHARD,
    MAX_AUTO_RECORDS_PER_SHARD,
    DatasetSpec,
    LeaseGrant,
    LeaseStatus,
    PartitionPlan,
    ShardState,
)
from streamrover.sources.api import SourceKind
from streamrover.sources.positions import RecordRuns


@dataclass
class ShardRecord:
    """One shard as the core tracks it: its coordinates, state, current lease and the acks not yet committed."""

    id: str
    dataset: str
    epoch: int
    pindex: int
    start: int
    end: int
    state: ShardState = ShardState.TODO
    attempt: int = 0  # the current or last lease number; 0 = never leased
    worker: str | None = None
    deadline: float = 0.0  # memory only: a restarted master grants a fresh lease TTL
    acked_to: int = -1  # first position not acked; set to start on creation
    # Acks not yet folded into the committed cursor: (step or None, position), in position order.
    acks: list[tuple[int | None, int]] = field(default_factory=list)
    acked_by: dict[int, int] = field(default_factory=dict)  # attempt -> highest position it acked
    priority: float = 0.0  # queue order: lower is leased first
    # stream time of its first record, ms since the epoch (the broker's timestamp, or when the master planned it);
    # None: a batch shard, or a stream shard whose time the poller has not read yet (not leased until it has)
    time: float | None = None

    def __post_init__(self) -> None:
        if self.acked_to < 0:
            self.acked_to = self.start


#: The cursor partition of a staged dataset's compacted files (``staged.py``): its positions are the records of the
#: files compacted, in commit order, and it is one interval [0, records) once any are (not a file uri: no file has it).
COMPACTED = "<compacted>"


class PartitionPlans(list[PartitionPlan]):
    """A dataset's planned partitions, by index: the first ``base`` (a staged dataset's compacted files) are not held.

    ``len()`` counts them (a new partition's index is ``len()``); iteration yields the partitions held, in index
    order; indexing by a partition's index finds it (IndexError for a compacted one).

    ``changed``: the indexes set since the journal last wrote the whole list (``Journal.put_dataset`` writes only
    their ends while ``written``, the shape it wrote then, still holds), so a poll that moves 1% of 10,000
    partitions' planned ends journals 100 rows, not the list.
    """

    base = 0

    def __init__(self, plans: Iterable[PartitionPlan] = ()) -> None:
        super().__init__(plans)
        self.changed: set[int] = set()
        self.written: tuple[object, ...] | None = None

    def __len__(self) -> int:
        return self.base + super().__len__()

    def __getitem__(self, i: int) -> PartitionPlan:  # type: ignore[override]
        if i < 0:
            return super().__getitem__(i)
        if i < self.base:
            raise IndexError(f"partition {i} is compacted")
        return super().__getitem__(i - self.base)

    def __setitem__(self, i: int, plan: PartitionPlan) -> None:  # type: ignore[override]
        super().__setitem__(i - self.base if i >= 0 else i, plan)
        self.changed.add(i if i >= 0 else len(self) + i)

    def compact(self, n: int) -> list[PartitionPlan]:
        """Stop holding the first ``n`` partitions held; returns them."""
        gone = list(self)[:n]
        super().__delitem__(slice(0, n))
        self.base += n
        return gone


@dataclass
class DatasetRecord:
    """One registered dataset: its spec, kind, planned partitions, schema, and sparse partitions' runs."""

    spec: DatasetSpec
    kind: SourceKind
    partitions: list[PartitionPlan]
    schema_json: str
    epochs_planned: int = 0
    dead_letters: int = 0
    failed: str = ""  # why the dataset cannot go on ("" while it can)
    # Sparse partitions (by index): the runs of positions that hold records, as the source reported
    # them (sources/positions.py). A partition without runs is dense.
    runs: dict[int, RecordRuns] = field(default_factory=dict)
    # staged datasets: records of the files compacted (their partitions are not held: ``partitions.base`` of them)
    compacted_records: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.partitions, PartitionPlans):
            self.partitions = PartitionPlans(self.partitions)

    @property
    def plans(self) -> PartitionPlans:
        """The partitions as :class:`PartitionPlans` (with the count of compacted ones)."""
        assert isinstance(self.partitions, PartitionPlans)
        return self.partitions

    @property
    def name(self) -> str:
        """The dataset's name (its spec's)."""
        return self.spec.name

    @property
    def shard_size(self) -> int:
        """Records per shard: as specified, or for batch files one partition (a parquet row group), capped."""
        if self.spec.records_per_shard:
            return self.spec.records_per_shard
        if self.kind is SourceKind.BATCH and self.partitions:
            longest = max(p.end - p.start for p in self.partitions)
            return max(1, min(longest, MAX_AUTO_RECORDS_PER_SHARD))
        return DEFAULT_RECORDS_PER_SHARD

    def partition_by_id(self) -> dict[str, PartitionPlan]:
        """The planned partitions by source partition id."""
        return {p.id: p for p in self.partitions}

    def records_in(self, pindex: int, start: int, end: int) -> int:
        """How many records partition ``pindex`` holds in ``[start, end)`` (a position difference only if dense)."""
        runs = self.runs.get(pindex)
        return max(end - start, 0) if runs is None else runs.count(start, end)

    def planned_in(self, pindex: int, start: int, end: int) -> int:
        """How many planned shards ``[start, end)`` of partition ``pindex`` covers: one, or a merged shard's members."""
        return max(1, -(-self.records_in(pindex, start, end) // self.shard_size))

    def records_in_set(self, pindex: int, covered: IntervalSet) -> int:
        """How many records of partition ``pindex`` lie inside ``covered``."""
        runs = self.runs.get(pindex)
        return covered.size() if runs is None else sum(runs.count(a, b) for a, b in covered)

    def planned_records(self) -> int:
        """Records in the partitions' planned extents."""
        return self.compacted_records + sum(self.records_in(p.index, p.start, p.end) for p in self.partitions)


@dataclass
class WorkerRecord:
    """One worker that joined: its leases, what it was told at heartbeats, and its last lease request."""

    id: str
    name: str
    last_seen: float = 0.0  # memory only
    leases: set[str] = field(default_factory=set)  # derived from shards on load
    revoked: set[tuple[str, int]] = field(default_factory=set)  # memory only: (shard, attempt), told at heartbeat
    last_request_id: int = 0
    last_lease_ids: list[str] = field(default_factory=list)
    records_acked: int = 0  # memory only (status)


class CutState(enum.Enum):
    """Where a cut is: prepared, being persisted (kept until it commits), or committed."""

    PREPARED = "prepared"
    PERSISTING = "persisting"  # prepared, and its checkpoint is being persisted: never evicted by newer prepares
    COMMITTED = "committed"


@dataclass
class CutRecord:
    """A cut: the cursor of the model state at ``step`` (None: every ack), and where it is."""

    id: int
    step: int | None
    cursor: DataCursor
    state: CutState


@dataclass(frozen=True)
class LeaseOutcome:
    """The answer to a lease request: its status, the leases granted, and when to ask again (seconds) when WAIT."""

    status: LeaseStatus
    leases: list[LeaseGrant]
    retry_after: float = 0.0


@dataclass(frozen=True)
class AckItem:
    """One ack of a batch (:meth:`ShardCore.ack_batch`): the arguments of :meth:`ShardCore.ack`."""

    worker_id: str
    shard_id: str
    attempt: int
    position: int
    step: int | None = None
    dead_letters: int = 0


@dataclass(frozen=True)
class DatasetCounts:
    """A dataset's shards by state and its records acked and committed (for status)."""

    todo: int
    leased: int
    acked: int
    committed: int
    records_acked: int
    records_committed: int
    finished: bool
