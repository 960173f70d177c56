"""``streamrover jobs list``, ``status JOB``, ``scale JOB N`` and ``stop JOB`` against a job that ``run`` started."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from tests.helpers import wait_until
from tests.operator.runner import RunningJob, kafka_topic, ledger_spec, produce

pytestmark = pytest.mark.slow
RECORDS = 40_000


def _cli(job: RunningJob, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "streamrover.cli", *args], capture_output=True, text=True,
                          env={**job.env, "COLUMNS": "200"}, timeout=60)  # fmt: skip


def test_scale_out_and_in_through_the_cli_keeps_the_ledger_exact(tmp_path: Path, kafka_broker: Any) -> None:
    topic = kafka_topic(kafka_broker, 0)
    ids = np.arange(RECORDS)
    produce(kafka_broker, topic, ids[: RECORDS // 4])  # the rest only as the test goes: training cannot end early
    spec = ledger_spec("scaled", f"kafka://{kafka_broker.bootstrap}/{topic}", RECORDS, tmp_path / "out",
                       nodes="1:2")  # fmt: skip
    job = RunningJob(tmp_path, spec)
    try:
        job.start()
        wait_until(lambda: job.running("n0"), 180, "the first node training")
        refused = _cli(job, "scale", "scaled", "3")
        assert refused.returncode == 2 and "outside job 'scaled''s bounds 1:2" in refused.stdout, refused
        wait_until(lambda: job.acked() >= 0.2 * RECORDS, 240, "20% acked")
        assert _cli(job, "scale", "scaled", "2").returncode == 0
        wait_until(lambda: job.running("n1"), 180, "the second node training")
        produce(kafka_broker, topic, ids[RECORDS // 4 : 3 * RECORDS // 4])
        listed = _cli(job, "jobs", "list")
        assert "scaled" in listed.stdout and "running" in listed.stdout and "2/2" in listed.stdout, listed.stdout
        wait_until(lambda: job.acked() >= 0.6 * RECORDS, 240, "60% acked")
        n1_pids = [p.pid for p in psutil.Process(job.node("n1")["pid"]).children(recursive=True)]  # type: ignore[index]
        assert _cli(job, "jobs", "scale", "scaled", "1").returncode == 0
        wait_until(lambda: job.node("n1") is None, 120, "n1 to leave")
        produce(kafka_broker, topic, ids[3 * RECORDS // 4 :])
        assert job.wait(timeout=300) == 0, job.logs()
        doc = job.status()
        assert doc["phase"] == "succeeded" and doc["relaunches"] == 0, job.logs()
        ended = {n["node_id"]: n for n in doc["ended_nodes"]}
        assert ended["n1"]["state"] == "stopped", ended
        kinds = [(e["kind"], e["node"]) for e in doc["events"]]
        assert ("scale", "") in kinds and ("scale-in", "n1") in kinds and ("launch", "n1") in kinds, kinds
        assert not [p for p in n1_pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
        ledger = job.ledger()
        assert ledger is not None and np.all(ledger == 1), job.logs()
        shown = _cli(job, "status", "scaled")
        assert shown.returncode == 0 and "succeeded" in shown.stdout and "scale-in" in shown.stdout, shown.stdout
    finally:
        job.stop()


def test_a_detached_job_stops_with_its_nodes_and_master(tmp_path: Path, kafka_broker: Any) -> None:
    topic = kafka_topic(kafka_broker, 2_000)
    # it would train until 20,000 records: the stream has 2,000, so only `stop` ends it
    spec = ledger_spec("stopped", f"kafka://{kafka_broker.bootstrap}/{topic}", 20_000, tmp_path / "out", nodes=1)
    job = RunningJob(tmp_path, spec)
    try:
        detached = _cli(job, "run", str(job.spec_path), "--detach")
        assert detached.returncode == 0 and "started in the background" in detached.stdout, detached
        wait_until(lambda: job.running("n0"), 180, "the node training")
        controller = job.dir.controller_pid()
        assert controller is not None
        again = _cli(job, "run", str(job.spec_path))
        assert again.returncode == 2 and f"already running (controller pid {controller})" in again.stdout, again
        agent = psutil.Process(job.node("n0")["pid"])  # type: ignore[index]
        procs = [agent, *agent.children(recursive=True)]
        master = json.loads(_cli(job, "status", "stopped", "--json").stdout)["master"]
        stopped = _cli(job, "stop", "stopped")
        assert stopped.returncode == 0 and "stopping job 'stopped'" in stopped.stdout, stopped
        wait_until(lambda: job.dir.controller_pid() is None, 120, "the controller to exit")
        doc = job.status()
        assert doc["phase"] == "stopped" and doc["reason"] == "stopped on request", doc
        assert doc["controller"] == "exited"
        assert not [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], "no process left"
        port = int(master.rsplit(":", 1)[1])
        assert not [c for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port
                    and c.status == psutil.CONN_LISTEN], "the master stopped"  # fmt: skip
        again = _cli(job, "stop", "stopped")
        assert again.returncode == 0 and "is not running (stopped)" in again.stdout
        missing = _cli(job, "status", "ghost")
        assert missing.returncode == 2 and "no job 'ghost'" in missing.stdout and "stopped" in missing.stdout
    finally:
        job.stop()
