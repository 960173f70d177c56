"""Calls into a source's client that the master's poller waits for, each for a bounded time.

A broker client is C code the master does not control: librdkafka has been seen to leave a
request's answer unresolved for good after its broker was fenced and came back under load, and
its handle's destroy can wait on a request that never completes. A poller that made such a
call on its own thread stopped planning its stream for good, silently. So the poller makes
every call to its source (open, poll, commit, close) on a daemon thread of the source's own
(:class:`SourceThread`) and waits for each answer at most ``sr.source_timeout_ms``; while it
waits it says in status what it is waiting on. A call that does not answer in time is
:class:`SourceStuckError`: the poller abandons that client (its thread stays blocked where it is,
and a close is queued behind the stuck call) and opens a fresh one.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from streamrover.sources.api import SourceUnavailableError

log = logging.getLogger(__name__)
T = TypeVar("T")
#: How long a call may run before the poller shows in status that it is waiting on it.
SHOW_WAIT_AFTER = 2.0


class SourceStuckError(SourceUnavailableError):
    """A call into the source's client did not answer within ``sr.source_timeout_ms``: its client is abandoned."""


class SourceThread:
    """One source client's calls, made one at a time on a daemon thread of its own.

    ``report(message)`` is called (from the caller's thread) while a call has waited longer than
    ``SHOW_WAIT_AFTER`` seconds, about once a second.
    """

    def __init__(self, name: str, timeout: float, report: Callable[[str], None], stop: threading.Event) -> None:
        self.timeout = timeout
        self._report = report
        self._stop = stop  # set: a wait ends at once (SourceStuckError)
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=f"source-{name}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # the caller gets whatever the client raised
                future.set_exception(exc)

    def call(self, what: str, fn: Callable[[], T], timeout: float | None = None) -> T:
        """``fn()`` on the source's thread; its result or what it raised. ``SourceStuckError`` after ``timeout`` s
        (default: the thread's), or at once when the poller is asked to stop.

        ``what`` says what is waited for ("polling the end positions"): in status while it is slow, and in the error.
        """
        future: Future[T] = Future()
        start = time.monotonic()
        limit = self.timeout if timeout is None else timeout
        self._calls.put((fn, future))
        while True:
            if self._stop.is_set():
                raise SourceStuckError(f"{what}: the poller stopped while waiting for the source's answer")
            waited = time.monotonic() - start
            if waited >= limit:
                raise SourceStuckError(
                    f"{what}: no answer from the source's client in {limit:.0f}s (sr.source_timeout_ms); "
                    "that client is abandoned and a new one opened"
                )
            if waited >= SHOW_WAIT_AFTER:
                self._report(f"{what}: waiting for the source's answer for {waited:.0f}s "
                             f"(gives up at {limit:.0f}s, sr.source_timeout_ms)")  # fmt: skip
            try:
                return future.result(timeout=min(limit - waited, 1.0))
            except FutureTimeout:
                continue

    def retire(self, close: Callable[[], None] | None = None) -> None:
        """End the thread after ``close()`` (its client's), without waiting for either: a stuck call keeps only
        this thread (a daemon) where it is."""
        if close is not None:
            self._calls.put((lambda: _close_quietly(close), Future()))
        self._calls.put(None)

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for a retired thread to end; whether it did (if not, it is stuck in its client)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


def _close_quietly(close: Callable[[], None]) -> None:
    try:
        close()
    except Exception:  # an abandoned client that fails to close is gone anyway: say so, go on
        log.warning("closing an abandoned source client failed", exc_info=True)
