"""The master's side of a stream dataset: poll end positions, plan shards, commit offsets upstream.

One thread per stream dataset. Source I/O happens outside the service lock; only
planning takes it.

- An unreachable source is retried with exponential backoff and its error shown in status.
- A topic (or a planned partition) that the source says does not exist fails the dataset
  only once it has stayed missing for ``sr.missing_grace_ms`` (default two minutes): a
  broker restarting looks the same for a while (a RocketMQ name server answers "topic does
  not exist" until the broker has registered its routes again). Status shows the wait.
- Anything else the poller raises fails the dataset with the reason in status (a poller
  never dies silently, and a bad dataset never keeps the master from starting).
- Every call into the source's client is waited for at most ``sr.source_timeout_ms`` (``bounded.py``);
  a slow one is shown in status as it waits, one that does not answer gets its client abandoned and a
  new one opened, as do ``REOPEN_AFTER`` failed polls in a row (status counts the reopens).

A failed dataset is resumed with ``ResumeDataset`` (``streamrover dataset resume NAME``),
which starts a new poller.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from functools import partial
from operator import attrgetter
from typing import TYPE_CHECKING

from streamrover.shard_service.master.bounded import SourceStuckError, SourceThread
from streamrover.shard_service.master.head_times import HeadTimes
from streamrover.shard_service.master.journal import JournalWriteError
from streamrover.shard_service.master.streams import stream_planning
from streamrover.sources.api import MasterSource, SourceError, SourceGoneError, open_source

if TYPE_CHECKING:  # pragma: no cover
    from streamrover.shard_service.master.server import ShardServicer

log = logging.getLogger(__name__)
MAX_BACKOFF = 5.0
#: Failed polls in a row after which the source is closed and opened afresh: a broker client can wedge (librdkafka
#: kept "Broker transport failure" for 5+ minutes after its broker's bad minute while fresh clients worked).
REOPEN_AFTER = 3
CLOSE_WAIT = 5.0  # seconds a stopping poller waits for its source's client to close
_ID = attrgetter("id")


class _DataLost(Exception):
    """Records were deleted upstream before they were trained (and the dataset does not skip them)."""


class _Missing(Exception):
    """The topic or a planned partition is missing now (it may come back within the grace period)."""


class StreamPoller:
    """One stream dataset's poll thread: plans shards from the source's ends, commits upstream after cuts."""
    def __init__(self, servicer: ShardServicer, name: str) -> None:
        self.servicer = servicer
        self.name = name
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._commit_lock = threading.Lock()
        self._to_commit: dict[str, int] = {}
        self._missing_since: float | None = None  # monotonic time the topic or a partition went missing
        self.reopens = 0  # times the source's client was abandoned for a new one
        self._head_times: HeadTimes | None = None  # reads head shards' times (started at the first)
        self._thread = threading.Thread(target=self._run, name=f"poll-{name}", daemon=True)

    def start(self) -> None:
        """Start the poll thread."""
        self._thread.start()

    def request_stop(self) -> None:
        """Make the thread end at its next step (it plans nothing after this if called with the lock held)."""
        self._stop.set()
        self._wake.set()

    def stop(self) -> None:
        """Stop the poll thread and wait for it (up to 10 s; not when called from it)."""
        self.request_stop()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def commit_later(self, positions: Mapping[str, int]) -> None:
        """Commit these positions upstream on the next round (after a cut was committed)."""
        with self._commit_lock:
            self._to_commit.update(positions)
        self._wake.set()

    def _fail(self, reason: str) -> None:
        log.error("dataset %s failed: %s", self.name, reason)
        with self.servicer.cond:
            if self.name in self.servicer.core.datasets:  # (not if it was removed meanwhile)
                self.servicer.core.streams.fail_dataset(self.name, reason)
            self.servicer.cond.notify_all()

    def _run(self) -> None:
        source: MasterSource | None = None
        calls: SourceThread | None = None
        try:
            with self.servicer.cond:
                ds = self.servicer.core.dataset(self.name)
                spec = ds.spec
                planning = stream_planning(ds)
                interval, grace = planning.poll_interval_ms / 1000.0, planning.missing_grace_ms / 1000.0
                timeout = planning.source_timeout_ms / 1000.0
            backoff, failures = 0.0, 0
            while not self._stop.is_set():
                if calls is not None and failures >= REOPEN_AFTER:
                    log.warning("dataset %s: %d failed polls in a row: reopening its source", self.name, failures)
                    self._abandon(calls, source)
                    source, calls, failures = None, None, 0
                try:
                    if calls is None:
                        calls = SourceThread(self.name, timeout, self._report, self._stop)
                    if source is None:
                        opening = partial(open_source, spec.uri, spec.format, spec.options, spec.epochs)
                        source = calls.call("opening the source", opening)
                    failures += 1  # until this poll succeeds
                    self._poll_once(source, calls)
                    backoff, wait, failures = 0.0, interval, 0
                except _DataLost as exc:
                    self._fail(str(exc))
                    return
                except (SourceGoneError, _Missing) as exc:
                    if self._missing(str(exc), grace):
                        return
                    backoff = min(max(backoff * 2, interval, 0.1), MAX_BACKOFF)
                    wait = backoff
                except SourceStuckError as exc:  # its thread is blocked in the client: every later call would wait
                    if self._stop.is_set():
                        break
                    log.warning("dataset %s: %s", self.name, exc)
                    self._abandon(calls, source)
                    source, calls, failures = None, None, 0
                    self._report(f"{exc} ({self._reopened()})")
                    wait = 0.0
                except SourceError as exc:
                    backoff = min(max(backoff * 2, 0.1), MAX_BACKOFF)
                    reopened = f"; {self._reopened()}" if self.reopens else ""
                    self._report(f"{exc} (retrying every {backoff:.1f}s{reopened})")
                    log.warning("dataset %s: %s; retrying in %.1fs", self.name, exc, backoff)
                    wait = backoff
                self._wake.wait(wait)
                self._wake.clear()
        except JournalWriteError as exc:  # not the dataset's fault: the master stops (fail-stop)
            self.servicer.fail_stop(str(exc))
        except Exception as exc:  # whatever stops the poller fails its dataset, said in status
            log.exception("the poller of dataset %s stopped", self.name)
            self._fail(f"the master's poller of this dataset stopped: {type(exc).__name__}: {exc}")
        finally:
            if self._head_times is not None:
                self._head_times.stop()
            if calls is not None:  # closed on its thread, waited for a while (a stuck client stays behind)
                calls.retire(source.close if source is not None else None)
                if not calls.join(CLOSE_WAIT):
                    log.warning("dataset %s: its source's client did not close in %.0fs", self.name, CLOSE_WAIT)

    def _abandon(self, calls: SourceThread | None, source: MasterSource | None) -> None:
        """Leave a client to its thread, which closes it and ends (or stays stuck where it is, a daemon)."""
        if calls is not None:
            calls.retire(source.close if source is not None else None)
        self.reopens += 1

    def _reopened(self) -> str:
        return f"the source's client reopened {self.reopens} time{'s' if self.reopens != 1 else ''} so far"

    def _poll_once(self, source: MasterSource, calls: SourceThread) -> None:
        polled = calls.call("polling the end positions", source.poll)
        core, cond = self.servicer.core, self.servicer.cond
        with cond:
            if self._stop.is_set():  # removed (or resumed anew) while polling: plan nothing
                return
            # records deleted upstream, ends gone back
            looked = core.streams.changed(self.name, polled)  # what moved since the last poll (None: all)
            lost = core.streams.upstream.check(self.name, polled if looked is None else looked, core.acked_cursor)
            if lost:
                raise _DataLost(lost)
            # a worker waiting for a shard gets the records there are now, not after sr.max_delay_ms (freshness)
            waiting = self.servicer.lease_waiters[self.name] > 0
            if core.extend_stream(self.name, polled, force=waiting, timed=source.record_times):
                cond.notify_all()
            ds = core.dataset(self.name)
            planned = list(map(_ID, ds.partitions))
            untimed = [(s.id, ds.partitions[s.pindex].id, s.start, s.end) for s in core.untimed(self.name)]
            # head shards leased at once with the newest time known: their records' times, off this thread
            head = [(s.id, ds.partitions[s.pindex].id, s.start, s.end) for s in core.stream_time.to_retime(self.name)]
        if untimed:
            self._time(source, calls, untimed)
        if head:
            if self._head_times is None:
                spec = ds.spec
                opener = partial(open_source, spec.uri, spec.format, spec.options, spec.epochs)
                self._head_times = HeadTimes(self.servicer, self.name, opener)
            self._head_times.offer(head)
        ids = list(map(_ID, polled))
        gone = [] if ids == planned else sorted(set(planned).difference(ids))  # (10,000 partitions: 0.2 vs 1 ms)
        if gone:
            raise _Missing(f"planned partition(s) {', '.join(gone)} missing from the source")
        self._missing_since = None
        with cond:
            core.streams.source_errors.pop(self.name, None)
        self._commit(source, calls)

    def _time(self, source: MasterSource, calls: SourceThread, shards: list[tuple[str, str, int, int]]) -> None:
        """Read the stream times of new shards (their first records' timestamps) and queue the shards with them.

        A source that cannot say now leaves them to when the master planned them (a warning), so training never
        waits on it; a stuck client is reopened as for any call.
        """
        try:
            times = calls.call("reading record times", lambda: source.first_times([s[1:] for s in shards]))
        except SourceStuckError:
            raise
        except SourceError as exc:
            log.warning("dataset %s: record times of %d shards unread (%s): leased by planning order", self.name,
                        len(shards), exc)  # fmt: skip
            times = [None] * len(shards)
        with self.servicer.cond:
            if self._stop.is_set():
                return
            self.servicer.core.set_times(self.name, {s[0]: t for s, t in zip(shards, times)})
            self.servicer.cond.notify_all()

    def _commit(self, source: MasterSource, calls: SourceThread) -> None:
        with self._commit_lock:
            pending, self._to_commit = self._to_commit, {}
        if pending:
            try:
                calls.call("committing offsets upstream", lambda: source.commit(pending))
            except SourceError:
                with self._commit_lock:  # keep the newest positions for the next round
                    self._to_commit = {**pending, **self._to_commit}
                raise

    def _missing(self, what: str, grace: float) -> bool:
        """Note that the topic or a partition is missing; fail the dataset once it stayed so for ``grace`` s."""
        now = time.monotonic()
        if self._missing_since is None:
            self._missing_since = now
        waited = now - self._missing_since
        if waited >= grace:
            self._fail(f"{what}, for {waited:.1f}s (sr.missing_grace_ms={grace * 1000:.0f})")
            return True
        self._report(
            f"{what}: missing for {waited:.1f}s; the dataset fails if it stays missing for {grace:.0f}s "
            "(sr.missing_grace_ms; a restarting broker looks like this for a while)"
        )
        log.warning("dataset %s: %s; missing for %.1fs of a %.0fs grace", self.name, what, waited, grace)
        return False

    def _report(self, message: str) -> None:
        with self.servicer.cond:
            since = self.servicer.core.streams.source_errors.get(self.name, ("", time.time()))[1]
            self.servicer.core.streams.source_errors[self.name] = (message, since)
