"""A settable clock and a core on it, for tests that drive ShardCore directly (leases expire when it moves)."""

from __future__ import annotations

from pathlib import Path

from streamrover.shard_service.master.core import ShardCore
from streamrover.shard_service.master.journal import Journal


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def core_on(path: Path, clock: Clock, lease_ttl: float = 5.0) -> ShardCore:
    """A core whose journal is ``path``/j.db, on ``clock``."""
    return ShardCore(Journal(path / "j.db"), lease_ttl=lease_ttl, clock=clock)
