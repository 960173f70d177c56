"""``streamrover run`` on the local platform: the torch ledger job from a Kafka topic, supervised.

* a node's agent SIGKILLed mid-run: the supervisor relaunches the node (a new id), the
  group re-rendezvouses, rank 0 restores the newest checkpoint; the ledger is exact;
* a worker allocates past its node's memory limit (a memory cgroup here): the kernel's OOM
  killer kills it, the supervisor relaunches the node with more memory; the ledger is exact;
* with no node relaunches left, a lost node fails the job with the reason in ``status``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers import wait_until
from tests.operator.runner import RunningJob, kafka_topic, ledger_spec, produce

pytestmark = pytest.mark.slow
RECORDS = 40_000


def _assert_exact(job: RunningJob) -> None:
    ledger = job.ledger()
    assert ledger is not None, job.logs()
    assert ledger.shape == (RECORDS,) and np.all(ledger == 1), (
        f"{int((ledger == 0).sum())} missing, {int((ledger > 1).sum())} duplicated\n{job.logs()}"
    )


def test_a_lost_node_is_relaunched_and_the_ledger_is_exact(tmp_path: Path, kafka_broker: Any) -> None:
    topic = kafka_topic(kafka_broker, RECORDS)
    spec = ledger_spec("lost-node", f"kafka://{kafka_broker.bootstrap}/{topic}", RECORDS, tmp_path / "out",
                       nodes="2:2")  # fmt: skip
    job = RunningJob(tmp_path, spec)
    try:
        job.start()
        wait_until(lambda: job.running("n0") and job.running("n1"), 180, "both nodes training")
        wait_until(lambda: job.acked() >= 0.3 * RECORDS, 240, "30% of the records acked")
        killed = job.kill_agent("n1")
        started = time.monotonic()
        wait_until(lambda: job.node("n1.1") is not None, 60, "the supervisor to relaunch n1")
        relaunched = time.monotonic() - started
        wait_until(lambda: job.running("n1.1"), 180, "n1.1 training")
        print(f"SIGKILL -> relaunched {relaunched:.2f} s, -> its workers running {time.monotonic() - started:.2f} s")
        assert job.wait(timeout=300) == 0, job.logs()
        doc = job.status()
        assert doc["phase"] == "succeeded", job.logs()
        assert doc["relaunches"] == 1
        lost = [e for e in doc["events"] if e["node"] == "n1" and e["kind"] == "lost"]
        assert lost and "SIGKILL" in lost[0]["message"], doc["events"]
        ended = {n["node_id"]: n for n in doc["ended_nodes"]}
        assert ended["n1"]["pid"] == killed and ended["n1"]["state"] == "lost"
        _assert_exact(job)
    finally:
        job.stop()


def test_an_oom_killed_node_is_relaunched_with_more_memory(tmp_path: Path, kafka_broker: Any) -> None:
    topic = kafka_topic(kafka_broker, 0)
    ids = np.arange(RECORDS)
    # the other half once the node is relaunched: training cannot end before the hog has filled the node (with the
    # whole topic there, a fast run once trained it all in the seconds between the trigger and the OOM kill)
    produce(kafka_broker, topic, ids[: RECORDS // 2])
    hog = tmp_path / "hog"
    spec = ledger_spec("oom", f"kafka://{kafka_broker.bootstrap}/{topic}", RECORDS, tmp_path / "out",
                       nodes=1, nproc_per_node=1, memory="1536Mi")  # fmt: skip
    spec["trainer"]["launcher_args"] += ["--standby-workers", "0"]  # a smaller node: agent + one worker
    spec["restart"] = {"oom": {"factor": 2, "max_memory": "3Gi"}}
    job = RunningJob(tmp_path, spec, env={"HOG_FILE": str(hog), "HOG_MB": "1024"})
    try:
        job.start()
        wait_until(lambda: job.running("n0"), 180, "the node training")
        assert job.status()["memory_enforcement"] in ("cgroup-v1", "cgroup-v2", "watchdog")
        wait_until(lambda: job.acked() >= 0.3 * RECORDS, 240, "30% of the records acked")
        hog.touch()  # rank 0 now holds 1 GiB more: over 1.5 GiB with the agent and torch
        started = time.monotonic()
        wait_until(lambda: job.node("n0.1") is not None, 120, "the supervisor to relaunch n0 with more memory")
        relaunched = time.monotonic() - started
        produce(kafka_broker, topic, ids[RECORDS // 2 :])
        wait_until(lambda: job.running("n0.1"), 180, "n0.1 training")
        print(f"hog -> relaunched {relaunched:.2f} s, -> its workers running {time.monotonic() - started:.2f} s")
        assert job.wait(timeout=300) == 0, job.logs()
        doc = job.status()
        assert doc["phase"] == "succeeded", job.logs()
        ended = {n["node_id"]: n for n in doc["ended_nodes"]}
        assert ended["n0"]["state"] == "oom_killed" and ended["n0"]["oom_kills"] >= 1, doc
        (relaunched,) = doc["nodes"]
        assert relaunched["node_id"] == "n0.1" and relaunched["memory"] == "3Gi" and relaunched["oom_kills"] == 0
        assert any(e["kind"] == "oom" and "relaunching with 3Gi" in e["message"] for e in doc["events"])
        _assert_exact(job)
    finally:
        job.stop()


def test_a_job_whose_controller_was_killed_resumes_when_run_again(tmp_path: Path, kafka_broker: Any) -> None:
    """SIGKILL of ``streamrover run`` itself leaves its master and nodes running; running the spec again ends
    them first (never two masters on one journal), then resumes from the newest checkpoint: ledger exact."""
    import psutil

    topic = kafka_topic(kafka_broker, RECORDS)
    spec = ledger_spec("rerun", f"kafka://{kafka_broker.bootstrap}/{topic}", RECORDS, tmp_path / "out", nodes=1)
    job = RunningJob(tmp_path, spec)
    try:
        job.start()
        wait_until(lambda: job.running("n0"), 180, "the node training")
        wait_until(lambda: job.acked() >= 0.3 * RECORDS, 240, "30% of the records acked")
        agent = job.node("n0")["pid"]  # type: ignore[index]
        assert job.proc is not None
        job.proc.kill()
        job.proc.wait()
        assert psutil.pid_exists(agent), "the killed controller's node runs on (its own session)"
        job.start()
        assert job.wait(timeout=400) == 0, job.logs()
        assert not psutil.pid_exists(agent) or psutil.Process(agent).status() == psutil.STATUS_ZOMBIE
        doc = job.status()
        assert doc["phase"] == "succeeded", job.logs()
        reaped = [e for e in doc["events"] if e["kind"] == "reaped"]
        assert reaped and str(agent) in reaped[0]["message"], doc["events"]
        attempts = [line for line in (job.out / "loss.txt").read_text().splitlines() if line.startswith("# attempt")]
        assert "from None" in attempts[0] and "from None" not in attempts[-1], f"the rerun resumed: {attempts}"
        _assert_exact(job)
    finally:
        job.stop()


def test_a_lost_node_with_no_relaunch_left_fails_the_job(tmp_path: Path) -> None:
    from tests.trainers.test_single_node import _parquet

    _parquet(tmp_path / "data", RECORDS)
    spec = ledger_spec("no-budget", str(tmp_path / "data"), RECORDS, tmp_path / "out", nodes=1)
    spec["restart"] = {"per_job": 0}
    job = RunningJob(tmp_path, spec)
    try:
        job.start()
        wait_until(lambda: job.running("n0"), 180, "the node training")
        job.kill_agent("n0")
        assert job.wait(timeout=120) == 1, job.logs()
        doc = job.status()
        assert doc["phase"] == "failed"
        assert "node n0 lost (killed by SIGKILL)" in doc["reason"] and "restart.per_job" in doc["reason"], doc
        assert [(n["node_id"], n["state"]) for n in doc["nodes"]] == [("n0", "lost")], doc["nodes"]
        assert not any(e["kind"] == "launch" and e["node"] != "n0" for e in doc["events"]), "nothing relaunched"
    finally:
        job.stop()
