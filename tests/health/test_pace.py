"""The pieces of node health without a job: busy time under a real CPU quota, the straggler watch, the check's
verdict, and the supervisor's decisions (against tests/operator/test_supervisor.py's scripted platform)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from streamrover.operator.api import NodeState
from streamrover.operator.supervisor import NODE_CHECK_EXIT
from streamrover.shard_service.master.stragglers import StragglerWatch
from streamrover.trainers.torch import pace as pace_module
from streamrover.trainers.torch.pace import StepPace
from tests.health.throttle import CpuThrottle
from tests.operator.test_supervisor import _supervisor

# one process: a fixed amount of CPU work, then a sleep; busy (pace.thread_busy) and wall around both
_PROBE = """
import importlib.util, json, sys, time
spec = importlib.util.spec_from_file_location("pace", sys.argv[1])  # pace.py alone: no torch to import throttled
pace = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pace)
thread_busy = pace.thread_busy
sys.stdin.readline()  # the test moves this process into its cgroup first
t0, b0, c0 = time.monotonic(), thread_busy(), time.thread_time()
x = 0
while time.thread_time() - c0 < 0.2:
    x += 1
time.sleep(0.5)
print(json.dumps({"wall": time.monotonic() - t0, "busy": thread_busy() - b0, "cpu": time.thread_time() - c0}))
"""


def _probe(throttle: CpuThrottle | None) -> dict[str, float]:
    cmd = [sys.executable, "-c", _PROBE, pace_module.__file__]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if throttle is not None:
        throttle.add(proc.pid)
    out, _ = proc.communicate("go\n", timeout=60)
    assert proc.returncode == 0
    return dict(json.loads(out))


def test_busy_time_counts_a_cpu_quota_and_no_sleep() -> None:
    """A thread's busy time is its time on a CPU plus its time runnable, which a cgroup's CPU quota stretches: 0.2 s
    of CPU under a 10% quota (10 ms per 100 ms) is at least ~1.8 s busy, whatever the machine's load; a sleep is
    never busy. (cgroup v1 ``cpu.cfs_quota_us`` on this project's machines; v2 ``cpu.max`` where mounted.)"""
    free = _probe(None)
    with CpuThrottle(0.10) as throttle:
        slow = _probe(throttle)
        held = throttle.throttled_seconds()
    print(f"free {free}, throttled {slow} (held back {held:.2f} s; cgroup v{throttle.version})")
    assert free["busy"] < free["wall"] - 0.45, "the 0.5 s sleep is not busy"
    assert slow["busy"] < slow["wall"] - 0.45
    assert slow["busy"] >= 5 * slow["cpu"], "a 10% quota makes 0.2 s of CPU take >= 1.8 s (asserted: 1.0 s)"
    assert held > 0.5


def test_step_pace_reports_means_per_window() -> None:
    now, busy, reports = [0.0], [0.0], []
    pace = StepPace(lambda values, step: reports.append((dict(values), step)), every=2.0,
                    clock=lambda: now[0], busy=lambda: busy[0])  # fmt: skip
    for step in range(1, 5):
        now[0] += 0.5
        busy[0] += 0.1
        pace.step_done(step)
    assert reports == [({"step_busy_s": pytest.approx(0.1), "step_wall_s": pytest.approx(0.5), "steps": 4.0}, 4)]


def _report(watch: StragglerWatch, busy: dict[str, float]) -> None:
    for node, value in busy.items():
        for rank in (0, 1):
            watch.observe(f"rank{rank}@{node}", {"step_busy_s": value * (1 + rank / 10), "step_wall_s": 0.2})


def test_a_node_is_a_straggler_once_beyond_the_threshold_for_the_window() -> None:
    now = [1000.0]
    watch = StragglerWatch(threshold=2.0, window=10.0, stale_after=15.0, smooth=0.0, clock=lambda: now[0])
    watch.observe("controller:x", {"step_busy_s": 9.0})  # not a rank: ignored
    watch.observe("rank0@n0", {"loss": 0.1})  # a rank's other metric: ignored
    _report(watch, {"n0": 0.01, "n1": 0.012, "n2": 0.05})
    (n0, _, n2) = watch.paces()
    assert n2.ratio == pytest.approx(0.055 / 0.0121) and n2.median_others == pytest.approx(0.0121)
    assert n2.beyond_since == 1000.0 and not n2.straggler and not n0.straggler
    now[0] = 1009.0
    _report(watch, {"n0": 0.01, "n1": 0.012, "n2": 0.05})
    assert not watch.paces()[2].straggler, "9 s beyond: not yet the 10 s window"
    now[0] = 1010.0
    _report(watch, {"n0": 0.01, "n1": 0.012, "n2": 0.05})
    assert [p.straggler for p in watch.paces()] == [False, False, True]
    now[0] = 1012.0
    _report(watch, {"n0": 0.01, "n1": 0.012, "n2": 0.02})  # 1.8x: within the threshold, the count starts again
    assert [p.beyond_since for p in watch.paces()] == [None, None, None]
    now[0] = 1030.0  # n1 went silent (left): its reports are stale, the others compare with n0 alone
    watch.observe("rank0@n0", {"step_busy_s": 0.01})
    watch.observe("rank0@n2", {"step_busy_s": 0.05})
    assert [(p.node, p.ratio) for p in watch.paces()] == [("n0", pytest.approx(0.2)), ("n2", pytest.approx(5.0))]
    with pytest.raises(ValueError, match="must be more than 1"):
        StragglerWatch(threshold=1.0)


def test_a_ranks_busy_time_is_the_mean_of_its_recent_reports() -> None:
    now = [0.0]
    watch = StragglerWatch(smooth=6.0, clock=lambda: now[0])
    for t, busy in ((0, 0.9), (2, 0.1), (4, 0.2), (6, 0.3), (8, 0.4)):
        now[0] = t
        watch.observe("rank0@n0", {"step_busy_s": busy})
    (pace,) = watch.paces()
    assert pace.busy_per_step == pytest.approx(0.25), "the reports of the last 6 s: 0.1, 0.2, 0.3, 0.4"
    assert pace.ratio is None and not pace.straggler, "no other node to compare with"


def _pace(node: str, straggler: bool, ratio: float = 5.0) -> dict[str, Any]:
    return {"node": node, "busy_per_step": 0.05, "wall_per_step": 0.2, "ranks": 1, "median_others": 0.01,
            "ratio": ratio, "beyond_seconds": 12.0, "straggler": straggler, "threshold": 2.0, "window_seconds": 10.0}


def test_replace_policy_launches_a_new_node_and_the_straggler_leaves() -> None:
    sup, platform = _supervisor(trainer={"script": "/t.py", "nodes": "3:3"},
                                health={"straggler_policy": "replace", "hang_timeout_seconds": 20})  # fmt: skip
    assert "--hang-timeout" in platform.launches[0].command and "--node-check" not in platform.launches[0].command
    sup.observe_paces([_pace("n0", False, 0.5), _pace("n1", True), _pace("elsewhere", True)])
    assert [launch.node_id for launch in platform.launches] == ["n0", "n1", "n2", "n1.1"]
    assert platform.stops == ["n1"] and sup.replacements == 1 and sup.relaunches == 1
    sup.observe_paces([_pace("n1", True)])  # its last reports are not stale yet: not replaced twice
    sup.tick()
    assert len(platform.launches) == 4 and platform.stops == ["n1"]
    doc = sup.status()
    assert [n["node_id"] for n in doc["nodes"]] == ["n0", "n1.1", "n2"]
    assert doc["stragglers"]["nodes"][0]["node"] == "n1" and doc["stragglers"]["policy"] == "replace"
    events = [(e.kind, e.node) for e in sup.events]
    assert ("straggler", "n1") in events and ("scale-in", "n1") in events and ("straggler", "elsewhere") not in events
    assert "5.0x the other nodes' median" in next(e.message for e in sup.events if e.kind == "straggler")


def test_report_policy_only_reports() -> None:
    sup, platform = _supervisor(trainer={"script": "/t.py", "nodes": "2:2"})
    sup.observe_paces([_pace("n1", True)])
    assert len(platform.launches) == 2 and not platform.stops
    assert [e.kind for e in sup.events if e.node == "n1"] == ["launch", "straggler"]


def test_a_node_that_failed_its_check_is_relaunched_with_the_evidence() -> None:
    check = {"compute_s": 1.5, "ratio": 9.7, "median_s": 0.155, "peers": 2, "threshold": 2.0, "passed": False}
    sup, platform = _supervisor(health={"node_check": True, "node_check_threshold": 3})
    assert platform.launches[0].command[platform.launches[0].command.index("--node-check-threshold") + 1] == "3.0"
    sup.health = lambda run_id, node_id: {"heartbeat_at": 1.0, "node_check": check} if node_id == "n0" else None
    platform.set("n0", NodeState.FAILED, NODE_CHECK_EXIT)
    sup.tick()
    assert platform.launches[-1].node_id == "n0.1"
    (event,) = [e for e in sup.events if e.kind == "node-check"]
    assert event.node == "n0" and "compute probe 1.500 s, 9.7x the median 0.155 s of 2 peers" in event.message
    assert sup.status()["ended_nodes"][0]["node_check"] == check


def test_the_node_checks_probes_and_verdict() -> None:
    from streamrover.trainers.torch.nodecheck import CheckResult, collective_probe, compute_probe, judge

    assert compute_probe(size=64, repeats=5) > 0
    assert collective_probe("127.0.0.1", floats=1024, repeats=3, timeout=30) > 0  # two gloo members, really summing
    peers = [CheckResult("a", 0.10, 0.01), CheckResult("b", 0.12, 0.01), CheckResult("c", 0.9, 0.01, passed=False)]
    slow = judge(CheckResult("d", 0.25, 0.01), peers, threshold=2.0)
    assert not slow.passed and slow.peers == 2 and slow.median_s == pytest.approx(0.11), "c failed: left out"
    assert "2.27x the median 0.110 s of 2 peers" in slow.describe()
    assert judge(CheckResult("e", 0.2, 0.01), peers, threshold=2.0).passed
    alone = judge(CheckResult("f", 5.0, 0.01), [], threshold=2.0)
    assert alone.passed and alone.ratio is None, "no peer to compare with: nothing to judge"
    broken = judge(CheckResult("g", error="gloo all-reduce on 127.0.0.1: Connection refused"), peers, 2.0)
    assert not broken.passed and broken.describe().startswith("probe failed: gloo")
