"""The source contract: what the shard service plans from and what workers read.

A source is opened from a dataset's URI and options (:func:`open_source`) on both sides of
a job, and each side calls its own half of the contract:

- the **master** (:class:`MasterSource`): :meth:`~MasterSource.partitions` and
  :meth:`~MasterSource.schema` when the dataset is registered, :meth:`~MasterSource.poll`
  to plan a stream's shards as records arrive, :meth:`~MasterSource.commit` after a
  checkpoint's cut is committed;
- a **worker** (:class:`WorkerSource`): :meth:`~WorkerSource.read` of a leased shard's positions.

A backend is one class implementing both (:class:`Source`); instances are cheap and do
their I/O lazily, so a worker that only reads never lists partitions.

**Positions.** A position is an ``int`` naming where a record sits in its partition; positions
only grow along a partition and a range ``[start, end)`` is half-open. Nothing above this
package assumes positions are dense:

- A *dense* source (``dense_positions = True``: files, RocketMQ) holds exactly one record at
  every position of ``[Partition.start, Partition.end)``.
- A *sparse* source holds at most one record per position, or a group of records that share
  one position and are never split (a Pulsar batched entry). Where it can, it says where its
  records lie with :attr:`Partition.segments` (runs ``[a, b)`` holding one record per position;
  positions outside every run hold none: a Pulsar ledger rollover). One that reports no runs
  (Kafka: gaps from compaction and transaction markers are rare and small) is counted as if
  dense, an upper bound. Runs only *count* records (shard sizes, lag, status,
  ``sources/positions.py``); they never bound what a shard covers: a shard reads every
  position of its range, so a run the master never learned costs count accuracy, never a record.
- A read batch's :attr:`ReadBatch.end` is the position of the *next* read of the partition
  (one past the last record's position, or the shard's end when the shard is done): acking it
  says every record before it in the shard is applied. Ack and cursor granularity is the
  position: a batch, a shard boundary and an ack never split the records of one position.
- Reading a range again yields the same records: a shard is replayable, which is what lets
  a restore re-read everything after a checkpoint's cursor.

Errors: every failure is a :class:`SourceError`; its subclasses say what the caller should do
(retry, fail the dataset, fix the input). Backends plug in with :func:`register_source`; the
built-in ones, listed in :mod:`streamrover.sources.registry`, are imported on first use, so
broker clients are never imported here.
"""

from __future__ import annotations

import enum
import importlib
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from streamrover.sources.registry import BUILTIN_SCHEMES, FILES_MODULE, HISTORY_MODULE, HISTORY_OPTION

if TYPE_CHECKING:  # pragma: no cover
    import pyarrow as pa


class SourceError(Exception):
    """A dataset's source cannot be used; the message says which input and why."""


class SourceNotFoundError(SourceError):
    """The URI names nothing that exists (no file, no topic)."""


class SourceUnreadableError(SourceError):
    """Something exists but cannot be read (permissions, corrupt file, bad format)."""


class SourceSchemaError(SourceError):
    """The partitions of one dataset do not share one schema."""


class SourceGoneError(SourceError):
    """What the dataset reads was deleted (a topic, a bucket): the dataset cannot go on."""


class SourceDataLostError(SourceError):
    """Records a read needs were deleted upstream (retention, ``delete_records``): they cannot be read again."""


class SourceUnavailableError(SourceError):
    """The source cannot be reached now (broker down or restarting): retry with backoff."""


class SourceKind(enum.Enum):
    """Whether a source is bounded (batch) or unbounded (stream)."""
    BATCH = "batch"  # bounded: partitions and their ends are fixed when the dataset is registered
    STREAM = "stream"  # unbounded: end positions keep moving, partitions may be added


