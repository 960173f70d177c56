"""The node health job as the test and the bench run it: three nodes, one throttled before training, one during.

The torch ledger job (tests/trainers/ledger_train.py) on a Kafka topic, one worker per node, each step
``STEP_CPU_MS`` ms of CPU then a wait to ``STEP_SECONDS`` (``--step-cpu-ms``): a healthy node keeps that
period whatever the machine's load while its share of a core stays above its CPU per period (30 ms of
CPU, plus the step's own ~5-10 ms, per 200 ms: a fifth of a core), while a node held to 10% of a core
takes at least 350 ms a step (a 10 ms slice of each 100 ms).
So the *healthy rate* is about one step per period, measured in the same run before the throttle, and a
replaced straggler brings the job back to it.

The job runs in a CPU group weighted as ``JOB_WEIGHT`` processes, the throttled nodes in 10% groups inside it:
nodes are machines of their own, which no unrelated work starves. Without it, on a development machine that
ran other suites at a load of 16-24, a healthy node's thread got less than the throttled node's 10% of a core
(its probe was slower than the throttled one's), and no comparison between nodes can find a node that is
not slower. On CI the job runs alone and the weight changes nothing.

Thresholds: a node held to 10% of a core is busy 10x its CPU time; a healthy rank is busy its CPU time
times the machine's contention (how many runnable threads share the 2 cores: this project's dev machines
run several test suites at once, a load of 16 was seen, and there a healthy thread gets ~0.25 core, so the
throttled one is only ~2.5x slower). The test flags a straggler above 1.5x (the product's default is 2x,
for nodes that are machines of their own; measured 2.1-8.2x under that load: at run time the node's reader
and gloo threads share its quota with the training thread) and fails a node check above the default 2x (the
throttled node measured 2.5-7.3x; healthy nodes probing with it 0.5-1.3x; a healthy late node, compared with
probes taken under another moment's load, up to 1.9x: a false positive there costs a relaunch, so the test
asserts that n2 failed and that every node that trained passed, not which ids the slots ended with).

:func:`run_health_job` drives it: the job starts with ``health.node_check``; node ``n2``'s agent is put
into a 10% CPU cgroup as soon as it is launched (it fails the check and is relaunched as ``n2.1``); once
the group has trained ``HEALTHY_SECONDS`` it throttles ``n1`` and times the straggler verdict, the
replacement and the recovered rate, then waits for the job to end and returns what it saw.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.health.throttle import CpuThrottle, tree
from tests.helpers import wait_until
from tests.operator.runner import RunningJob, kafka_topic, ledger_spec

STEP_SECONDS = 0.2
STEP_CPU_MS = 30.0
BATCH = 32
RECORDS = 20_000  # 12 s healthy, the throttled phase, >= 8 s after the replacement, at most 3 x 32 / 0.2 s
CHECK_THRESHOLD = 2.0  # the product's default
STRAGGLER_THRESHOLD = 1.5
HEALTHY_SECONDS = 12.0
THROTTLE = 0.10  # of one core
JOB_WEIGHT = 8  # the job's CPU weight: 8 processes' worth


def health_spec(name: str, broker: Any, out: Path, policy: str = "replace") -> dict[str, Any]:
    """The job's spec (see the module docstring) on a fresh topic of ``RECORDS`` records."""
    topic = kafka_topic(broker, RECORDS)
    spec = ledger_spec(name, f"kafka://{broker.bootstrap}/{topic}", RECORDS, out, nodes="3:3", nproc_per_node=1)
    args = spec["trainer"]["args"]
    args[args.index("--batch-size") + 1] = BATCH
    args += ["--step-seconds", STEP_SECONDS, "--step-cpu-ms", STEP_CPU_MS, "--step-times"]
    spec["datasets"][0]["records_per_shard"] = 512
    spec["health"] = {"node_check": True, "node_check_threshold": CHECK_THRESHOLD, "straggler_policy": policy,
                      "straggler_threshold": STRAGGLER_THRESHOLD, "straggler_window_seconds": 10,
                      "hang_timeout_seconds": 30}  # fmt: skip
    return spec


def steps(out: Path) -> list[tuple[int, float]]:
    """Rank 0's (step, unix time) lines, every attempt's."""
    path = out / "steps.txt"
    lines = path.read_text().splitlines() if path.exists() else []
    return [(int(s), float(t)) for s, t in (line.split() for line in lines if line.count(" ") == 1)]


def rate(out: Path, start: float, end: float) -> tuple[float, int]:
    """(steps per second, steps) of rank 0's steps stamped in ``[start, end]``."""
    inside = [t for _, t in steps(out) if start <= t <= end]
    if len(inside) < 2:
        return 0.0, len(inside)
    return (len(inside) - 1) / (inside[-1] - inside[0]), len(inside)


