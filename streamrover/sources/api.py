"""The source contract: what the shard service plans from and what workers read.

A :class:`Source` is opened from a dataset's URI and options, both on the master
(to list partitions and their position ranges) and on workers (to read a shard's
positions). Sources say what their positions are; nothing above this package
assumes positions are dense.

Backends register a factory with :func:`register_source`; :func:`open_source`
picks one by URI scheme or file format. Broker clients are imported lazily by
their backends, never here.
"""

from __future__ import annotations

import enum
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

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
        return int(self.records.num_rows)


class Source(ABC):
    """A partitioned, replayable input. Instances are cheap to create; heavy I/O is lazy."""

    kind: SourceKind = SourceKind.BATCH
    #: True when every integer position in a partition's [start, end) holds exactly one record.
    #: A sparse source (False) says where its records are with :attr:`Partition.segments`; one that
    #: reports none (Kafka: its gaps are rare and small) is counted as if dense, an upper bound.
    dense_positions: bool = True

    @abstractmethod
    def partitions(self) -> list[Partition]:
        """The partitions, in a stable order; for streams, with their current end positions."""

    @abstractmethod
    def schema(self) -> pa.Schema:
        """The Arrow schema of the records."""

    @abstractmethod
    def read(self, partition: Partition, start: int, end: int, batch_size: int) -> Iterator[ReadBatch]:
        """Yield the records at positions ``[start, end)`` of ``partition``, at most ``batch_size`` per batch.

        Must be deterministic: reading the same range again yields the same
        records (this is what makes a shard replayable).
        """

    def poll(self) -> list[Partition]:
        """The partitions now, with their current end positions (new partitions included).

        Called by the master's planner for stream sources. A partition's ``start``
        is used only when it first appears (for partitions added while the job
        runs: their first position). Raises :class:`SourceUnavailableError` when
        the source cannot be reached and :class:`SourceGoneError` when it was deleted.
        """
        return self.partitions()

    def commit(self, positions: Mapping[str, int]) -> None:  # noqa: B027 - optional hook
        """Record, in the source system, that each partition is consumed up to a position (exclusive).

        Called after a checkpoint's cut is committed, for lag monitoring and
        retention; never the source of truth (that is the checkpoint's cursor).
        """

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and caches."""


SourceFactory = Callable[[str, str, Mapping[str, str]], Source]
"""Called as ``factory(uri, format, options)``."""

_SCHEMES: dict[str, SourceFactory] = {}
_FORMATS: dict[str, SourceFactory] = {}
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


def register_source(factory: SourceFactory, *, schemes: tuple[str, ...] = (), formats: tuple[str, ...] = ()) -> None:
    """Make ``factory`` open URIs with one of ``schemes`` (``kafka``) or files of one of ``formats``."""
    for scheme in schemes:
        _SCHEMES[scheme] = factory
    for fmt in formats:
        _FORMATS[fmt] = factory


def open_source(uri: str, format: str = "", options: Mapping[str, str] | None = None) -> Source:
    """Open the source a dataset names. Raises :class:`SourceError` with the reason when it cannot."""
    opts = dict(options or {})
    scheme = uri.split("://", 1)[0] if "://" in uri else ""
    _load_builtin_backends(scheme)
    factory = _SCHEMES.get(scheme)
    if factory is None:
        factory = _FORMATS.get(format) if format else _FORMATS.get("files")
    if factory is None:
        known = sorted(set(_SCHEMES) | set(_FORMATS))
        raise SourceError(f"no source handles uri {uri!r} with format {format!r}; known: {', '.join(known)}")
    return factory(uri, format, opts)


def validate_dataset_name(name: str) -> None:
    if not _NAME_RE.match(name):
        raise SourceError(f"dataset name {name!r} must be 1-128 characters of letters, digits, '_', '.', '-'")


_BUILTIN_SCHEMES = {
    "kafka": "streamrover.sources.kafka",
    "pulsar": "streamrover.sources.pulsar",
    "rocketmq": "streamrover.sources.rocketmq",
    "staged": "streamrover.sources.staged",
}


def _load_builtin_backends(scheme: str = "") -> None:
    """Import the backend for ``scheme`` (and the file source) on first use; broker clients stay unimported."""
    import importlib

    module = _BUILTIN_SCHEMES.get(scheme)
    if module is not None and scheme not in _SCHEMES:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            hint = f"pip install 'streamrover[{scheme}]'"
            raise SourceError(f"{scheme}:// needs the {scheme!r} extra: {hint} ({exc})") from exc
    if "files" not in _FORMATS:
        from streamrover.sources import files  # noqa: F401  (registers itself)
