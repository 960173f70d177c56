"""A rank's pace as the master's straggler watch needs it, and its progress mark for the agent's hang watch.

**Busy time, not step time.** In synchronous data parallelism every rank's step takes as long as the
slowest rank's: the others wait for it in the step's collectives. What differs between ranks is the time
each is *not* waiting: its compute. A thread blocked in a collective (gloo waits on a condition variable
or a socket) is neither running nor runnable, so the time a thread was running or runnable is its time
outside collectives. Linux counts both per thread (``/proc/thread-self/schedstat``: time on a CPU, time
waiting in the run queue); a CPU quota's throttled time counts as run-queue time (a node throttled to 10%
by its cgroup is busy 10x longer for the same work), and a slower CPU shows as more time on it. Sleeps,
I/O waits and collective waits count in neither. Where there is no schedstat (not Linux) the thread's CPU
time stands in (it misses throttling and CPU contention).

:class:`StepPace` accumulates, per step, the training thread's busy and wall seconds, and every
``every`` seconds reports their means (``step_busy_s``, ``step_wall_s``, ``steps``) to the master, which
compares the nodes (:mod:`streamrover.shard_service.master.stragglers`).

:class:`ProgressMark`: a worker under ``dlrover-run --hang-timeout`` touches a file (at most every
``MARK_EVERY`` s) each time it completes a collective round or a step; the agent restarts the worker group
when a worker's mark stops moving (:mod:`streamrover.trainers.torch.agent`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path

log = logging.getLogger(__name__)
REPORT_EVERY = 2.0  # seconds between a rank's pace reports to the master
MARK_EVERY = 0.5  # seconds between touches of a worker's progress file (an upper bound on the mark's age)
_SCHEDSTAT = Path("/proc/thread-self/schedstat")


def thread_busy() -> float:
    """Seconds the calling thread has been running or runnable (see the module docstring)."""
    try:
        on_cpu, queued, _ = _SCHEDSTAT.read_text().split()
        return (int(on_cpu) + int(queued)) / 1e9
    except (OSError, ValueError):
        return time.thread_time()


class StepPace:
    """Busy and wall seconds per step of the calling thread, reported as means every ``every`` seconds."""

    def __init__(self, report: Callable[[Mapping[str, float], int], None], every: float = REPORT_EVERY,
                 clock: Callable[[], float] = time.monotonic, busy: Callable[[], float] = thread_busy) -> None:
        self._report, self.every, self._clock, self._busy = report, every, clock, busy
        self._window_start = clock()
        self._last_wall, self._last_busy = self._window_start, busy()
        self.steps = 0
        self.busy = 0.0
        self.wall = 0.0

    def step_done(self, step: int) -> None:
        """One step ended at ``step``; report the window's means when it is ``every`` seconds old."""
        now, busy = self._clock(), self._busy()
        self.steps += 1
        self.wall += now - self._last_wall
        self.busy += busy - self._last_busy
        self._last_wall, self._last_busy = now, busy
        if now - self._window_start >= self.every:
            values = {"step_busy_s": self.busy / self.steps, "step_wall_s": self.wall / self.steps,
                      "steps": float(self.steps)}  # fmt: skip
            self.steps, self.busy, self.wall, self._window_start = 0, 0.0, 0.0, now
            try:
                self._report(values, step)
            except Exception as exc:  # the pace is advisory: a master restarting must not fail the step
                log.warning("could not report this rank's pace: %s", exc)

    def restart(self) -> None:
        """Forget the time since the last step (a checkpoint restore or a pause that is not a step's)."""
        self._last_wall, self._last_busy = self._clock(), self._busy()


class ProgressMark:
    """Touches ``path`` when progress is made, at most every ``every`` seconds (its mtime is the newest progress)."""

    def __init__(self, path: Path, every: float = MARK_EVERY) -> None:
        self.path = path
        self.every = every
        self._last = -every

    def __call__(self) -> None:
        now = time.monotonic()
        if now - self._last < self.every:
            return
        self._last = now
        try:
            os.utime(self.path)
        except FileNotFoundError:
            self.path.touch()
        except OSError as exc:  # the agent's directory gone (it is exiting): nothing to tell it
            log.debug("progress mark %s: %s", self.path, exc)


def progress_mark(directory: str | None, local_rank: str | None) -> ProgressMark | None:
    """The worker's mark in the agent's progress ``directory`` (None when the agent watches no hangs)."""
    if not directory or local_rank is None:
        return None
    return ProgressMark(Path(directory) / f"progress-{local_rank}")


def progress_ages(directory: Path, now: float | None = None) -> dict[int, float]:
    """Local rank -> seconds since that worker's newest progress mark (workers that marked this attempt)."""
    now = time.time() if now is None else now
    out = {}
    for path in directory.glob("progress-*"):
        try:
            out[int(path.name.split("-", 1)[1])] = max(now - path.stat().st_mtime, 0.0)
        except (OSError, ValueError):
            continue
    return out
