"""The master's side of a stream dataset: poll end positions, plan shards, commit offsets upstream.

One thread per stream dataset. Source I/O happens outside the service lock; only
planning takes it. An unreachable source is retried with exponential backoff and
its error shown in status; a deleted one fails the dataset with a clear error.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from streamrover.shard_service.streams import stream_option
from streamrover.sources.api import Source, SourceError, SourceGoneError, open_source

if TYPE_CHECKING:  # pragma: no cover
    from streamrover.shard_service.server import ShardServicer

log = logging.getLogger(__name__)
DEFAULT_POLL_INTERVAL_MS = 100
MAX_BACKOFF = 5.0


class StreamPoller:
    def __init__(self, servicer: ShardServicer, name: str) -> None:
        self.servicer = servicer
        self.name = name
        ds = servicer.core.dataset(name)
        self.spec = ds.spec
        self.interval = stream_option(ds, "sr.poll_interval_ms", DEFAULT_POLL_INTERVAL_MS) / 1000.0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._commit_lock = threading.Lock()
        self._to_commit: dict[str, int] = {}
        self._thread = threading.Thread(target=self._run, name=f"poll-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    def commit_later(self, positions: Mapping[str, int]) -> None:
        """Commit these positions upstream on the next round (after a cut was committed)."""
        with self._commit_lock:
            self._to_commit.update(positions)
        self._wake.set()

    def _run(self) -> None:
        source: Source | None = None
        backoff = 0.0
        core, cond = self.servicer.core, self.servicer.cond
        while not self._stop.is_set():
            try:
                if source is None:
                    source = open_source(self.spec.uri, self.spec.format, self.spec.options)
                polled = source.poll()
                with cond:
                    if core.extend_stream(self.name, polled):
                        cond.notify_all()
                    core.source_errors.pop(self.name, None)
                with self._commit_lock:
                    pending, self._to_commit = self._to_commit, {}
                if pending:
                    try:
                        source.commit(pending)
                    except SourceError:
                        with self._commit_lock:  # keep the newest positions for the next round
                            self._to_commit = {**pending, **self._to_commit}
                        raise
                backoff = 0.0
                wait = self.interval
            except SourceGoneError as exc:
                log.error("dataset %s failed: %s", self.name, exc)
                with cond:
                    core.fail_dataset(self.name, str(exc))
                    cond.notify_all()
                break
            except SourceError as exc:
                backoff = min(max(backoff * 2, 0.1), MAX_BACKOFF)
                with cond:
                    since = core.source_errors.get(self.name, ("", time.time()))[1]
                    core.source_errors[self.name] = (f"{exc} (retrying every {backoff:.1f}s)", since)
                log.warning("dataset %s: %s; retrying in %.1fs", self.name, exc, backoff)
                wait = backoff
            self._wake.wait(wait)
            self._wake.clear()
        if source is not None:
            source.close()
