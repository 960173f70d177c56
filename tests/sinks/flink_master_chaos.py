"""SIGKILLs of the job master while a Flink job commits to it, for tests/sinks/test_flink.py.

:class:`MasterChaos` runs in a thread: a shuffled plan of ``random`` kills (any moment), ``mid-call`` kills
(the :class:`CutProxy` between the committer and the master forwards a ``CommitStaged`` request, then the
master is SIGKILLed before its answer) and ``reset`` cuts (the master answers, the proxy resets the
committer's connection instead); every other cut also hands the committer a garbled HTTP/2 frame. After each
kill the master restarts on the same state dir and port. Between steps it samples Flink's committer metrics.
The test's own calls to the master take :attr:`quiet` so that a kill never lands in them (the test's client
is not what is under test).
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections import Counter

from streamrover.testing.procs import MasterProcess
from tests.sinks.flink import FlinkJob
from tests.sinks.flink_proxy import CutProxy


class MasterChaos(threading.Thread):
    def __init__(
        self, master: MasterProcess, proxy: CutProxy, flink: FlinkJob, kills: int, mid_call: int, resets: int, seed: int
    ) -> None:
        super().__init__(daemon=True)
        self.master = master
        self.proxy = proxy
        self.flink = flink
        self.plan = ["mid-call"] * mid_call + ["random"] * (kills - mid_call) + ["reset"] * resets
        random.Random(seed).shuffle(self.plan)
        self.rng = random.Random(seed + 1)
        self.quiet = threading.Lock()
        self.stop = threading.Event()
        self.done: Counter[str] = Counter()  # what happened: "random", "mid-call", "reset", "missed <step>"
        self.failed_committables = 0  # the most Flink's committers counted at one sample
        self.retried_committables = 0
        self.error: BaseException | None = None
        self.cuts = 0
        self.retries = mid_call  # a mid-call cut missed (no commit came in time: a loaded machine, Flink restarting)
        # is tried again later, this many times in all, so that the run still cuts MID_CALL commits

    def run(self) -> None:
        try:
            plan = list(self.plan)
            while plan:
                step = plan.pop(0)
                if self.stop.wait(self.rng.uniform(0.1, 0.8)):  # a random point, not a synchronisation
                    return
                with self.quiet:
                    missed = self._step(step)
                if missed and step == "mid-call" and self.retries > 0:
                    self.retries -= 1
                    plan.append(step)
                self._sample()
        except BaseException as exc:  # reported by the test
            self.error = exc

    def _step(self, step: str) -> bool:
        """Run one step of the plan; True when it was a cut that no commit came to take."""
        missed = False
        if step == "random":
            self.master.kill()
        else:
            self.cuts += 1  # alternately a plain cut and one where the committer reads a garbled frame
            mode = ("kill" if step == "mid-call" else "reset") + ("-garble" if self.cuts % 2 else "")
            fired = self.proxy.arm(mode.replace("reset-garble", "garble"), self.master.kill)
            if not fired.wait(30):
                taken = not self.proxy.disarm()
                if not (taken and fired.wait(30)):  # no commit came: kill at this random point instead
                    self.done[f"missed {step}"] += 1
                    missed = True
                    step = "random" if step == "mid-call" else "missed"
                    if step == "random":
                        self.master.kill()
        self.done[step] += 1
        if self.master.proc is not None and self.master.proc.poll() is not None:
            started = time.monotonic()
            self.master.start()
            print(f"master chaos: {step}: restarted in {time.monotonic() - started:.1f} s", file=sys.stderr)
        return missed

    def _sample(self) -> None:
        try:
            failed = self.flink.committer_metric("failedCommittables")
            retried = self.flink.committer_metric("retriedCommittables")
        except (OSError, KeyError, ValueError):  # the job is restarting or resubmitted: the next sample reads it
            return
        self.failed_committables = max(self.failed_committables, failed or 0)
        self.retried_committables = max(self.retried_committables, retried or 0)

    def kills(self) -> int:
        return self.done["random"] + self.done["mid-call"]