@dataclass(frozen=True)
class Partition:
    """One independently ordered log of a source.

    ``start`` is the first position of the partition, ``end`` the position after
    the last record known now (exclusive). For batch sources both are fixed; for
    stream sources ``end`` is the end offset at the time of the poll.
    """

    id: str
    start: int
    end: int
    #: Where a sparse partition's records lie (None: dense, one record per position): sorted, disjoint
    #: runs ``(a, b)`` below ``end``, each holding one record per position; positions outside every run
    #: hold none (a Pulsar ledger's entries are a run; a ledger rollover is the gap to the next run).
    #: The master keeps the union of the runs a partition ever reported (a source may report only those
    #: it knows now) and counts records by them: shard sizes, the re-plan after a restore, lag, counts
    #: and rates (sources/positions.py). Runs never bound what a shard covers, so a run the source
    #: missed costs count accuracy, never a record.
    segments: tuple[tuple[int, int], ...] | None = None
    #: Stream sources that can say so: the first position the source still holds (records before it were
    #: deleted upstream: retention, ``delete_records``). None: the source does not say.
    earliest: int | None = None
    #: A chained stream (history, then live: ``sources/history.py``): the first live position. The master
    #: plans no position at or past it until every position below every partition's hold is acked, so
    #: the history is learned before the live part. None: no hold.
    hold: int | None = None
    #: With ``hold``: the stage the positions below it belong to (those at or past it are in ``stage + 1``).
    #: The master plans a stage only once every position of the earlier stages is acked: a chained stream's
    #: history trained for several epochs is one stage per epoch (``sources/history.py``), then live.
    stage: int = 0


@dataclass(frozen=True)
class ReadBatch:
    """Records read from one partition, in position order.

    ``start`` is the position of the first record. ``end`` is the position
    after the last record: acknowledging ``end`` says every record of this batch
    (and everything before it in the shard) is applied. For dense sources the
    record at index ``i`` has position ``start + i``; sparse sources set
    ``positions`` (one per record).
    """

    records: pa.RecordBatch
    start: int
    end: int
    positions: pa.Array | None = None
    dead_letters: int = 0  # records in [start, end) that failed to decode and went to the dead-letter dataset

    @property
    def num_records(self) -> int:
        """How many records the batch holds (positions may hold none or several)."""
        return int(self.records.num_rows)


