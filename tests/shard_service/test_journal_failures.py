"""Journal write failures in the shard service core: nothing answered that is not durable.

A disk that fills up or fails under the journal makes a write raise: SQLite's "database or
disk is full" or "disk I/O error", or an ``OSError``. The contract (issue 15 item 9: memory
never runs ahead of the journal):

- the call that hit the failure answers nothing (it raises);
- from then on the core refuses to go on (fail-stop): every call raises, instead of answering
  from memory that the journal lacks (an ack repeated after its failed write was answered
  "duplicate, OK" although it was never recorded) — or, where a call reads memory only, the
  journal has declared the failure (``Journal.failed``), which the server checks after every
  call before it lets an answer out;
- a master restarted on the journal comes back exactly at the model's state: every answered
  change is there, the failed one is not.

The state machine of tests/shard_service/statemachine.py gets one more rule: arm a failure at the n-th
journal write from now (once, or for good: a full disk stays full), run one of the machine's
operations, and check the three points. The failure is injected in place of the journal's
SQLite connection, so it strikes at any statement, COMMIT included.
"""

from __future__ import annotations

import errno
import os
import sqlite3
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import rule

from tests.shard_service.statemachine import (
    ACK_ARGS,
    BATCH_ARGS,
    GROW_ARGS,
    LEASE_ARGS,
    RESTORE_ARGS,
    ShardServiceMachine,
    cursor_of,
)

ERRORS: dict[str, Callable[[], Exception]] = {
    "disk full": lambda: sqlite3.OperationalError("database or disk is full"),
    "I/O error": lambda: sqlite3.OperationalError("disk I/O error"),
    "OSError": lambda: OSError(errno.ENOSPC, "No space left on device"),
}
_READS = ("SELECT", "ROLLBACK", "PRAGMA")


class FailingConnection:
    """Stands in for the journal's sqlite3 connection: the ``countdown``-th write from now raises ``error``.

    Reads and ROLLBACK pass. ``persistent``: every write after the first failure fails too.
    """

    def __init__(self, db: sqlite3.Connection, countdown: int, error: Callable[[], Exception], persistent: bool):
        self.db = db
        self.countdown = countdown
        self.error = error
        self.persistent = persistent
        self.fired: Exception | None = None

    def _write(self, sql: str) -> None:
        if sql.lstrip().split(None, 1)[0].upper() in _READS:
            return
        if self.fired is not None:
            if self.persistent:
                raise self.error()
            return
        if self.countdown == 0:
            self.fired = self.error()
            raise self.fired
        self.countdown -= 1

    def execute(self, sql: str, *args: Any) -> Any:
        self._write(sql)
        return self.db.execute(sql, *args)

    def executemany(self, sql: str, *args: Any) -> Any:
        self._write(sql)
        return self.db.executemany(sql, *args)

    def executescript(self, sql: str) -> Any:
        self._write(sql)
        return self.db.executescript(sql)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.db, name)


# The machine's operations that write, with their arguments and when they can run.
OPS: dict[str, tuple[str, dict[str, Any], Callable[[Any], bool]]] = {
    "lease": ("lease", LEASE_ARGS, lambda m: True),
    "ack": ("ack", ACK_ARGS, lambda m: bool(m.held)),
    "ack_batch": ("ack_batch", BATCH_ARGS, lambda m: bool(m.held or m.old)),
    "stream_grows": ("stream_grows", GROW_ARGS, lambda m: True),
    "cut_prepare": ("cut_prepare", {}, lambda m: True),
    "cut_commit": ("cut_commit", {"i": st.integers(0, 100)}, lambda m: bool(m.prepared)),
    "restore": ("restore", RESTORE_ARGS, lambda m: bool(m.committed_cuts or m.prepared)),
    "expire": ("time_passes", {"seconds": st.just(100.0)}, lambda m: True),
    "worker_leaves": ("worker_leaves", {"w": st.integers(0, 2)}, lambda m: True),
}


