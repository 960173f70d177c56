"""Runtime straggler detection: which node's ranks compute slower than the others', for how long.

Every rank of a torch job reports its pace every couple of seconds (``session.step_done`` through
:class:`~streamrover.trainers.torch.pace.StepPace`, reporter ``rank<R>@<node>``): the mean **busy** seconds
per step of its training thread (running or runnable: time outside collectives) and the mean wall seconds
per step. In synchronous data parallelism the wall time per step is the same on every rank (the slowest
sets it), so the busy time is what tells the nodes apart.

A rank's busy time is the mean of its reports of the last ``smooth`` seconds (three reports by default:
one step's noise on a shared machine does not decide); a node's is its slowest rank's. A rank silent for
``stale_after`` seconds is dropped (a node that left, a group restarting). A node's **ratio** is its busy
time over the median of the other nodes'. A node whose ratio stays above ``threshold`` for ``window``
seconds (every evaluation in that time, at each report) is a **straggler**; one evaluation at or below the
threshold starts the count again. So a node that became slow is flagged within ``smooth + window`` seconds
plus a report interval (with the defaults, 6 + 30 + 2 s).

The watch is in memory, like the reports it reads; a restarted master starts it again.
"""

from __future__ import annotations

import re
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from streamrover.shard_service.v1 import shard_service_pb2 as pb

BUSY, WALL = "step_busy_s", "step_wall_s"
DEFAULT_THRESHOLD = 2.0
DEFAULT_WINDOW = 30.0
_RANK = re.compile(r"rank(?P<rank>\d+)@(?P<node>.+)")


@dataclass
class NodePace:
    """One node's pace and the evidence for its verdict."""

    node: str
    busy_per_step: float  # its slowest rank's busy seconds per step (the mean of its reports of the last smooth s)
    wall_per_step: float  # the step's wall time as its ranks see it
    ranks: int
    median_others: float | None = None  # the other nodes' median busy seconds per step
    ratio: float | None = None
    beyond_since: float | None = None  # since when the ratio has stayed above the threshold (unix time)
    straggler: bool = False

    def beyond_seconds(self, now: float) -> float:
        """How long the ratio has stayed above the threshold."""
        return now - self.beyond_since if self.beyond_since is not None else 0.0


@dataclass
class _Rank:
    busy: float
    wall: float
    at: float


@dataclass
class StragglerWatch:
    """Per-node pace from the ranks' reports, and the straggler verdicts (see the module docstring)."""

    threshold: float = DEFAULT_THRESHOLD
    window: float = DEFAULT_WINDOW
    stale_after: float = 15.0
    smooth: float = 6.0
    clock: Callable[[], float] = time.time
    _ranks: dict[tuple[str, int], list[_Rank]] = field(default_factory=dict)
    _since: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.threshold <= 1.0:
            raise ValueError(f"straggler threshold {self.threshold}: must be more than 1 (a ratio to the median)")
        if self.window < 0:
            raise ValueError(f"straggler window {self.window}: must be >= 0 seconds")

    def observe(self, reporter: str, values: Mapping[str, float]) -> None:
        """A report of ``reporter``; only a rank's pace report (``rank<R>@<node>`` with ``step_busy_s``) counts."""
        found = _RANK.fullmatch(reporter)
        if found is None or BUSY not in values:
            return
        now = self.clock()
        with self._lock:
            reports = self._ranks.setdefault((found["node"], int(found["rank"])), [])
            reports.append(_Rank(values[BUSY], values.get(WALL, 0.0), now))
            reports[:] = [r for r in reports if now - r.at <= self.smooth] or reports[-1:]
            self._evaluate(now)

    def _evaluate(self, now: float) -> list[NodePace]:
        for key in [k for k, rs in self._ranks.items() if now - rs[-1].at > self.stale_after]:
            del self._ranks[key]
        nodes: dict[str, list[tuple[float, float]]] = {}
        for (node, _), reports in self._ranks.items():
            n = len(reports)
            nodes.setdefault(node, []).append((sum(r.busy for r in reports) / n, sum(r.wall for r in reports) / n))
        paces = {n: NodePace(n, max(b for b, _ in rs), max(w for _, w in rs), len(rs)) for n, rs in nodes.items()}
        for node in list(self._since):
            if node not in paces:
                del self._since[node]
        for node, pace in paces.items():
            others = [p.busy_per_step for n, p in paces.items() if n != node]
            if others:
                pace.median_others = statistics.median(others)
                pace.ratio = pace.busy_per_step / max(pace.median_others, 1e-9)
            if pace.ratio is not None and pace.ratio > self.threshold:
                self._since.setdefault(node, now)
            else:
                self._since.pop(node, None)
            pace.beyond_since = self._since.get(node)
            pace.straggler = pace.beyond_since is not None and now - pace.beyond_since >= self.window
        return sorted(paces.values(), key=lambda p: p.node)

    def paces(self) -> list[NodePace]:
        """Every node's pace now, by node."""
        with self._lock:
            return self._evaluate(self.clock())


def paces_pb(watch: StragglerWatch) -> list[pb.NodePace]:
    """Every node's pace as the Status RPC carries it."""
    now = time.time()
    return [
        pb.NodePace(node=p.node, busy_per_step=p.busy_per_step, wall_per_step=p.wall_per_step, ranks=p.ranks,
                    median_others=p.median_others or 0.0, ratio=p.ratio or 0.0, beyond_seconds=p.beyond_seconds(now),
                    straggler=p.straggler, threshold=watch.threshold, window_seconds=watch.window)
        for p in watch.paces()
    ]


__all__ = ["DEFAULT_THRESHOLD", "DEFAULT_WINDOW", "NodePace", "StragglerWatch", "paces_pb"]
