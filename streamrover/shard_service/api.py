"""The shard service's contract: what it promises workers, trainers and tools, in Python terms.

Reading this module alone tells what the service promises. :class:`ShardService` is the
service as a worker sees it (whatever the transport: ``client.py`` carries it over gRPC),
:class:`Shard` a leased shard; their docstrings say what each call does, when it blocks and
what it raises. ``core.py`` keeps the promises, ``journal.py`` makes them durable,
``server.py`` serves them; the RPC schema is ``v1/shard_service.proto``.

**The life of a record.** A dataset's partitions are cut into shards (:func:`shard_id_for`: a
shard's id is its coordinates, never a counter). A worker leases a shard (:meth:`ShardService.lease`),
reads it from the source itself, applies the records to the model, and acks the position after
the step that consumed them (:meth:`Shard.ack`). A checkpoint takes a *cut*
(:meth:`ShardService.prepare_cut`: the committed cursor plus every recorded ack of steps up to
the checkpoint's), stores the cut's cursor in its manifest, and commits the cut once the
manifest is durable (:meth:`ShardService.commit_cut`). A restore resets the service to a
checkpoint's cursor (:meth:`ShardService.restore_cursor`): everything acked or leased after it
is read again. So the records in a model state are exactly the records in its cursor.

**Leases and fencing.** A lease is ``(shard, attempt, worker, deadline)``. Heartbeats (sent by
the client's thread) extend every lease the worker holds by the lease TTL; a lease whose
deadline passes, or whose worker misses heartbeats for a TTL, goes back to the queue and is
leased again under a new, higher attempt, resuming at the last *recorded* ack. An ack is
applied only when it comes from the worker holding the shard's current attempt: an ack of an
expired, revoked or superseded lease is refused (``FAILED_PRECONDITION``: :class:`StaleLeaseError`
in the core, :class:`FailedPreconditionError` from the client, :class:`LeaseLostError` from
:meth:`Shard.ack`) and changes nothing (the records it speaks for are handed out again). The repeat of an ack the same
attempt already made is answered OK with no effect (``AckResult.duplicate``): retries are safe.

**Errors.** Every refusal is a :class:`ShardServiceError` whose ``code`` is the gRPC status
the server answers with:

- :class:`InvalidArgumentError`: the request is malformed (a position outside the shard, a bad spec, bad bytes);
- :class:`NotFoundError`: it names what the service does not know (dataset, shard, worker, cut);
- :class:`AlreadyExistsError`: a dataset name is taken by another spec;
- :class:`FailedPreconditionError`: well-formed but the state forbids it; its
  :class:`StaleLeaseError` (the ack's lease is not current) and, on the worker side,
  :class:`LeaseLostError` (stop applying that shard);
- :class:`UnauthenticatedError` (wrong token), :class:`PermissionDeniedError` (a worker token on an
  administrator's call), :class:`UnavailableError` (no master within the client's timeout: calls retry
  ``UNAVAILABLE`` until then);
- :class:`AckFailedError`: acks sent in the background were refused; it lists each :class:`AckFailure`.

**Roles.** Two tokens: the *admin* token (``STATE_DIR/token``) may make every call; the *worker* token
(:func:`streamrover.tokens.worker_token` of it, what the operator hands workers) only :data:`WORKER_CALLS`:
lease, ack, heartbeat, report, cut, the key-value store, and reading. :data:`ADMIN_CALLS` (add, remove and
resume datasets, restore, stop) with a worker token are refused ``PERMISSION_DENIED`` naming the call and
the role, with two narrow exceptions a worker's own life needs: ``RegisterDataset`` of a dataset already
registered with the same spec (an idempotent "ensure"), and ``Restore`` to a cursor the master issued (the
committed or durable cursor, or a cut it remembers: what a checkpoint load does), never ``discard_committed``.

A master whose journal cannot be written stops (``journal.JournalWriteError``, deliberately
not a :class:`ShardServiceError`: it is never answered as a refusal, the process fail-stops).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

# The error types live in errors.py (the **Errors** paragraph above is their contract); they are part of this API.
from streamrover.shard_service.errors import (
    AckFailedError,
    AckFailure,
    AlreadyExistsError,
    DataLostError,
    FailedPreconditionError,
    InvalidArgumentError,
    LeaseLostError,
    NotFoundError,
    PermissionDeniedError,
    ShardServiceError,
    StaleLeaseError,
    UnauthenticatedError,
    UnavailableError,
)

if TYPE_CHECKING:  # pragma: no cover
    from streamrover.cursor import DataCursor
    from streamrover.sources.api import ReadBatch

DEFAULT_RECORDS_PER_SHARD = 10_000  # streams
MAX_AUTO_RECORDS_PER_SHARD = 1 << 18  # batch files: one shard per row group, up to this many rows
DEFAULT_LEASE_TTL = 10.0
DEFAULT_MAX_SESSIONS = 4096  # worker session streams one master serves at once (a server thread each)


class Role(enum.Enum):
    """What a token may do (module docstring, **Roles**)."""

    WORKER = "worker"
    ADMIN = "admin"


#: The RPCs (``v1/shard_service.proto``) a worker token may make: a worker's, a sink's and a reader's calls.
WORKER_CALLS = frozenset({
    "Join", "Leave", "LeaseShards", "Heartbeat", "Ack", "AckBatch", "WorkerSession",  # leases and acks
    "ReportMetrics", "ReportUnreadable", "CommitStaged",  # reports, and a sink's commits of staged files
    "CutPrepare", "CutCommit", "GetCursor",  # cuts (checkpoints)
    "KvGet", "KvSet", "KvDeleteRange",  # the key-value store (rendezvous)
    "DescribeDataset", "ListDatasets", "Status",  # reading
})  # fmt: skip
#: The RPCs only the admin token may make (but see the module docstring's two exceptions).
ADMIN_CALLS = frozenset({"RegisterDataset", "RemoveDataset", "ResumeDataset", "Restore", "Stop"})


class ShardState(enum.Enum):
    """Where a shard is in its life (``core.py``'s transition table says which changes are allowed)."""

    TODO = "todo"  # waiting in the queue
    LEASED = "leased"  # held by one worker under one attempt
    ACKED = "acked"  # every position acked; not yet folded into the committed cursor
    # Shards inside the committed cursor are deleted from the journal (compaction).

    # Members are singletons compared by identity: hash them so too, in C (Enum's own __hash__, hash of the
    # name, is a Python call, and the shard table hashes states ~14 times per lease and ack: per-state counts).
    __hash__ = object.__hash__


class LeaseStatus(enum.Enum):
    """The answer to a lease request."""

    OK = "ok"
    WAIT = "wait"  # nothing to lease now
    END = "end"  # batch dataset finished


@dataclass(frozen=True)
class DatasetSpec:
    """A dataset as registered: its name, source URI and options, and how it is cut into shards.

    ``records_per_shard`` 0 means the default (streams: :data:`DEFAULT_RECORDS_PER_SHARD`; batch
    files: a row group per shard). ``epochs``, ``shuffle`` and ``seed`` apply to batch data and to a stream's
    history only (``sr.history``: its history is trained ``epochs`` times, shuffled, before the live part).
    """

    name: str
    uri: str
    format: str = ""
    options: dict[str, str] = field(default_factory=dict)
    records_per_shard: int = 0
    epochs: int = 1
    shuffle: bool = False
    seed: int = 0

    def normalized(self) -> DatasetSpec:
        """The spec as the service compares and stores it (options sorted, at least one epoch)."""
        return DatasetSpec(
            name=self.name,
            uri=self.uri,
            format=self.format,
            options=dict(sorted(self.options.items())),
            records_per_shard=self.records_per_shard,
            epochs=max(self.epochs, 1),
            shuffle=self.shuffle,
            seed=self.seed,
        )

    def to_json(self) -> str:
        """The spec as JSON (the journal's form)."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DatasetSpec:
        """The spec :meth:`to_json` wrote."""
        data: dict[str, Any] = json.loads(text)
        return cls(**data)

    def validate(self) -> None:
        """Raise :class:`InvalidArgumentError` naming the first bad field."""
        if self.records_per_shard < 0:
            raise InvalidArgumentError(f"dataset {self.name!r}: records_per_shard must be positive")
        if self.epochs < 0:
            raise InvalidArgumentError(f"dataset {self.name!r}: epochs must be positive")
        if not self.uri:
            raise InvalidArgumentError(f"dataset {self.name!r}: uri is empty")


@dataclass(frozen=True)
class PartitionPlan:
    """A partition as the service plans it: its index, source id, and planned extent ``[start, end)``."""

    index: int
    id: str
    start: int
    end: int


@dataclass(frozen=True)
class LeaseGrant:
    """A lease as granted: shard ``[start, end)`` of ``partition`` under ``attempt``; read from ``resume``.

    ``resume`` is the last position an earlier attempt got recorded (``start`` for a fresh shard);
    ``deadline`` (Unix seconds) is when the lease expires unless heartbeats extend it.
    """

    shard_id: str
    attempt: int
    dataset: str
    epoch: int
    partition: PartitionPlan
    start: int
    end: int
    resume: int
    deadline: float
    shards: int = 1  # the planned shards it covers: more than one when the master merged them (merging.py)


@dataclass(frozen=True)
class AckResult:
    """The answer to an ack: the shard is finished (acked to its end); the ack was a harmless repeat."""

    shard_done: bool
    duplicate: bool


def shard_id_for(dataset: str, epoch: int, partition_index: int, start: int, end: int) -> str:
    """A shard's id is its coordinates: ``dataset/epoch/partition-index/start-end``. Never a counter."""
    return f"{dataset}/{epoch}/{partition_index}/{start}-{end}"


def parse_shard_id(shard_id: str) -> tuple[str, int, int, int, int] | None:
    """The coordinates in a shard id, or None when it is not one."""
    try:
        dataset, epoch, pindex, span = shard_id.rsplit("/", 3)
        start, end = span.split("-", 1)
        return dataset, int(epoch), int(pindex), int(start), int(end)
    except ValueError:
        return None


class RestoreOutcome(Protocol):
    """What a restore did."""

    leases_revoked: int  # leases the restore took back (their acks are refused from now on)
    records_requeued: int  # records planned again: everything outside the restored cursor


class Shard(Protocol):
    """A shard this worker leased: read its records, ack positions (``leased.LeasedShard``)."""

    lease: LeaseGrant
    position: int  # the next position to read
    acked: int  # the last position the master recorded (a queued ack counts once answered)
    done: bool  # the master recorded an ack of the shard's end

    @property
    def revoked(self) -> bool:
        """The lease was taken back (a heartbeat said so, or a restore): stop reading, do not ack."""
        ...

    def batches(self, batch_size: int = ...) -> Iterator[ReadBatch]:
        """The shard's records from :attr:`position` to its end, read from the source (no master round trip).

        Blocks while the source fetches; stops early when the lease is revoked. The last batch ends
        at the shard's end (an empty one when no record lies in its tail), so acking it finishes
        the shard. Raises the source's errors (``sources.api.SourceError``).
        """
        ...

    def ack(
        self, position: int | None = None, step: int | None = None, *, wait: bool | None = None
    ) -> AckResult | None:
        """Say the records before ``position`` (default: all read so far) are applied to the model, after ``step``.

        Ack *after* the optimizer step that consumed them, with that step's number: a cut of step S
        holds exactly the acks of steps <= S. ``wait=False`` (the default of an ``async_acks``
        client) queues the ack and returns None at once; it is sent in order, and a refusal is
        reported later (see :class:`ShardService`, "acks that were queued"). ``wait=True`` sends
        it (after every ack queued before it) and returns the master's answer. Raises
        :class:`LeaseLostError` when the lease is gone (expired, revoked, taken over, or an
        earlier queued ack of it was refused): stop applying the shard's records; the ones
        applied but not acked are handed out again, after the last recorded ack.
        :class:`InvalidArgumentError` for a position outside the shard or before its resume point.
        """
        ...


class ShardService(Protocol):
    """The shard service as one worker sees it, whatever carries the calls (``ShardClient``: gRPC).

    Every call may block while the master is unreachable: calls retry ``UNAVAILABLE`` with
    backoff for the client's ``timeout`` and then raise :class:`UnavailableError`; retried
    calls are safe (acks are idempotent per attempt, lease requests carry a request id).

    **Acks that were queued** (``async_acks``) are sent by a background thread, in order. Everything
    whose answer depends on acks being recorded first waits for every ack queued before it:
    :meth:`flush`, :meth:`prepare_cut`, :meth:`get_cursor`, :meth:`leave` and a waiting ack.
    A refused queued ack is never dropped: it is reported once, by the next of :meth:`flush`
    (and the calls that flush: they raise :class:`AckFailedError`), the next ack of the same
    lease (:class:`LeaseLostError`), or :meth:`take_ack_failures`. Only this worker's acks are
    flushed: when another process takes the cut, every acking worker flushes before the barrier
    that lets it. A worker killed with acks queued loses them: those shards are leased again
    from their last recorded ack, so the records are read again.
    """

    run_id: str | None
    """The run of the master's journal as the last :meth:`prepare_cut` answered it (None before one, or from a
    master without run ids): a shared-memory snapshot records it, for :meth:`restore_cursor` to name."""

    def join(self) -> str:
        """Join the job as a worker; returns the worker id. Starts the heartbeats that keep leases alive."""
        ...

    def leave(self) -> int:
        """Send queued acks, then return every lease still held; returns how many.

        Raises :class:`AckFailedError` afterwards (the worker has left) for refused queued acks.
        """
        ...

    def lease(self, dataset: str, max_shards: int = 1, wait: float = 5.0) -> tuple[LeaseStatus, Sequence[Shard]]:
        """Lease up to ``max_shards`` shards of ``dataset`` (:class:`Shard` objects), waiting up to ``wait`` s.

        :attr:`LeaseStatus.OK` with the shards; :attr:`LeaseStatus.WAIT` with none when nothing can be
        leased now (all leased, or a stream's records not there yet): ask again; :attr:`LeaseStatus.END`
        once a batch dataset is finished (every shard of every epoch acked). Joins first if needed.
        Raises :class:`NotFoundError` for an unknown dataset, :class:`FailedPreconditionError` for a
        failed one (its source was deleted...: the message says why and how to resume).
        """
        ...

    def shards(self, dataset: str, wait: float = 5.0, prefetch: int = 2) -> Iterator[Shard]:
        """Yield leased :class:`Shard` objects until a batch dataset ends (a stream's never does).

        Leases ahead (about ``prefetch`` shards, more for small shards) so a round trip serves several.
        """
        ...

    def ack(
        self,
        lease: LeaseGrant,
        position: int,
        step: int | None = None,
        dead_letters: int = 0,
        lease_more: int = 0,
        *,
        wait: bool | None = None,
    ) -> AckResult | None:
        """Ack ``position`` of ``lease`` (what :meth:`Shard.ack` sends; same semantics and errors).

        The master applies it only if this worker holds ``lease``'s attempt now (a lease past its
        deadline is expired when the ack arrives, whether or not the reaper ran). What happens to an
        ack of a lease that expired: it is refused with :class:`FailedPreconditionError` (raised
        now, or reported later when queued) and nothing changes; the shard was, or will be, leased
        again from the last position the master recorded, so the records after it are read again.
        A repeat of a position this attempt already acked answers OK, ``duplicate``, even then.
        """
        ...

    def flush(self, timeout: float | None = None) -> None:
        """Block until every ack queued so far is answered; raise :class:`AckFailedError` for refused ones.

        ``TimeoutError`` if acks are still unanswered after ``timeout`` seconds.
        """
        ...

    def take_ack_failures(self) -> list[AckFailure]:
        """Refused queued acks not yet reported, oldest first, without waiting or raising."""
        ...

    def prepare_cut(self, step: int | None = None, *, persisting: bool = False) -> tuple[int, DataCursor]:
        """Take the cut of ``step``: (cut id, its cursor), for the checkpoint of that step to store.

        The cursor is the committed cursor plus every *recorded* ack with ``step <= step`` (all acks
        when None). This worker's queued acks are flushed first (a refused one raises
        :class:`AckFailedError` and no cut is taken); other workers' acks must be recorded before
        the first rank asks (each flushes, then a barrier). Idempotent per step: every rank of one
        checkpoint gets the same cut. ``persisting``: its checkpoint goes to storage, so the cut is
        kept until it (or a newer cut) commits, however slow the persist; cuts of memory-only
        snapshots may be evicted (:class:`NotFoundError` when committed later). Sets :attr:`run_id`.
        """
        ...

    def commit_cut(self, cut_id: int) -> DataCursor:
        """Commit cut ``cut_id``: call it once the checkpoint holding its cursor is durable (manifest published).

        When is a cut committed: only by this call, made after durability; from then on its cursor is
        the committed cursor (journalled: a restarted master keeps it), the shards inside it are
        compacted away, and the source is committed upstream (consumer group,
        subscription) up to the *previous* durable checkpoint's cursor, never beyond. Returns the
        committed cursor. Committing the committed cut again only returns the committed cursor. Raises
        :class:`FailedPreconditionError` for a cut older than the committed one or one that lacks
        the committed cursor (a restore came between), :class:`NotFoundError` for a cut never
        prepared or forgotten (evicted, discarded by a restore). Does not wait for queued acks.
        """
        ...

    def get_cursor(self) -> tuple[DataCursor, DataCursor]:
        """(committed cursor, committed plus every recorded ack), after this worker's queued acks."""
        ...

    def restore_cursor(
        self,
        cursor: DataCursor,
        *,
        from_memory: bool = False,
        discard_committed: bool = False,
        snapshot_cut: int | None = None,
        snapshot_run: str | None = None,
    ) -> RestoreOutcome:
        """Reset the service to a loaded checkpoint's ``cursor``: everything outside it is read again.

        Call it after loading the model state and before leasing. Every lease (this worker's too) is
        revoked and its later acks refused; uncovered ranges are planned again as fresh shards; the
        cursor becomes the committed cursor. This worker's queued acks are dropped (they concern
        revoked leases). ``from_memory``: the cursor is of a shared-memory snapshot storage does not
        hold, so upstream commits stay at the newest durable checkpoint's; ``snapshot_cut`` and
        ``snapshot_run`` are that snapshot's cut id and the run id its cut was prepared in (:attr:`run_id`),
        and a snapshot of another run (another journal: a new run of the job on the same node) is refused
        with :class:`FailedPreconditionError`, as is one whose cut the service never prepared (``ShardClient`` raises
        its subclass :class:`~streamrover.shard_service.client.refused.SnapshotRefusedError`, also the checkpoints'
        ``streamrover.ckpt.SnapshotRefusedError``, for any refusal of a ``from_memory`` restore). An empty cursor while
        progress is committed raises :class:`FailedPreconditionError` unless ``discard_committed``;
        a cursor naming what the service lacks raises :class:`InvalidArgumentError`.
        """
        ...

    def restore_cut(self, cut_id: int) -> RestoreOutcome:
        """Reset the service to a cut it remembers (as :meth:`restore_cursor`); :class:`NotFoundError` if not."""
        ...

    def close(self) -> None:
        """Send the acks still queued (briefly), stop the client's threads, close the connection."""
        ...


__all__ = [
    "ADMIN_CALLS", "DEFAULT_LEASE_TTL", "DEFAULT_MAX_SESSIONS", "DEFAULT_RECORDS_PER_SHARD",
    "MAX_AUTO_RECORDS_PER_SHARD", "WORKER_CALLS", "AckFailedError", "AckFailure", "AckResult", "AlreadyExistsError",
    "DataLostError", "DatasetSpec", "FailedPreconditionError", "InvalidArgumentError", "LeaseGrant",
    "LeaseLostError", "LeaseStatus", "NotFoundError", "PartitionPlan", "PermissionDeniedError", "RestoreOutcome",
    "Role", "Shard", "ShardService", "ShardServiceError", "ShardState", "StaleLeaseError", "UnauthenticatedError",
    "UnavailableError", "parse_shard_id", "shard_id_for",
]
