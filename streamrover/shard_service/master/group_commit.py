"""The master's lock around the core, with group commit of the journal.

Every call takes this lock around its work on the core, as before, and ends its journal
transaction before it lets go. What changes is when the transaction is committed: a call that
leaves the lock while other calls are waiting for it does not commit on its own; its
transaction stays in the journal's open group and the last call of the group (the one that
finds nobody waiting behind it, or the group at :data:`MAX_GROUP`) commits them all with one
COMMIT. Each call then waits, outside the work but before it returns, until the journal is
durable up to the state it saw (``Journal.written`` when it left): **no answer leaves before
the writes it was built from are committed** — its own, and those of the calls before it whose
uncommitted state it read. A commit that fails fails every call waiting on it
(:class:`JournalWriteError`: the server answers UNAVAILABLE and stops, as for any failed write).

A call that sleeps on the condition (a lease long poll, the lease reaper) commits the group first
when nobody is waiting, so that nothing waits for a commit that no call would make.
"""

from __future__ import annotations

import threading
from types import TracebackType

from streamrover.shard_service.master.journal import Journal, JournalWriteError

MAX_GROUP = 64  # transactions at most in one commit (bounds the wait of the first under a steady stream of calls)


class CommitLock:
    """A re-entrant lock and condition over a :class:`Journal`, committing its transactions in groups."""

    def __init__(self, journal: Journal, max_group: int = MAX_GROUP) -> None:
        self.journal = journal
        self.max_group = max_group
        journal.group_commit = True
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # notify/wait: state changes (lease waiters, the reaper)
        self._committed = threading.Condition(self._lock)  # a group was committed (or its commit failed)
        self._count_lock = threading.Lock()
        self._arriving = 0  # threads that asked for the lock and do not hold it yet
        self._awaiting = 0  # threads sleeping on _committed (nobody to notify when none)
        self._owner: int | None = None
        self._depth = 0

    @property
    def arriving(self) -> int:
        """Threads waiting to take the lock now (their transactions will join the open group)."""
        return self._arriving

    def __enter__(self) -> CommitLock:
        me = threading.get_ident()
        if self._owner == me:
            self._depth += 1
            return self
        if self._lock.acquire(blocking=False):  # free: this thread is not one arriving behind a holder
            self._owner, self._depth = me, 1
            return self
        with self._count_lock:
            self._arriving += 1
        self._lock.acquire()
        with self._count_lock:
            self._arriving -= 1
        self._owner, self._depth = me, 1
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._depth > 1:
            self._depth -= 1
            return
        journal, me = self.journal, self._owner
        seen = journal.written  # the state this thread saw includes every transaction ended so far
        try:
            self._commit_point()
            while journal.durable < seen and not journal.failed:
                self._owner = None
                self._awaiting += 1
                try:
                    self._committed.wait()  # the group's last call commits it
                finally:
                    self._awaiting -= 1
                self._owner = me
        finally:
            self._owner, self._depth = None, 0
            self._lock.release()
        if journal.durable < seen:
            raise JournalWriteError(journal.failed)

    def _commit_point(self) -> None:
        """Commit the open group unless another call is about to join it (called with the lock held)."""
        journal = self.journal
        pending = journal.written - journal.durable
        if pending and (not self._arriving or pending >= self.max_group):
            try:
                journal.commit()
            finally:
                if self._awaiting:
                    self._committed.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep until notified or ``timeout`` (as ``threading.Condition.wait``); the open group is committed first."""
        me, depth = self._owner, self._depth
        self._commit_point()
        self._owner = None
        try:
            return self._changed.wait(timeout)
        finally:
            self._owner, self._depth = me, depth

    def notify_all(self) -> None:
        """Wake every thread sleeping in :meth:`wait`."""
        self._changed.notify_all()

    def notify(self, n: int = 1) -> None:
        """Wake ``n`` threads sleeping in :meth:`wait`."""
        self._changed.notify(n)


__all__ = ["MAX_GROUP", "CommitLock"]
