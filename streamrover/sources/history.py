"""History, then live: a topic's exported past (Parquet files) followed by the topic itself, as one stream.

A dataset whose options name ``sr.history`` (the files) is a *chained* dataset: its URI is the live
topic (``kafka://HOST:PORT/TOPIC``) and its history is the topic's past as Kafka Connect's S3/HDFS
sinks export it (``history_index.py``: topic/partition/offset in file names and columns). The
contract, in the order the service relies on it:

1. **One partition space, one cursor.** The chained dataset's partitions are the topic's
   (``TOPIC-N``) and its positions are the topic's offsets, whether a record is read from a file or
   from the broker. A shard, an ack and the data cursor therefore speak of offsets only, and a
   record is applied once whichever side it was read from: the seam cannot double or drop a record
   by construction, and a checkpoint mid-history or mid-live restores like any stream's.
2. **The boundary, by offsets.** Per partition, the history holds offsets ``[start, boundary)``
   (``boundary`` = its highest offset + 1) and the broker everything from ``boundary`` on. A worker
   reads ``[a, b)`` from the files below the boundary and from the broker at and past it
   (:meth:`HistorySource.read`). A partition the history does not hold starts live at the topic's
   earliest offset.
3. **Checked at registration.** Refused, naming the partition and the offsets: history files that
   overlap, or leave offsets out between them (unless ``sr.history.gaps=allow``: compaction,
   transaction markers); a history that starts after the topic's earliest retained offset (the
   offsets between would be skipped) or ends before it (the offsets between are in neither: deleted
   by retention, never exported); a history holding offsets the topic never produced (another
   topic's export, or a topic re-created since); partitions the topic lacks.
4. **History first.** Each partition reports its boundary as :attr:`Partition.hold`: the master plans
   no live shard until every position of every partition below its hold is acked, so the model
   learns the past before the present (``streams.py``).
   **Epochs and shuffle apply to the history only.** With the dataset's ``epochs`` E > 1, the history
   is trained E times: epochs 0 .. E-2 as partitions of their own, ``epoch{k}/TOPIC-N`` (the history's
   offsets, read from the files), each a stage (:attr:`Partition.stage`) planned once every earlier one
   is acked; the last epoch is the topic's partition itself, which goes on live once it is acked. Its
   ``shuffle`` shuffles each epoch's shards (the master, ``streams.py``); live shards keep their order.
   The cursor stays one cursor of epoch 0: an epoch of the history is a partition in it.
5. **Retention.** Positions below the boundary never need the broker: :attr:`Partition.earliest` is
   the history's start as long as the broker still holds the boundary; once retention passes the
   boundary, the broker's earliest is reported and what was deleted there is lost as for any stream.

When the files carry no offsets, the boundary is an instant instead (``sr.history.boundary=timestamp:T``):
``history_time.py`` states how records at ``T`` are handled so that none is trained twice or skipped.

Options (besides the live source's own, passed through): ``sr.history`` (a directory, glob or file;
any fsspec URL), ``sr.history.offset_column`` (default ``offset``), ``sr.history.partition_column``
(default ``partition``; without it the file name says the partition), ``sr.history.gaps``
(``refuse``, the default, or ``allow``), ``sr.history.boundary`` (``offsets``, the default, or
``timestamp:MILLIS``), ``sr.history.timestamp_column`` (default ``timestamp``: by time). The live
part's ``sr.start`` is refused: the history says where each partition starts.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Literal

import pyarrow as pa
from pydantic import Field

from streamrover.sources.api import (
    Partition,
    ReadBatch,
    Source,
    SourceError,
    SourceKind,
    open_source,
    register_chain,
)
from streamrover.sources.history_index import HistoryError, HistoryIndex, HistoryReader, build_index
from streamrover.sources.history_time import TimeChain
from streamrover.sources.options import PREFIX, OptionError, _Options

#: Options whose names start with this belong to the chain (the others to the live source).
HISTORY_PREFIX = "sr.history"
#: The partitions of the history's earlier epochs: ``epoch{k}/`` and the partition's id.
EPOCH_PREFIX = "epoch"
EPOCH_ID = re.compile(rf"^{EPOCH_PREFIX}[0-9]+/")  # (a topic's name has no "/")


class HistoryOptions(_Options):
    """The chain's own options (``sr.history*``)."""

    files: str = Field(alias="sr.history", min_length=1, description="the exported files: a directory, glob or file")
    offset_column: str = Field("offset", alias="sr.history.offset_column", description="a column name")
    partition_column: str = Field("partition", alias="sr.history.partition_column", description="a column name")
    gaps: Literal["refuse", "allow"] = Field(
        "refuse", alias="sr.history.gaps", description="refuse or allow (offsets missing between history files)"
    )
    boundary: str = Field(
        "offsets",
        alias="sr.history.boundary",
        pattern=r"^(offsets|timestamp:[0-9]+)$",
        description="offsets (the files carry them) or timestamp:MILLIS (they carry only time: history_time.py)",
    )
    timestamp_column: str = Field("timestamp", alias="sr.history.timestamp_column", description="a column name")
    epochs: int = Field(
        1, ge=1, alias="sr.history.epochs", description="an integer >= 1 (set from the dataset's epochs by the master)"
    )


