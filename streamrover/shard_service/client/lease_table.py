"""The leases one worker client holds: held, waiting their turn, revoked.

* **Held**: every lease granted to this client and not yet finished; heartbeats report
  their progress and keep them alive (waiting ones too).
* **Waiting**: per dataset, leases that came ahead of their turn (with an ack, or a lease
  call asking for several), in the order :meth:`ShardClient.shards` yields them.
* **Revoked**: leases this client no longer holds (the master said so in a heartbeat, or a
  restore revoked every lease): no longer held (heartbeats stop reporting them), and remembered
  only while their :class:`LeasedShard` exists, so that its reader stops at the next batch.
  Nothing is kept per revoked lease after that (a long-lived worker's revocations do not add up).
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from streamrover.shard_service.client.leased import LeasedShard

LeaseKey = tuple[str, int]  # (shard id, attempt)


class LeaseTable:
    """Held, waiting and revoked leases of one client; thread-safe (reader, ack sender and heartbeat threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, LeasedShard] = {}
        self._waiting: dict[str, deque[LeasedShard]] = {}
        self._revoked: weakref.WeakSet[LeasedShard] = weakref.WeakSet()
        # every lease object still alive by (shard id, attempt), held or not (a reader may outlive its entry)
        self._live: weakref.WeakValueDictionary[LeaseKey, LeasedShard] = weakref.WeakValueDictionary()

    def waiting(self, dataset: str) -> deque[LeasedShard]:
        """The leases of ``dataset`` waiting their turn (the caller pops them in order)."""
        queue = self._waiting.get(dataset)
        if queue is None:
            with self._lock:
                queue = self._waiting.setdefault(dataset, deque())
        return queue

    def waiting_count(self, dataset: str) -> int:
        """How many leases of ``dataset`` wait their turn."""
        queue = self._waiting.get(dataset)
        return 0 if queue is None else len(queue)

    def waiting_snapshot(self, dataset: str) -> list[LeasedShard]:
        """The leases of ``dataset`` waiting their turn, now (a copy: the reader pops while others count)."""
        queue = self._waiting.get(dataset)
        return [] if queue is None else list(queue)  # (one C call under the GIL: no torn read)

    def add(self, shards: Iterable[LeasedShard], into: deque[LeasedShard] | list[LeasedShard]) -> None:
        """New leases: held from now on, and appended to ``into`` (a waiting queue or the caller's list)."""
        with self._lock:
            for shard in shards:
                self._held[shard.shard_id] = shard
                self._live[(shard.shard_id, shard.lease.attempt)] = shard
                into.append(shard)

    def is_revoked(self, shard: LeasedShard) -> bool:
        """Whether this client lost the lease of ``shard``."""
        return shard in self._revoked

    def live(self, shard_id: str, attempt: int) -> LeasedShard | None:
        """The lease object of (``shard_id``, ``attempt``) if one is still alive (held or not)."""
        return self._live.get((shard_id, attempt))

    def finished(self, shard: LeasedShard) -> None:
        """``shard`` is done (its last ack was recorded): it is no longer held."""
        with self._lock:
            if self._held.get(shard.shard_id) is shard:
                del self._held[shard.shard_id]

    def progress(self) -> list[tuple[str, int, int]]:
        """(shard id, attempt, next position to read) of every held lease, for a heartbeat."""
        with self._lock:
            return [(s.shard_id, s.lease.attempt, s.position) for s in self._held.values()]

    def revoke(self, keys: Iterable[LeaseKey]) -> None:
        """The master says this client no longer holds these leases (shard id, attempt)."""
        with self._lock:
            for key in keys:
                shard = self._live.get(key)
                if shard is not None:
                    self._revoked.add(shard)
                    if self._held.get(shard.shard_id) is shard:
                        del self._held[shard.shard_id]

    def revoke_held(self) -> None:
        """Every held lease is gone (the worker was declared dead): waiting ones stop at their first batch."""
        with self._lock:
            self._revoked.update(self._held.values())
            self._held.clear()

    def forget_all(self) -> None:
        """A restore revoked every lease: drop the held and the waiting ones so that none is read again."""
        with self._lock:
            self._revoked.update(self._held.values())
            self._held.clear()
            for queue in self._waiting.values():
                queue.clear()


__all__ = ["LeaseKey", "LeaseTable"]
