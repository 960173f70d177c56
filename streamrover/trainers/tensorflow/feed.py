"""The chief's reader: leases shards of a dataset, reads their records, hands out numpy batches.

A thread leases shards (:class:`~streamrover.shard_service.ShardClient`), reads each one
straight from its source in batches of at most ``batch_size`` records (never spanning two
shards) and queues them, ``prefetch`` deep, as :class:`Batch` es: columns as numpy arrays plus
the shard and the position after the batch, which the trainer acks once the step that consumed
it has been fetched. A shard's tail without records (gaps in the positions) comes as a batch of
zero rows: only its position is to be acked.

:meth:`LeaseFeed.stop` ends the thread and forgets what it queued (a rollback re-reads it all
after the shard service's cursor is reset).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from streamrover.shard_service import LeasedShard, LeaseLostError, LeaseStatus, ShardClient


@dataclass
class Batch:
    """Records of one shard: ``columns`` (numpy, ``rows`` long), and the position to ack after applying them."""

    shard: LeasedShard
    end: int
    columns: dict[str, np.ndarray]
    rows: int


END = object()  # the dataset ended (a bounded dataset, every shard handed out)
IDLE = object()  # nothing to read right now (a stream caught up)


def to_numpy(records: pa.RecordBatch, columns: list[str] | None = None) -> dict[str, np.ndarray]:
    """A RecordBatch as ``{column: numpy array}``: numeric and boolean columns (``columns`` must be such)."""
    out: dict[str, np.ndarray] = {}
    for name in columns or records.schema.names:
        if name not in records.schema.names:
            raise KeyError(f"column {name!r} is not in the records (they have {records.schema.names})")
        column = records.column(name)
        kind = column.type
        if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)):
            if columns is not None:
                raise TypeError(f"column {name!r} has type {kind}, which has no tensor form; drop it from columns")
            continue
        out[name] = np.asarray(column.to_numpy(zero_copy_only=False))
    return out


class LeaseFeed:
    """Batches of ``dataset`` leased by ``client``; see the module docstring."""

    def __init__(
        self,
        client: ShardClient,
        dataset: str,
        batch_size: int,
        *,
        columns: list[str] | None = None,
        prefetch: int = 8,
        lease_wait: float = 1.0,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.client = client
        self.dataset = dataset
        self.batch_size = batch_size
        self.columns = columns
        self.lease_wait = lease_wait
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max(prefetch, 1))
        self._stop = threading.Event()
        self._errors: list[BaseException] = []
        self._thread: threading.Thread | None = None

    def start(self) -> LeaseFeed:
        """Start the feed's reading thread; returns the feed."""
        self._thread = threading.Thread(target=self._run, name=f"lease-feed-{self.dataset}", daemon=True)
        self._thread.start()
        return self

    def _reads(self) -> Iterator[object]:
        while not self._stop.is_set():
            status, leased = self.client.lease(self.dataset, 1, self.lease_wait)
            if status is LeaseStatus.END:
                yield END
                return
            if not leased:
                yield IDLE
            for shard in leased:
                try:
                    for read in shard.batches(self.batch_size):
                        rows = read.records.num_rows
                        yield Batch(shard, read.end, to_numpy(read.records, self.columns) if rows else {}, rows)
                        if self._stop.is_set():
                            return
                except LeaseLostError:  # revoked (a restore): its records go to whoever leases it next
                    continue

    def _run(self) -> None:
        try:
            for item in self._reads():
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.5)
                        break
                    except queue.Full:
                        continue
                if item is END:
                    return
        except BaseException as exc:  # raised in the trainer by get()
            self._errors.append(exc)
            self._queue.put(END)

    def get(self, timeout: float) -> object:
        """The next :class:`Batch`, or :data:`IDLE` (nothing within ``timeout``), or :data:`END`."""
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return IDLE
        if item is END and self._errors:
            raise self._errors[0]
        return item

    def stop(self) -> None:
        """Stop reading and drop everything queued (the thread ends after its current read)."""
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not None:
            self._thread.join(timeout=30)
