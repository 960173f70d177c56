"""One master per state directory: an exclusive lock on ``STATE_DIR/master.lock`` held for the master's lifetime.

Two masters on one journal would each issue lease attempts from the same counter and answer
acks from diverging memories; the lock makes the second refuse to start. ``flock`` locks
belong to the open file, so the kernel drops it when the holder dies, SIGKILL included: a
restarted master never finds a stale lock. The file holds the holder's pid, for the message.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from streamrover.shard_service.api import FailedPreconditionError

LOCK_NAME = "master.lock"


class StateDirLock:
    """Holds the lock from construction until :meth:`release`; raises when another process holds it."""

    def __init__(self, state_dir: str | Path) -> None:
        self.path = Path(state_dir) / LOCK_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            self._fd = None
            raise FailedPreconditionError(
                f"state dir {self.path.parent} is in use by another master (pid {holder}, lock {self.path}): "
                "stop it first, or give this master its own --state-dir"
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        """Drop the lock (idempotent). The file stays: unlinking it would let a third master lock a new inode."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
