"""``StreamDataset``: a torch IterableDataset over leased shards, acked after the optimizer step that used them.

Each rank leases its own shards from the shard service, reads them straight from the
source (Kafka, files...), and yields *collated* batches: a ``dict`` of column name to
tensor (Arrow → numpy → torch), at most ``batch_size`` rows, never spanning two shards.
Use it with ``DataLoader(dataset, batch_size=None)``.

Positions are tracked per yielded batch. :meth:`StreamDataset.step_done` (called after
``optimizer.step()``; :class:`~streamrover.trainers.torch.session.StreamSession` does it)
acks, with that step number, everything yielded since the previous call. The acks are
queued (sent by the client's background sender, off the training step); the session
flushes them on every rank before the barrier of a checkpoint cut. So a checkpoint cut at
step S (all acks with step <= S) holds exactly the records whose gradients are in the model
at step S.

Leases revoked under a batch (a restore, or this worker declared dead) stop its shard:
:class:`~streamrover.shard_service.LeaseLostError` on read drops the shard and leases
another. If records of the revoked lease were already applied and not yet acked, the model
now holds records the service will hand out again; :meth:`step_done` then raises
:class:`StreamStateLostError` and the worker must restart from the last checkpoint
(under ``dlrover-run`` exiting does exactly that).

**DataLoader worker processes.** Leasing, reading and acking stay in the process that
trains: ``num_workers`` must be 0 (the default). With ``num_workers > 0`` each loader
process would lease shards that the trainer could not ack (acks must follow the optimizer
step, in the trainer) and whose positions the checkpoint cut would not see, so
:meth:`__iter__` raises ``RuntimeError`` inside a loader worker. Reading overlaps
training through ``prefetch`` batches read ahead by a thread of the trainer instead.

**Synchronous data parallelism.** Every rank must take part in every step, and a stream gives
ranks uneven inputs (a rank may have nothing to lease for a while, then get records again).
Before each batch the ranks all-reduce what they have (:mod:`~streamrover.trainers.torch.lockstep`,
one small collective): when any rank has records, every rank steps at once, a rank without records
with an *empty* batch (zero rows, same columns), so it shadows the step's collectives and nobody waits
for it. When no rank has records the ranks wait together; with ``idle_timeout`` set they step with
empty batches once a rank has waited that long (so a loop can still check, checkpoint or stop on an idle
stream, and keeps stepping with empty batches once every rank's bounded dataset ended); without it they
wait for records, and the loop ends on every rank at the same step when every rank's dataset ended.
So under ``torch.distributed`` every rank iterates each dataset, one batch per step (a dataset read on
one rank alone would wait for the others in that all-reduce).
:attr:`ended` tells whether this rank has seen the end of a bounded dataset. A
:class:`~streamrover.trainers.torch.session.StreamSession` weighs each rank's gradient by its share of
the step's records (:attr:`step_rows` of :attr:`step_total`), so an empty batch changes no update.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import IterableDataset, get_worker_info

from streamrover.shard_service import LeasedShard, LeaseLostError, LeaseStatus, ShardClient
from streamrover.sources.api import open_source
from streamrover.trainers.torch.lockstep import StepSync


class StreamStateLostError(LeaseLostError):
    """Records applied to the model can no longer be acked: restart from the last checkpoint."""


@dataclass
class _Read:
    shard: LeasedShard | None
    end: int
    batch: dict[str, torch.Tensor] | None  # None: a position-only read (an empty tail of a shard)


def _rows(batch: dict[str, torch.Tensor] | None) -> int:
    return len(next(iter(batch.values()))) if batch else 0


def to_tensors(records: pa.RecordBatch, columns: list[str] | None = None) -> dict[str, torch.Tensor]:
    """A RecordBatch as ``{column: tensor}`` (numeric and boolean columns; others are skipped)."""
    out: dict[str, torch.Tensor] = {}
    for name in columns or records.schema.names:
        column = records.column(name)
        kind = column.type
        if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)):
            if columns is not None:
                raise TypeError(f"column {name!r} has type {kind}, which has no tensor form; drop it from columns")
            continue
        array = column.to_numpy(zero_copy_only=False)
        out[name] = torch.from_numpy(np.array(array, copy=True))
    return out


class StreamDataset(IterableDataset):
    """Batches of ``dataset`` leased for this rank; see the module docstring for the contract."""

    def __init__(
        self,
        client: ShardClient,
        dataset: str,
        batch_size: int = 256,
        *,
        columns: list[str] | None = None,
        idle_timeout: float | None = None,
        prefetch: int = 2,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.client = client
        self.dataset = dataset
        self.batch_size = batch_size
        self.columns = columns
        self.idle_timeout = idle_timeout
        self.prefetch = max(prefetch, 1)
        self.ended = False
        self.records_yielded = 0
        self.step_batches = 0  # batches yielded since the last step_done (read by the session's GradWeighting)
        self.step_rows = 0  # this rank's records in them
        self.step_total = 0  # all ranks' records in them
        self._pending: dict[str, tuple[LeasedShard, int]] = {}  # yielded, not acked: shard id -> (shard, end)
        self._lock = threading.Lock()
        self._empty: dict[str, torch.Tensor] | None = None
        self.on_round: Callable[[], None] | None = None  # called after each lockstep round (the session's mark)

    # -- reading -------------------------------------------------------------------------
    def _reads(self, stop: threading.Event) -> Iterator[_Read]:
        """Lease and read shards until the dataset ends (a stream never does)."""
        wait = min(self.idle_timeout, 1.0) if self.idle_timeout is not None else 5.0
        while not stop.is_set():
            status, leased = self.client.lease(self.dataset, 1, wait)
            if status is LeaseStatus.END:
                self.ended = True
                return
            for shard in leased:
                try:
                    for read in shard.batches(self.batch_size):
                        if stop.is_set():
                            return
                        rows = read.records.num_rows
                        yield _Read(shard, read.end, to_tensors(read.records, self.columns) if rows else None)
                except LeaseLostError:  # revoked: its unread records go to whoever leases it next
                    continue
            if not leased:
                yield _Read(None, 0, None)  # nothing to lease right now: let the consumer count idle time

    def _producer(self, out: queue.Queue[_Read | None], stop: threading.Event, errors: list[BaseException]) -> None:
        try:
            for item in self._reads(stop):
                while not stop.is_set():
                    try:
                        out.put(item, timeout=0.5)
                        break
                    except queue.Full:
                        continue
        except BaseException as exc:  # handed to the consumer, which raises it in the trainer
            errors.append(exc)
        finally:
            out.put(None)

    def _empty_batch(self) -> dict[str, torch.Tensor]:
        if self._empty is None:
            spec = self.client.describe_dataset(self.dataset).spec
            source = open_source(spec.uri, spec.format, dict(spec.options))
            try:
                empty = pa.RecordBatch.from_pylist([], schema=source.schema())
            finally:
                source.close()
            self._empty = to_tensors(empty, self.columns)
        return {k: v.clone() for k, v in self._empty.items()}

    def _take(self, out: queue.Queue[_Read | None], wait: float | None, errors: list[BaseException]) -> tuple[
        dict[str, torch.Tensor] | None, bool
    ]:
        """The next batch read for this rank within ``wait`` seconds (None: no limit), and whether reading ended.

        Shards read up to a position without records (an empty tail) are noted for the next ack on the way.
        """
        end = None if wait is None else time.monotonic() + wait
        while True:
            left = None if end is None else end - time.monotonic()
            try:
                item = out.get_nowait() if left is not None and left <= 0 else out.get(timeout=left)
            except queue.Empty:
                return None, False
            if item is None:
                if errors:
                    raise errors[0]
                return None, True
            if item.shard is not None:
                with self._lock:
                    self._pending[item.shard.shard_id] = (item.shard, item.end)
            if item.batch is not None:
                return item.batch, False

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if get_worker_info() is not None:
            raise RuntimeError(
                "StreamDataset must be iterated in the training process (DataLoader num_workers=0): acks follow "
                "the optimizer step and checkpoint cuts need this rank's positions; it reads ahead in a thread"
            )
        out: queue.Queue[_Read | None] = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        errors: list[BaseException] = []
        thread = threading.Thread(target=self._producer, args=(out, stop, errors), name="stream-read", daemon=True)
        thread.start()
        sync = StepSync(self.on_round)  # every rank goes through the rounds below in lockstep (lockstep.py)
        idle_since = time.monotonic()
        ready: dict[str, torch.Tensor] | None = None
        finished = False
        quiet = 0  # rounds in a row in which no rank had records
        try:
            while True:
                if ready is None and not finished:
                    idle_left = None if self.idle_timeout is None else idle_since + self.idle_timeout - time.monotonic()
                    ready, finished = self._take(out, sync.poll(quiet, idle_left), errors)
                rows = _rows(ready)
                expired = self.idle_timeout is not None and time.monotonic() - idle_since >= self.idle_timeout
                total, ended, expired_ranks = sync.reduce(rows, finished, expired)
                all_ended = ended == sync.world
                if total == 0 and all_ended and self.idle_timeout is None:
                    return  # every rank's dataset ended: the loop ends on every rank at the same step
                if total == 0 and not all_ended and not expired_ranks:
                    quiet += 1
                    continue
                batch = ready if ready is not None else self._empty_batch()
                ready, quiet = None, 0
                self.step_batches += 1
                self.step_rows += rows
                self.step_total += total
                self.records_yielded += rows
                yield batch
                idle_since = time.monotonic()  # idle time counts from the next batch asked for, not the step's
        finally:
            stop.set()

    # -- acking --------------------------------------------------------------------------
    def step_done(self, step: int) -> int:
        """Ack, with ``step``, every record yielded so far; returns how many shards were acked.

        Call after the optimizer step that applied them. Raises :class:`StreamStateLostError`
        if a lease was lost under records already applied.
        """
        self.step_batches = self.step_rows = self.step_total = 0
        with self._lock:
            pending, self._pending = self._pending, {}
        for shard, end in pending.values():
            try:
                shard.ack(end, step=step, wait=False)  # queued: the session flushes before its checkpoint barrier
            except LeaseLostError as exc:
                raise StreamStateLostError(
                    f"shard {shard.shard_id}: records up to {end} were applied at step {step} but the lease is gone "
                    f"({exc}); restart from the last checkpoint"
                ) from exc
        return len(pending)

    def state(self) -> dict[str, Any]:
        """Positions yielded but not yet acked, per shard (for logs; cuts come from acks)."""
        with self._lock:
            return {sid: end for sid, (_, end) in self._pending.items()}