class MasterSource(ABC):
    """What the master calls: partitions and schema at registration, polls of a stream's ends, commits.

    Called from the master's threads one at a time per source object (the poller owns its own).
    """

    kind: SourceKind = SourceKind.BATCH
    #: True when every integer position in a partition's [start, end) holds exactly one record.
    #: A sparse source (False) says where its records are with :attr:`Partition.segments`; one that
    #: reports none (Kafka: its gaps are rare and small) is counted as if dense, an upper bound.
    dense_positions: bool = True

    @abstractmethod
    def partitions(self) -> list[Partition]:
        """The partitions, in a stable order; for streams, with their current end positions.

        Raises :class:`SourceNotFoundError` when the URI names nothing, :class:`SourceUnreadableError`
        when it cannot be read, :class:`SourceUnavailableError` when the source cannot be reached now.
        """

    @abstractmethod
    def schema(self) -> pa.Schema:
        """The Arrow schema of the records (the same for every partition: :class:`SourceSchemaError` if not)."""

    def poll(self) -> list[Partition]:
        """The partitions now, with their current end positions (new partitions included).

        Called by the master's planner for stream sources. A partition's ``start``
        is used only when it first appears (for partitions added while the job
        runs: their first position). Raises :class:`SourceUnavailableError` when
        the source cannot be reached and :class:`SourceGoneError` when it was deleted.
        """
        return self.partitions()

    #: True when :meth:`first_times` reads the broker's record timestamps (then the master leases a new shard only
    #: once it has its time: stream-time order across partitions); False: a shard's time is when it was planned.
    record_times: bool = False

    def first_times(self, shards: Sequence[tuple[str, int, int]]) -> list[float | None]:
        """For each ``(partition id, start, end)``: the time, in ms since the epoch, of the first record in
        ``[start, end)`` as the broker stamped it (None where it does not say, or the range holds no record).

        Called by the master's poller for the shards it planned, when :attr:`record_times`; one small read per
        shard. Raises :class:`SourceUnavailableError` when the source cannot be reached.
        """
        return [None] * len(shards)

    def commit(self, positions: Mapping[str, int]) -> None:  # noqa: B027 - optional hook
        """Record, in the source system, that each partition is consumed up to a position (exclusive).

        Called after a checkpoint's cut is committed, for lag monitoring and
        retention; never the source of truth (that is the checkpoint's cursor).
        """

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and caches."""


class WorkerSource(ABC):
    """What a worker calls: reads of a leased shard's positions."""

    @abstractmethod
    def read(self, partition: Partition, start: int, end: int, batch_size: int) -> Iterator[ReadBatch]:
        """Yield the records at positions ``[start, end)`` of ``partition``, at most ``batch_size`` per batch.

        Must be deterministic: reading the same range again yields the same records (this is
        what makes a shard replayable). Batches come in position order, each ending at or
        before ``end``; the last may end short of ``end`` when no record lies in the range's
        tail (the worker's :class:`~streamrover.shard_service.LeasedShard` then acks ``end``
        itself). A sparse source may exceed ``batch_size`` by the rest of the records of one
        position. Blocks while the records are fetched; raises :class:`SourceUnavailableError`
        when the source stays unreachable past the backend's read timeout, and, where the
        backend can tell, :class:`SourceDataLostError` when records of the range were deleted
        upstream (Kafka).
        """

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and caches."""


class Source(MasterSource, WorkerSource):
    """A partitioned, replayable input: both halves of the contract in one backend class."""


SourceFactory = Callable[[str, str, Mapping[str, str]], Source]
"""Called as ``factory(uri, format, options)``."""

_SCHEMES: dict[str, SourceFactory] = {}
_FORMATS: dict[str, SourceFactory] = {}
_CHAIN: list[SourceFactory] = []  # what opens a dataset with a history (sources/history.py), once imported
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


def register_source(factory: SourceFactory, *, schemes: tuple[str, ...] = (), formats: tuple[str, ...] = ()) -> None:
    """Make ``factory`` open URIs with one of ``schemes`` (``kafka``) or files of one of ``formats``.

    A later registration of the same scheme or format replaces the earlier one.
    """
    for scheme in schemes:
        _SCHEMES[scheme] = factory
    for fmt in formats:
        _FORMATS[fmt] = factory


def register_chain(factory: SourceFactory) -> None:
    """Make ``factory`` open the datasets whose options name a history (``sr.history``: sources/history.py)."""
    _CHAIN[:] = [factory]


def open_source(uri: str, format: str = "", options: Mapping[str, str] | None = None, epochs: int = 1) -> Source:
    """Open the source a dataset names. Raises :class:`SourceError` with the reason when it cannot.

    ``epochs``: the dataset's (its spec's); a chained dataset trains its history that many times.
    """
    opts = dict(options or {})
    if HISTORY_OPTION in opts:  # a chained dataset: the history's files, then the live source (sources/history.py)
        if epochs > 1:
            opts[f"{HISTORY_OPTION}.epochs"] = str(epochs)
        if not _CHAIN:
            importlib.import_module(HISTORY_MODULE)
        return _CHAIN[0](uri, format, opts)
    scheme = uri.split("://", 1)[0] if "://" in uri else ""
    load_builtin_backends(scheme)
    factory = _SCHEMES.get(scheme)
    if factory is None:
        factory = _FORMATS.get(format) if format else _FORMATS.get("files")
    if factory is None:
        known = sorted(set(_SCHEMES) | set(_FORMATS))
        raise SourceError(f"no source handles uri {uri!r} with format {format!r}; known: {', '.join(known)}")
    return factory(uri, format, opts)


def load_builtin_backends(scheme: str = "") -> None:
    """Import the built-in backend for ``scheme`` (and the file source) unless registered already.

    Raises :class:`SourceError` naming the extra to install when the backend's client library is missing.
    """
    module = BUILTIN_SCHEMES.get(scheme)
    if module is not None and not is_registered(scheme=scheme):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            hint = f"pip install 'streamrover[{scheme}]'"
            raise SourceError(f"{scheme}:// needs the {scheme!r} extra: {hint} ({exc})") from exc
    if not is_registered(format="files"):
        importlib.import_module(FILES_MODULE)


def is_registered(*, scheme: str = "", format: str = "") -> bool:
    """Whether a backend is registered for URI ``scheme`` (or, given ``format``, for that file format)."""
    return scheme in _SCHEMES if scheme else format in _FORMATS


def validate_dataset_name(name: str) -> None:
    """Raise :class:`SourceError` unless ``name`` is 1-128 letters, digits, ``_``, ``.`` or ``-``."""
    if not _NAME_RE.match(name):
        raise SourceError(f"dataset name {name!r} must be 1-128 characters of letters, digits, '_', '.', '-'")
