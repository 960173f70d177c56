"""Node health on the local platform with real processes, a real CPU quota (cgroup) and Kafka.

* three nodes, ``health.node_check``: node n2's agent held to 10% of a core from its launch fails the
  pre-flight check before any rendezvous counts it and is relaunched as n2.1; then n1 is throttled during
  training: the master flags it within 60 s, ``straggler_policy: replace`` relaunches it as n1.1 and the
  job's step rate comes back to >= 0.9x the healthy rate measured before the throttle (module docstring of
  tests/health/job.py for why that rate is the period's); the ledger is exact;
* one worker SIGSTOPped mid-step: the agents' hang watch (``hang_timeout_seconds``) kills the stuck group
  and it restarts from the newest checkpoint within 60 s; the ledger is exact.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.health.job import RECORDS, health_spec, run_health_job
from tests.helpers import wait_until
from tests.operator.runner import RunningJob, kafka_topic, ledger_spec

pytestmark = pytest.mark.slow


def _assert_exact(job: RunningJob, records: int) -> None:
    ledger = job.ledger()
    assert ledger is not None, job.logs()
    assert ledger.shape == (records,) and np.all(ledger == 1), (
        f"{int((ledger == 0).sum())} missing, {int((ledger > 1).sum())} duplicated\n{job.logs()}"
    )


def test_a_throttled_node_fails_the_check_and_a_straggler_is_replaced(tmp_path: Path, kafka_broker: Any) -> None:
    job = RunningJob(tmp_path, health_spec("health", kafka_broker, tmp_path / "out"))
    try:
        seen = run_health_job(job)
        checks = [(n, c["compute_s"], c["ratio"], c["passed"], c["cost_s"]) for n, c in seen.check.items()]
        print(f"node checks (node, compute s, ratio, passed, cost s): {checks}")
        print(f"straggler flagged {seen.flagged_after:.1f} s after the throttle ({seen.straggler_event}); replacement "
              f"stepping after {seen.replaced_after:.1f} s; steps/s healthy {seen.healthy_rate:.2f}, throttled "
              f"{seen.throttled_rate:.2f}, replaced {seen.recovered_rate:.2f}")  # fmt: skip
        assert seen.exit_code == 0, job.logs()
        assert seen.status["phase"] == "succeeded"
        check, final = seen.check, [n["node_id"] for n in seen.status["nodes"]]
        assert not check["n2"]["passed"] and check["n2"]["ratio"] > 2.0, check
        assert all(check[n]["passed"] for n in final), check
        events = [(e["kind"], e["node"]) for e in seen.status["events"]]
        assert events.index(("node-check", "n2")) < events.index(("launch", "n2.1")), "relaunched after its check"
        assert seen.flagged_after <= 60, "a throttled node is flagged within 60 s"
        assert seen.throttled_node not in final and len(final) == 3, "the straggler left, its replacement trained"
        assert seen.recovered_rate >= 0.9 * seen.healthy_rate, "the step rate is back to the healthy rate"
        _assert_exact(job, RECORDS)
    finally:
        job.stop()


HANG_RECORDS = 16_000


def test_a_stopped_worker_is_detected_and_the_group_restarts(tmp_path: Path, kafka_broker: Any) -> None:
    topic = kafka_topic(kafka_broker, HANG_RECORDS)
    out = tmp_path / "out"
    spec = ledger_spec("hang", f"kafka://{kafka_broker.bootstrap}/{topic}", HANG_RECORDS, out, nodes="2:2",
                       nproc_per_node=1)  # fmt: skip
    spec["trainer"]["args"] += ["--step-seconds", 0.1, "--step-times"]
    spec["health"] = {"hang_timeout_seconds": 15}
    job = RunningJob(tmp_path, spec)
    try:
        job.start()
        wait_until(lambda: job.running("n0") and job.running("n1"), 180, "both nodes training")
        wait_until(lambda: (out / "steps.txt").exists() and len((out / "steps.txt").read_text().split()) > 40, 120,
                   "20 steps")  # fmt: skip
        node = job.node("n1")
        assert node is not None
        (worker,) = node["workers"].values()
        os.kill(worker, signal.SIGSTOP)
        stopped = time.time()
        wait_until(lambda: any((job.node(n) or {}).get("hangs") for n in ("n0", "n1")), 60, "the hang detected")
        detected = time.time() - stopped

        def restarted() -> float | None:
            lines = (out / "loss.txt").read_text().splitlines()
            firsts = [float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("# first step at ")]
            return next((t for t in firsts if t > stopped), None)

        wait_until(lambda: restarted() is not None, 90, "the group to restart and step")
        again = (restarted() or 0.0) - stopped
        print(f"SIGSTOP -> hang seen {detected:.1f} s, -> the restarted group's first step {again:.1f} s")
        assert again <= 60, "the stuck group restarted within 60 s"
        assert job.wait(timeout=300) == 0, job.logs()
        doc = job.status()
        hung = [n for n in doc["nodes"] if n["hangs"]]
        assert hung and not any(n["node_id"] != "n0" and n["node_id"] != "n1" for n in doc["nodes"]), doc["nodes"]
        assert doc["relaunches"] == 0, "a worker-group restart, no node relaunch"
        _assert_exact(job, HANG_RECORDS)
    finally:
        job.stop()