class JournalFailureMachine(ShardServiceMachine):
    @rule(
        op=st.sampled_from(sorted(OPS)),
        countdown=st.integers(0, 6),
        error=st.sampled_from(sorted(ERRORS)),
        persistent=st.booleans(),
        data=st.data(),
    )
    def journal_write_fails(self, op: str, countdown: int, error: str, persistent: bool, data: st.DataObject) -> None:
        method, args, ready = OPS[op]
        if not ready(self):
            return
        kwargs = {k: data.draw(v, label=k) for k, v in args.items()}
        journal = self.core.journal
        real = journal._db
        failing = FailingConnection(real, countdown, ERRORS[error], persistent)
        journal._db = failing  # type: ignore[assignment]
        answers = self.answers
        self.last_ack = None
        raised: Exception | None = None
        try:
            getattr(self, method)(**kwargs)
        except AssertionError:
            raise
        except Exception as exc:  # whatever the core raises for a write it could not make
            raised = exc
        if failing.fired is None:  # the operation needed fewer writes: it ran normally
            journal._db = real
            if raised is not None:
                raise raised
            return
        what = f"{error} ({failing.fired!r}) at write {countdown} of {op}{kwargs}"
        assert raised is not None and self.answers == answers, (
            f"{op} answered although its journal write failed: {what}"
        )
        answered = [name for name, probe in self._probes() if _answers(probe)]
        if answered:  # memory answered: allowed only if the journal says it failed, so the server answers nothing
            assert getattr(journal, "failed", ""), (
                f"after a failed journal write the core still answered {answered}: {what}"
            )
        # The master restarts on the journal (the disk is fine again): the model's state, nothing more or less.
        journal._db = real
        journal.close()
        self.core = self._open()
        assert self.core.acked_cursor() == self._model_cursor(), f"acks lost or kept across the restart: {what}"
        assert self.core.committed == cursor_of(self.committed_model), f"the committed cursor after: {what}"

    def _probes(self) -> list[tuple[str, Callable[[], object]]]:
        probes: list[tuple[str, Callable[[], object]]] = [
            ("join", lambda: self.core.join("probe")),
            ("cut_prepare", lambda: self.core.cut_prepare()),
        ]
        live = [w for w in self.workers if w in self.core.workers]
        if live:
            probes.append(("lease", lambda: self.core.lease(live[0], "d", 1)))
        if self.last_ack is not None:
            h, pos = self.last_ack  # the ack whose write failed, sent again (a client retries an unanswered call)
            probes.append(
                ("the failed ack again", lambda: self.core.ack(h.worker, h.grant.shard_id, h.grant.attempt, pos))
            )
        return probes


def _answers(probe: Callable[[], object]) -> bool:
    try:
        probe()
    except Exception:  # refused, in whatever way: that is fail-stop
        return False
    return True


TestJournalFailureMachine = JournalFailureMachine.TestCase
TestJournalFailureMachine.settings = settings(
    max_examples=int(os.environ.get("SR_SM_EXAMPLES", "60")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_a_failed_ack_write_is_never_answered() -> None:
    """One ack whose COMMIT fails: it raises; sent again it is refused (or the journal declared the failure, so the
    server answers nothing); a restart has no trace of it."""
    m = JournalFailureMachine()
    m.register(shuffle=False, size=5, tagged=False)
    m.lease(w=0, n=1, ds="d")
    [h] = m.held
    journal = m.core.journal
    real = journal._db
    journal._db = FailingConnection(real, 2, ERRORS["disk full"], persistent=False)  # type: ignore[assignment]
    with pytest.raises(Exception, match="disk is full"):  # an ack's writes: BEGIN, the shard row, COMMIT
        m.core.ack(h.worker, h.grant.shard_id, h.grant.attempt, h.grant.end)
    try:
        again = m.core.ack(h.worker, h.grant.shard_id, h.grant.attempt, h.grant.end)
    except Exception:  # refused, in whatever way the core chooses
        again = None
    assert again is None or getattr(journal, "failed", ""), f"the ack whose write failed was answered again: {again}"
    journal._db = real
    journal.close()
    m.core = m._open()
    assert m.core.acked_cursor().size() == 0, "a restart found the ack whose write failed"
    m.core.journal.close()
