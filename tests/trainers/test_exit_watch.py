"""The agent's exit watch: a worker's death wakes the monitor loop at once, not at the next ``--monitor-interval``;
torchelastic's waits for the workers it stops return when they exit, not at Popen's next poll."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from streamrover.trainers.torch.agent import ExitWatch, PidfdPopen


def test_a_worker_exit_wakes_the_monitor_once_and_otherwise_it_waits_the_interval() -> None:
    workers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(2)]
    watch = ExitWatch()
    try:
        watch.watch([w.pid for w in workers])
        started = time.monotonic()
        watch.wait(0.2)
        assert time.monotonic() - started >= 0.2, "no worker exited: the whole interval"
        workers[1].kill()
        started = time.monotonic()
        watch.wait(60)
        assert time.monotonic() - started < 30, "the exit woke the wait (a 60 s interval otherwise)"
        assert workers[1].poll() == -9, "the dead worker is reaped by whoever polls it (torchelastic)"
        started = time.monotonic()
        watch.wait(0.2)
        assert time.monotonic() - started >= 0.2, "an exit wakes the monitor once, it does not spin after it"
    finally:
        watch.close()
        for w in workers:
            w.kill()
            w.wait()


def test_a_worker_s_popen_wait_returns_its_exit_code_or_times_out_as_popen_does() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    proc.__class__ = PidfdPopen  # what the agent does to the Popen objects of the workers it starts
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.1)  # still running
        assert proc.stdin is not None
        proc.stdin.close()  # the child reads EOF and exits
        assert proc.wait(60) == 0 and proc.returncode == 0
        assert proc.wait(0.1) == 0, "a reaped process answers at once"
    finally:
        proc.kill()
        proc.wait()
