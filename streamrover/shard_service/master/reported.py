"""Metrics that trainers report to the master (loss, AUC, ...): the newest value and a short history each.

Kept in memory only (a master restart forgets them; trainers report again at their next window).
Bounded: at most :data:`MAX_REPORTERS` reporters (the one heard from longest ago is dropped first),
:data:`MAX_NAMES` names per reporter and :data:`HISTORY` points per series.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from streamrover.shard_service.api import InvalidArgumentError

NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
REPORTER_RE = re.compile(r"[A-Za-z0-9_.:@/-]{1,128}")
MAX_REPORTERS = 256
MAX_NAMES = 64
HISTORY = 600


@dataclass(frozen=True)
class Point:
    """One reported value: when the master got it (unix seconds), the trainer's step (or None), the value."""

    time: float
    step: int | None
    value: float


@dataclass
class _Reporter:
    last_seen: float = 0.0
    series: dict[str, deque[Point]] = field(default_factory=dict)


class ReportedMetrics:
    """The trainer metrics of a job, per reporter and metric name; thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._reporters: OrderedDict[str, _Reporter] = OrderedDict()  # least recently heard from first

    def report(self, reporter: str, values: Mapping[str, float], step: int | None = None) -> None:
        """Record ``values`` (name -> value) measured by ``reporter`` at ``step``; a bad name is refused whole."""
        if not REPORTER_RE.fullmatch(reporter):
            raise InvalidArgumentError(
                f"report metrics: reporter {reporter!r} must match {REPORTER_RE.pattern} (a worker id, or e.g. rank0)"
            )
        if not values:
            raise InvalidArgumentError(f"report metrics from {reporter}: no values given (e.g. loss=0.4, auc=0.78)")
        for name in values:
            if not NAME_RE.fullmatch(name):
                raise InvalidArgumentError(
                    f"report metrics from {reporter}: metric name {name!r} must match {NAME_RE.pattern} (e.g. auc)"
                )
        now = self._clock()
        with self._lock:
            rec = self._reporters.pop(reporter, None) or _Reporter()
            new = [n for n in values if n not in rec.series]
            if len(rec.series) + len(new) > MAX_NAMES:
                raise InvalidArgumentError(
                    f"report metrics from {reporter}: more than {MAX_NAMES} metric names ({sorted(new)[:5]}...)"
                )
            for name, value in values.items():
                rec.series.setdefault(name, deque(maxlen=HISTORY)).append(Point(now, step, float(value)))
            rec.last_seen = now
            self._reporters[reporter] = rec
            while len(self._reporters) > MAX_REPORTERS:
                self._reporters.popitem(last=False)

    def latest(self) -> dict[str, dict[str, Point]]:
        """Per reporter, per name: the newest point."""
        with self._lock:
            return {r: {n: s[-1] for n, s in rec.series.items()} for r, rec in self._reporters.items()}

    def history(self, since: float = 0.0) -> dict[str, dict[str, list[Point]]]:
        """Per reporter, per name: the points received after ``since`` (unix seconds), oldest first."""
        with self._lock:
            return {
                r: {n: [p for p in s if p.time > since] for n, s in rec.series.items()}
                for r, rec in self._reporters.items()
            }


__all__ = ["HISTORY", "MAX_NAMES", "MAX_REPORTERS", "Point", "ReportedMetrics"]
