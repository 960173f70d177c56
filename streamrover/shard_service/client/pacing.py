"""How far ahead a worker leases: the prefetch depth of each :meth:`ShardClient.shards` reader, by measured pace.

A reader that gets through shards quickly wants more of them waiting, so that one round trip
serves several shards; a slow one wants few, so that shards stay with whoever is ready for
them. :class:`PrefetchPace` is one reader's depth; :class:`Pacing` answers the two questions
the client asks of all readers: how many leases an ack that finishes a shard should ask for
(:meth:`Pacing.leases_wanted`, :meth:`Pacing.refill`) and whether the ack sender may let acks
gather (:meth:`Pacing.readers_supplied`).

A reader whose last request got fewer leases than it asked for, none left, is *dry* (:meth:`Pacing.granted`):
the master has no more to give it now (the end of a batch dataset, a stream at its head), so
sending its acks at once would not bring more; they may gather like a supplied reader's, and
the reader's own wait when its queue runs out (``shards()`` waits for its acks first) sends them.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from collections.abc import Iterable
from typing import Any

from streamrover.shard_service.client.lease_table import LeaseTable
from streamrover.shard_service.v1 import shard_service_pb2 as pb

PREFETCH_SECONDS = 0.02  # a reader keeps about this much of its caller's work leased ahead when shards are small...
MAX_PREFETCH = 128  # ...but no more than this many shards
# ...and at least this many when they are at most BATCH_SECONDS of its work: one AckBatch round trip (its acks, the
# next leases) then serves several big shards, not one or two (the master's and the worker's cost is per message)
BATCH_SHARDS = 8
BATCH_SECONDS = 0.1
# queued acks may gather while a reader has about this much of its work waiting (or 2/3 of its depth, if less):
# a round trip is 1-2 ms on a quiet machine, so the reader still has work when the answer brings the next leases
HOLD_SECONDS = 0.012
PREFETCH_RECORDS = 256 * 1024  # until the caller's pace is known (RAMP_SHARDS taken): about this many records
RAMP_SHARDS = 16
FIRST_MERGE_RECORDS = PREFETCH_RECORDS // 4  # until the pace is known, merged shards hold at most this many records
# once the pace is known, leases ask the master to merge runs of small shards into shards of about this much of the
# reader's work (.merging): a lease and its ack cost both sides the same whatever the shard's size
MERGE_SECONDS = 0.01


class PrefetchPace:
    """One reader's prefetch depth: ``prefetch`` shards, or about :data:`PREFETCH_SECONDS` of its work.

    Until :data:`RAMP_SHARDS` shards have shown the caller's pace, small shards are leased
    about :data:`PREFETCH_RECORDS` records ahead (the first shards pay the first reads, so
    they say nothing of the pace yet); then the depth is :data:`PREFETCH_SECONDS` over the
    median time the caller spent per shard over its last :data:`RAMP_SHARDS` shards, at least
    ``prefetch`` and :data:`BATCH_SHARDS` (when they are at most :data:`BATCH_SECONDS` of work),
    at most :data:`MAX_PREFETCH`. The median, not the mean: where one shard in
    a dozen pays the decoding of a whole row group, the others go by in a fraction of the
    mean, and a depth sized by the mean ran dry a dozen times per row group, each time for
    the round trip that brings the next leases.

    Depth and pace count planned shards: a merged lease (:meth:`merge_records`) counts each of its
    own, and two more of its size are kept ahead (it is taken, and finished, all at once).
    """

    def __init__(self, prefetch: int, records_per_shard: int) -> None:
        self.base = max(prefetch, 1)
        self.sized(records_per_shard)
        self._recent: deque[float] = deque(maxlen=RAMP_SHARDS)
        self._taken = 0
        self.dry = False  # the last request got fewer leases than it asked for, none left (Pacing.granted)
        self.seconds = 0.0  # the caller's median time per shard (0: not known yet)
        self.merged = 1  # the planned shards of the last lease taken

    def first_lease(self, dataset: str) -> pb.LeaseRequest:
        """The first lease of ``dataset`` before its shard size is known (its answer brings the spec): in records.

        The depth and merges this pace asks for first once the size is known (:data:`PREFETCH_RECORDS` of shards,
        merged in runs of at most :data:`FIRST_MERGE_RECORDS` and :data:`BATCH_SHARDS`), which the master counts
        (:func:`~streamrover.shard_service.master.merging.sized_by_records`).
        """
        return pb.LeaseRequest(
            dataset=dataset, max_shards=MAX_PREFETCH, merge_records=FIRST_MERGE_RECORDS, describe=True,
            max_records=PREFETCH_RECORDS, merge_shards=BATCH_SHARDS,
        )  # fmt: skip

    def sized(self, records_per_shard: int) -> None:
        """The dataset's records per shard (0: unknown or the default), as learnt: the first depth follows it."""
        self.records_per_shard = records_per_shard
        by_records = math.ceil(PREFETCH_RECORDS / records_per_shard) if records_per_shard > 0 else 0
        self.ramp = max(self.base, min(MAX_PREFETCH, by_records))
        self.target = self.ramp

    def took(self, seconds: float, shards: int = 1) -> None:
        """The caller spent ``seconds`` on one more lease, of ``shards`` planned shards (more than one when merged):
        the depth follows its recent median pace per planned shard."""
        self._recent.append(seconds / shards)
        self.merged = shards
        self._taken += 1
        pace = self.seconds = statistics.median(self._recent)
        if pace > 0:
            depth = max(math.ceil(PREFETCH_SECONDS / pace), min(BATCH_SHARDS, int(BATCH_SECONDS / pace)))
        else:
            depth = MAX_PREFETCH
        if self._taken < RAMP_SHARDS:
            depth = max(depth, self.ramp)
        # merged shards arrive, and are consumed, several planned shards at a time: two more of them ahead, so that
        # the queue holds PREFETCH_SECONDS of work between two of them and acks may still gather (supplied)
        merged = 2 * self.merged if self.merged > 1 else 0
        self.target = max(self.base, min(MAX_PREFETCH, depth + merged))

    def merge_records(self) -> int:
        """How many records a merged shard may hold: :data:`MERGE_SECONDS` of the caller's work at its pace.

        Until the pace is known, a quarter of the first lease's :data:`PREFETCH_RECORDS` (leased ahead anyway),
        but at most :data:`BATCH_SHARDS` shards (their records may be costly: unbounded, a dataset of small
        shards went to one worker as one shard). 0 (no merging) when that is less than two planned shards.
        """
        return self.merge_shards() * self.records_per_shard

    def merge_shards(self) -> int:
        """:meth:`merge_records` in planned shards (0: no merging)."""
        rps = self.records_per_shard
        if rps <= 0:
            return 0
        unknown = min(FIRST_MERGE_RECORDS // rps, BATCH_SHARDS)
        shards = int(MERGE_SECONDS / self.seconds) if self.seconds > 0 else unknown
        return shards if shards >= 2 else 0

    def supplied(self, waiting: int) -> bool:
        """Whether ``waiting`` shards are enough work to let queued acks gather: :data:`HOLD_SECONDS` of it.

        At most 2/3 of the depth (the rule before the pace is known).
        """
        enough = self.target * 2 / 3
        if self.seconds > 0:  # (the next merged shard taken, HOLD_SECONDS must still be waiting)
            enough = min(enough, HOLD_SECONDS / self.seconds + (self.merged if self.merged > 1 else 0))
        return waiting >= enough


class Pacing:
    """The prefetch depth of every :meth:`ShardClient.shards` reader, against the leases waiting in ``table``."""

    def __init__(self, table: LeaseTable) -> None:
        self._table = table
        self._paces: dict[str, PrefetchPace] = {}
        self._lock = threading.Lock()

    def start(self, dataset: str, prefetch: int, records_per_shard: int) -> PrefetchPace:
        """A reader of ``dataset`` starts (one per dataset at a time)."""
        pace = PrefetchPace(prefetch, records_per_shard)
        with self._lock:
            self._paces[dataset] = pace
        return pace

    def stop(self, dataset: str) -> None:
        """The reader of ``dataset`` ended."""
        with self._lock:
            self._paces.pop(dataset, None)

    def target(self, dataset: str, default: int) -> int:
        """How many shards the reader of ``dataset`` wants waiting (``default`` when none reads it)."""
        pace = self._paces.get(dataset)
        return default if pace is None else pace.target

    def merge_records(self, dataset: str) -> int:
        """The ``merge_records`` of a request for leases of ``dataset`` (0 when no reader paces it)."""
        pace = self._paces.get(dataset)
        return 0 if pace is None else pace.merge_records()

    def _waiting(self, dataset: str) -> int:
        """The planned shards waiting for the reader of ``dataset`` (a merged lease counts each of its own)."""
        return sum(s.lease.shards for s in self._table.waiting_snapshot(dataset))

    def _shortfall(self, dataset: str) -> int | None:
        """The reader's depth minus the shards waiting for it (None when no reader paces ``dataset``)."""
        pace = self._paces.get(dataset)
        return None if pace is None else pace.target - self._waiting(dataset)

    def leases_wanted(self, dataset: str) -> int:
        """How many leases an ack that finishes a shard of ``dataset`` asks for: one, or a refill of a dry queue.

        0 when no reader paces ``dataset`` (an ack of a shard leased by hand brings nothing).
        """
        short = self._shortfall(dataset)
        return 0 if short is None else max(1, short)

    def refill(self, dataset: str, asked: int) -> int:
        """How many leases a batch of acks asks for: enough to refill the reader's queue as it is now.

        ``asked``: what the batch's acks asked for themselves, used when no reader paces ``dataset``.
        """
        short = self._shortfall(dataset)
        return asked if short is None else max(0, short)

    @staticmethod
    def units_of(leases: Iterable[Any]) -> int:
        """How many planned shards ``leases`` (protobuf ``Lease`` messages) cover."""
        return sum(max(msg.shards, 1) for msg in leases)

    def granted(self, dataset: str, asked: int, got: int, todo: int = 0) -> None:
        """A request asked for ``asked`` shards of ``dataset`` and got ``got`` with ``todo`` left unleased: fewer and
        none left makes its reader dry (fewer with some left is a share near the end of a pass: acks bring more)."""
        pace = self._paces.get(dataset)
        if pace is not None and asked > 0:
            pace.dry = got < asked and todo <= 0

    def readers_supplied(self) -> bool:
        """Whether each reader pacing deeper than asked has work enough waiting (PrefetchPace.supplied) or is dry."""
        deep = False
        with self._lock:
            paces = list(self._paces.items())
        for dataset, pace in paces:
            if pace.target <= pace.base:
                continue
            if not pace.dry and not pace.supplied(self._waiting(dataset)):
                return False
            deep = True
        return deep


__all__ = [
    "BATCH_SECONDS",
    "BATCH_SHARDS",
    "FIRST_MERGE_RECORDS",
    "HOLD_SECONDS",
    "MAX_PREFETCH",
    "MERGE_SECONDS",
    "PREFETCH_RECORDS",
    "PREFETCH_SECONDS",
    "RAMP_SHARDS",
    "Pacing",
    "PrefetchPace",
]