@dataclass
class HealthRun:
    """What :func:`run_health_job` saw (times are unix seconds)."""

    check: dict[str, dict[str, Any]] = field(default_factory=dict)  # node -> its node check result
    throttled_at: float = 0.0
    throttled_node: str = ""  # the node throttled during training
    flagged_after: float = 0.0  # seconds from the throttle to the straggler event
    replaced_after: float = 0.0  # ... to the first step of the group with the replacement
    healthy_rate: float = 0.0
    throttled_rate: float = 0.0
    recovered_rate: float = 0.0
    straggler_event: str = ""
    status: dict[str, Any] = field(default_factory=dict)
    exit_code: int | None = None


def _event(job: RunningJob, kind: str, node: str) -> dict[str, Any] | None:
    return next((e for e in job.status().get("events", []) if e["kind"] == kind and e["node"] == node), None)


def _training(job: RunningJob) -> list[dict[str, Any]]:
    """The job's current nodes whose workers run, by slot."""
    return [n for n in job.status().get("nodes", []) if n["state"] == "running" and n.get("workers")]


def _group_first_step_after(out: Path, t0: float) -> float | None:
    """When the first group started after ``t0`` trained its first step (rank 0's ``# first step at`` lines)."""
    path = out / "loss.txt"
    lines = path.read_text().splitlines() if path.exists() else []
    firsts = [float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("# first step at ")]
    return next((t for t in firsts if t > t0), None)


def _first_step_after(out: Path, t0: float) -> float | None:
    return next((t for _, t in steps(out) if t > t0), None)


def run_health_job(job: RunningJob) -> HealthRun:
    """Run the job of :func:`health_spec` through both throttles (module docstring); the caller stops ``job``."""
    seen = HealthRun()
    pidfile = job.dir.path / "logs" / "pids" / "node-n2"
    # The job (controller, master, nodes: everything this process starts now) in a group weighted as 8 processes:
    # as nodes on machines of their own, no other work on a shared test machine starves the healthy ones (at a
    # load of 16-24 from other suites, a healthy thread got less than the throttled node's 10% of a core).
    job_group = CpuThrottle(None, weight=JOB_WEIGHT)
    throttles = [CpuThrottle(THROTTLE, parent=job_group), CpuThrottle(THROTTLE, parent=job_group), job_group]
    try:
        job_group.add(os.getpid())
        try:
            job.start()
        finally:
            job_group.root.joinpath("cgroup.procs").write_text(str(os.getpid()))
        # n2's agent is still importing torch when its pid is recorded: into the cgroup before it can probe
        wait_until(lambda: pidfile.exists() and pidfile.read_text().split(), 120, "node n2 launched", interval=0.02)
        throttles[0].add(*tree(int(pidfile.read_text().split()[0])))
        wait_until(lambda: _event(job, "node-check", "n2") is not None, 240, "n2 to fail its node check")
        wait_until(lambda: len(_training(job)) == 3, 240, "three nodes training")
        wait_until(lambda: _first_step_after(job.out, time.time() - 1) is not None, 120, "the group stepping")
        first = steps(job.out)[-1][1]
        wait_until(lambda: steps(job.out)[-1][1] >= first + HEALTHY_SECONDS, 120, "a healthy phase")
        seen.throttled_at = time.time()
        node = _training(job)[1]  # slot 1's node (n1, unless a check relaunched it)
        seen.throttled_node = node["node_id"]
        throttles[1].add(*tree(node["pid"]))
        wait_until(lambda: _event(job, "straggler", node["node_id"]) is not None, 120, "the throttled node flagged")
        event = _event(job, "straggler", node["node_id"])
        assert event is not None
        seen.flagged_after, seen.straggler_event = event["at"] - seen.throttled_at, event["message"]
        wait_until(lambda: _event(job, "scale-in", node["node_id"]) is not None, 60, "the straggler replaced")
        replaced = _event(job, "scale-in", node["node_id"])
        assert replaced is not None
        wait_until(lambda: _group_first_step_after(job.out, replaced["at"]) is not None, 240,
                   "the group with the replacement stepping")  # fmt: skip
        recovered = _group_first_step_after(job.out, replaced["at"])
        assert recovered is not None
        seen.replaced_after = recovered - seen.throttled_at
        seen.exit_code = job.wait(timeout=400)
        seen.status = job.status()
        seen.healthy_rate, _ = rate(job.out, seen.throttled_at - HEALTHY_SECONDS + 2, seen.throttled_at)
        seen.throttled_rate, _ = rate(job.out, seen.throttled_at + 2, replaced["at"])
        end = steps(job.out)[-1][1]
        seen.recovered_rate, _ = rate(job.out, recovered + 3, end - 1)
        nodes = seen.status.get("nodes", []) + seen.status.get("ended_nodes", [])
        seen.check = {n["node_id"]: n["node_check"] for n in nodes if n.get("node_check")}
        return seen
    finally:
        for throttle in throttles:
            throttle.close()
