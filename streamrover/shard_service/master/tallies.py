"""Bounded tallies of the core: a set that forgets its oldest members, and the ack rates of the last seconds."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator

RATE_WINDOW = 5.0  # seconds of acks the rates in status cover
RATE_BUCKET = 0.1  # seconds per bucket of the ack rates: their memory is RATE_WINDOW / RATE_BUCKET buckets


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