class HistorySource(Source):
    """A topic's exported history followed by the topic (contract in the module docstring)."""

    kind = SourceKind.STREAM
    dense_positions = False

    def __init__(self, uri: str, format: str = "", options: Mapping[str, str] | None = None) -> None:
        opts = dict(options or {})
        ours = {k: v for k, v in opts.items() if k.startswith(HISTORY_PREFIX)}
        live = {k: v for k, v in opts.items() if not k.startswith(HISTORY_PREFIX)}
        self.options = HistoryOptions.parse(ours, "history")
        if f"{PREFIX}start" in live:
            raise OptionError(
                f"sr.start={live[f'{PREFIX}start']!r} cannot be combined with sr.history: the history says where "
                "each partition starts (drop sr.start)"
            )
        if not uri.startswith("kafka://"):
            raise SourceError(f"sr.history joins a history to a Kafka topic by offsets; {uri!r} is not a kafka:// URI")
        self.uri = uri
        by_time = self.options.boundary.startswith("timestamp:")
        if by_time:
            live[f"{PREFIX}start"] = self.options.boundary  # the topic from offsets_for_times(T)
        self.live = open_source(uri, format, live)
        if self.live.kind is not SourceKind.STREAM:
            raise SourceError(f"sr.history needs a stream to go on with; {uri!r} is a batch source")
        self.topic = uri.rstrip("/").rsplit("/", 1)[-1]
        self._index: HistoryIndex | None = None
        self._reader: HistoryReader | None = None
        self.by_time: TimeChain | None = None
        if by_time:
            instant = int(self.options.boundary.split(":", 1)[1])
            self.live.not_before = instant  # type: ignore[attr-defined]  # a KafkaSource (checked above)
            self.by_time = TimeChain(self.options.files, self.options.timestamp_column, instant, self.live)

    def _epochs(self, chained: list[Partition]) -> list[Partition]:
        """``chained`` (the last epoch and live) preceded by the history's earlier epochs, one stage each."""
        last = self.options.epochs - 1
        history = [p for p in chained if p.hold is not None and p.hold > p.start]
        earlier = [
            Partition(f"{EPOCH_PREFIX}{k}/{p.id}", p.start, p.hold, hold=p.hold, stage=k)
            for k in range(last)
            for p in history
            if p.hold is not None
        ]
        return earlier + [replace(p, stage=last) if p.hold is not None else p for p in chained]

    # -- the history ----------------------------------------------------------
    def index(self) -> HistoryIndex:
        """The history's index, built on first use (the files' offsets are read then)."""
        if self._index is None:
            o = self.options
            self._index = build_index(o.files, self.topic, o.offset_column, o.partition_column, o.gaps == "allow")
        return self._index

    def _number(self, partition_id: str) -> int:
        name, _, num = partition_id.rpartition("-")
        if name != self.topic or not num.isdigit():
            raise SourceError(f"partition {partition_id!r} is not a partition of topic {self.topic!r}")
        return int(num)

    def _chain(self, live: list[Partition], check: bool) -> list[Partition]:
        """The live partitions with the history in front (``check``: refuse a history that does not fit)."""
        index = self.index()
        numbers = {self._number(p.id) for p in live}
        foreign = sorted(set(index.pieces) - numbers)
        if check and foreign:
            raise HistoryError(
                f"the history holds partition(s) {', '.join(f'{self.topic}-{n}' for n in foreign)} that topic "
                f"{self.topic!r} does not have (it has {len(numbers)}): is it an export of this topic?"
            )
        out = []
        for p in live:
            n = self._number(p.id)
            earliest = p.earliest if p.earliest is not None else p.start
            start, boundary = index.start(n), index.boundary(n)
            if start is None or boundary is None:  # no history: live from the broker's earliest
                out.append(Partition(p.id, earliest, p.end, earliest=earliest, hold=earliest))
                continue
            if check:
                _check_fit(p.id, start, boundary, earliest, p.end)
            reachable = start if earliest <= boundary else earliest  # retention past the boundary: a real loss
            out.append(Partition(p.id, start, max(p.end, boundary), earliest=reachable, hold=boundary))
        return out

    # -- master side ------------------------------------------------------------
    def partitions(self) -> list[Partition]:
        if self.by_time is not None:
            return self._epochs(self.by_time.partitions())
        return self._epochs(self._chain(self.live.poll(), check=True))

    def poll(self) -> list[Partition]:
        if self.by_time is not None:
            return self._epochs(self.by_time.poll())
        return self._epochs(self._chain(self.live.poll(), check=False))

    def schema(self) -> pa.Schema:
        return self.live.schema()

    def commit(self, positions: Mapping[str, int]) -> None:
        positions = {k: v for k, v in positions.items() if not EPOCH_ID.match(k)}
        if self.by_time is not None:
            self.by_time.commit(positions)
        else:
            self.live.commit(positions)

    # -- worker side ------------------------------------------------------------
    def read(self, partition: Partition, start: int, end: int, batch_size: int) -> Iterator[ReadBatch]:
        earlier = EPOCH_ID.match(partition.id)
        if earlier:  # an earlier epoch of the history: the same records
            partition = replace(partition, id=partition.id[earlier.end() :])
        if self.by_time is not None:
            yield from self.by_time.read(partition, start, end, batch_size)
            return
        n = self._number(partition.id)
        index = self.index()
        boundary = index.boundary(n)
        if boundary is not None and start < boundary:
            if self._reader is None:
                self._reader = HistoryReader(self.options.files, index, self.schema())
            upto = min(end, boundary)
            for records, positions, a, b in self._reader.read(n, start, upto, batch_size):
                yield ReadBatch(records, a, b, positions)
            start = upto
        if start < end:
            yield from self.live.read(partition, start, end, batch_size)

    def close(self) -> None:
        if self.by_time is not None:
            self.by_time.close()
        self.live.close()
        self._reader = None


def _check_fit(pid: str, start: int, boundary: int, earliest: int, end: int) -> None:
    """Refuse a history ``[start, boundary)`` of partition ``pid`` that does not meet the topic's
    ``[earliest, end)``."""
    if boundary > end:
        raise HistoryError(
            f"history of {pid} holds offsets [{max(start, end)}, {boundary}) that the topic has not produced (its "
            f"end offset is {end}): is it an export of this topic, or was the topic re-created since?"
        )
    if start > earliest:
        raise HistoryError(
            f"history of {pid} starts at offset {start} but the topic holds offsets from {earliest}: offsets "
            f"[{earliest}, {start}) would be skipped; export them too"
        )
    if boundary < earliest:
        raise HistoryError(
            f"history of {pid} ends at offset {boundary} but the topic's earliest offset is {earliest}: offsets "
            f"[{boundary}, {earliest}) are in neither (deleted by retention before they were exported)"
        )


def _factory(uri: str, format: str, options: Mapping[str, str]) -> Source:
    return HistorySource(uri, format, options)


register_chain(_factory)
