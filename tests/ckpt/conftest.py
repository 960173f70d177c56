"""Fixtures for the flash-checkpoint tests: a checkpoint root, shared-memory cleanup, a fake shard service."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamrover.ckpt import namespace_for, purge_shared_memory
from streamrover.cursor import DataCursor, PartitionKey

SHM = "/dev/shm"


class FakeShardService:
    """An in-memory CursorBinder: acks advance a cursor; cuts, commits and restores are recorded."""

    def __init__(self) -> None:
        self.cursor = DataCursor()
        self.cuts: dict[int, DataCursor] = {}
        self.committed: list[int] = []
        self.restored: list[DataCursor] = []
        self._next = 0

    def ack(self, partition: str, start: int, end: int) -> None:
        self.cursor.add(PartitionKey("clicks", 0, partition), start, end)

    def prepare_cut(self, step: int | None, *, persisting: bool = False) -> tuple[int, DataCursor]:
        self._next += 1
        self.cuts[self._next] = self.cursor.copy()
        return self._next, self.cursor.copy()

    def commit_cut(self, cut_id: int) -> None:
        self.committed.append(cut_id)

    def restore_cursor(self, cursor: DataCursor, *, from_memory: bool = False, **snapshot: object) -> None:
        self.cursor = cursor.copy()
        self.restored.append(cursor.copy())


def shm_names(namespace: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM) if n.startswith(f"srckpt-{namespace}-"))


@pytest.fixture
def root(tmp_path: Path) -> Iterator[str]:
    """A checkpoint root; its shared memory and any saver pids in ``root.pids`` are cleaned up after the test."""
    path = str(tmp_path / "ckpt")
    yield path
    purge_shared_memory(namespace_for(path))


@pytest.fixture
def pids() -> Iterator[list[int]]:
    """Processes a test started (savers, trainers): SIGKILLed at teardown if still alive."""
    started: list[int] = []
    yield started
    for pid in started:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def shard_service() -> FakeShardService:
    return FakeShardService()
