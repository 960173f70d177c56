"""When leases and workers expire, without looking at every lease and worker on each check.

:class:`DeadlineQueue` is a min-heap of *lower bounds*: each tracked key (a leased shard, a live
worker) has one entry whose time is no later than the key's real deadline. Deadlines only move later
while a key lives (a heartbeat, a lease, an ack: ``now + ttl`` with a clock that moves forward), so the
owner pushes an entry only when a key starts to be tracked, or when its deadline moved *earlier* than its
entry (:meth:`DeadlineQueue.track`), not on every refresh. A check pops only the entries whose bound has
passed; for each it asks the owner for the key's real deadline (``current``): past, the key is expired;
later, the entry is pushed back at the real deadline; gone (None), it is dropped. So a check costs the
expired keys plus the keys refreshed since their entry was pushed (each at most once per TTL), not the
number of leases and workers; :meth:`DeadlineQueue.earliest` is exact the same way.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class DeadlineQueue(Generic[K]):
    """Lower bounds of the deadlines of tracked keys, earliest first (see the module docstring)."""

    def __init__(self, current: Callable[[K], float | None]) -> None:
        self._current = current  # the key's real deadline now, None when it is no longer tracked
        self._heap: list[tuple[float, int, K]] = []
        self._bound: dict[K, float] = {}  # the time of each key's live entry (older entries are skipped)
        self._seq = 0  # ties broken by push order (keys need not be ordered)
        self.examined = 0  # entries popped by due()/earliest(), for tests and profiles

    def __len__(self) -> int:
        return len(self._bound)

    def track(self, key: K, deadline: float) -> None:
        """``key`` has deadline ``deadline`` now (a new key, or one whose deadline may have moved earlier)."""
        bound = self._bound.get(key)
        if bound is None or deadline < bound:
            self._push(key, deadline)

    def _push(self, key: K, deadline: float) -> None:
        self._bound[key] = deadline
        self._seq += 1
        heapq.heappush(self._heap, (deadline, self._seq, key))

    def _pop(self) -> tuple[K, float | None] | None:
        """Pop the top entry; (its key, the key's real deadline) when it is the key's live entry, else None."""
        bound, _, key = heapq.heappop(self._heap)
        self.examined += 1
        if self._bound.get(key) != bound:
            return None  # superseded by an earlier entry of the same key
        deadline = self._current(key)
        if deadline is None:
            del self._bound[key]
        return key, deadline

    def due(self, now: float) -> list[K]:
        """The keys whose real deadline is before ``now``, earliest bound first; they are no longer tracked."""
        expired: list[K] = []
        while self._heap and self._heap[0][0] < now:
            popped = self._pop()
            if popped is None:
                continue
            key, deadline = popped
            if deadline is None:
                continue
            if deadline < now:
                del self._bound[key]
                expired.append(key)
            else:
                self._push(key, deadline)
        return expired

    def earliest(self) -> float | None:
        """The earliest real deadline of a tracked key (None when none is tracked)."""
        while self._heap:
            bound, _, key = self._heap[0]
            if self._bound.get(key) == bound and self._current(key) == bound:
                return bound
            popped = self._pop()
            if popped is not None and popped[1] is not None:
                self._push(popped[0], popped[1])
        return None


__all__ = ["DeadlineQueue"]
