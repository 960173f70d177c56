"""Group commit of the master's journal: calls that meet at the lock share one COMMIT, none answers early.

Two calls are made to meet deterministically: the first ends its transaction while the second is
known to be waiting for the lock (``CommitLock.arriving``). The first must not commit alone, and
neither may leave the lock before its write is committed: each checks, the moment it is out, that
its row is in the journal as a second SQLite connection (which sees only committed data) reads it.
A failing group COMMIT fails both calls; a call that raises inside the group rolls back its own
writes only. The SIGKILL side (nothing answered is lost) is in test_worker_session.py.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from streamrover.shard_service.master.bookkeeping import WorkerRecord
from streamrover.shard_service.master.group_commit import CommitLock
from streamrover.shard_service.master.journal import Journal, JournalWriteError
from tests.helpers import wait_until
from tests.shard_service.test_journal_failures import ERRORS, FailingConnection


def _committed_workers(path: Path) -> set[str]:
    with sqlite3.connect(str(path)) as other:  # another connection: it sees committed transactions only
        return {str(row[0]) for row in other.execute("SELECT id FROM workers")}


def _call(lock: CommitLock, worker: str, before_exit: Callable[[], None] = lambda: None) -> None:
    """One call as the server makes it: the lock, a journal transaction, then out."""
    with lock:
        with lock.journal.transaction():
            lock.journal.put_worker(WorkerRecord(worker, worker))
        before_exit()


def _meet(lock: CommitLock, outcomes: dict[str, object]) -> None:
    """Calls "a" and "b": "a" leaves the lock only once "b" waits for it; each records what it saw when out."""
    path = lock.journal.path
    a_written = threading.Event()

    def run(name: str, before_exit: Callable[[], None] = lambda: None) -> None:
        try:
            _call(lock, name, before_exit)
            outcomes[name] = name in _committed_workers(path)
        except Exception as exc:  # the test thread asserts on it
            outcomes[name] = exc

    def a_waits_for_b() -> None:
        a_written.set()
        wait_until(lambda: lock.arriving == 1, 30, "call b waiting for the lock")

    a = threading.Thread(target=run, args=("a", a_waits_for_b))
    a.start()
    assert a_written.wait(30)
    b = threading.Thread(target=run, args=("b",))
    b.start()
    a.join(60)
    b.join(60)
    assert not a.is_alive() and not b.is_alive()


def test_calls_meeting_at_the_lock_share_one_commit_and_leave_only_once_durable(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.db")
    lock = CommitLock(journal)
    commits = journal.commits
    outcomes: dict[str, object] = {}
    _meet(lock, outcomes)
    assert outcomes == {"a": True, "b": True}  # each saw its own write committed the moment it was out
    assert journal.commits == commits + 1  # one COMMIT for the two transactions
    assert journal.written == journal.durable
    _call(lock, "c")  # a lone call commits at once
    assert "c" in _committed_workers(journal.path) and journal.commits == commits + 2
    journal.close()


def test_a_failed_group_commit_fails_every_call_of_the_group(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.db")
    lock = CommitLock(journal)
    real = journal._db
    # a's BEGIN and row, b's SAVEPOINT, row and RELEASE pass; the group's COMMIT fails
    journal._db = FailingConnection(real, 5, ERRORS["I/O error"], persistent=False)  # type: ignore[assignment]
    outcomes: dict[str, object] = {}
    _meet(lock, outcomes)
    assert all(isinstance(o, JournalWriteError) for o in outcomes.values()), outcomes  # neither was answered
    assert journal.failed and _committed_workers(journal.path) == set()
    with pytest.raises(JournalWriteError):  # and nothing more is: fail-stop
        _call(lock, "c")
    journal._db = real
    journal.close()


def test_a_call_that_raises_in_a_group_rolls_back_its_own_writes_only(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.db")
    lock = CommitLock(journal)
    with lock:
        with journal.transaction():
            journal.put_worker(WorkerRecord("kept", "kept"))
        with pytest.raises(RuntimeError), journal.transaction():
            journal.put_worker(WorkerRecord("refused", "refused"))
            raise RuntimeError("refused after a write")
        with journal.transaction():
            journal.put_worker(WorkerRecord("after", "after"))
    assert _committed_workers(journal.path) == {"kept", "after"}
    assert not journal.failed
    journal.close()
