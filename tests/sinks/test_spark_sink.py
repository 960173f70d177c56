"""Spark Structured Streaming from a real Kafka topic through the training sink into a dlrover-run trainer.

The Spark driver is SIGKILLed twice, mid-batch, and started again from its checkpoint location:
once after a batch's files were staged and before their commit (the batch runs again: new files,
the first attempt's collected), once after a batch's commit and before Spark recorded the batch
as done (the batch is replayed: its commit is answered already_committed and adds nothing). The
ledger in the trained model must hold every record exactly once. The master serves TLS: the driver's
``ShardClient`` and the trainers reach it with ``STREAMROVER_TLS_CA``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from streamrover.sources.staged import encode_schema
from streamrover.testing.certs import issue, make_ca
from streamrover.testing.procs import python_env
from tests.helpers import wait_until
from tests.trainers.cluster import TorchJob
from tests.trainers.streams import KafkaTopic

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # three Spark JVM starts: ~3 min quiet, ~25 min at load 35
RECORDS = 6_000
JOB = Path(__file__).resolve().parent / "spark_job.py"
SCHEMA = pa.schema([("id", pa.int64()), ("x", pa.float64()), ("y", pa.float64())])


def run_driver(job: TorchJob, topic: KafkaTopic, work: Path, *extra: str) -> tuple[int, str]:
    """One run of the Spark job (its own process group: the driver and its JVM); returns (exit code, output)."""
    env = python_env()
    env["PYTHONPATH"] = os.pathsep.join([str(JOB.parents[2]), env.get("PYTHONPATH", "")])
    env["PYSPARK_PYTHON"] = sys.executable
    env.update(job.env)  # STREAMROVER_TLS_CA: the driver's ShardClient speaks TLS
    cmd = [
        sys.executable, str(JOB), "--bootstrap", topic.broker.bootstrap, "--topic", topic.topic,
        "--master", job.master.address, "--token", job.master.token, "--staging", str(work / "staging"),
        "--checkpoint", str(work / "checkpoint"), "--per-trigger", "1000", *extra,
    ]  # fmt: skip
    with open(work / "driver.log", "ab") as log:
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=log, start_new_session=True, timeout=900)
    return proc.returncode, proc.stdout.decode()


def test_spark_query_trains_exactly_once_across_driver_kills(tmp_path: Path, kafka_broker: object) -> None:
    topic = KafkaTopic(kafka_broker)
    topic.produce(np.arange(RECORDS))
    options = {"sr.staging_dir": str(tmp_path / "staging"), "sr.schema": encode_schema(SCHEMA)}
    ca = make_ca(tmp_path / "pki")  # the master serves TLS: the trainers and the Spark driver are given the CA
    server = issue(ca, tmp_path / "pki", "master")
    job = TorchJob(tmp_path, "staged://stream", options, records_per_shard=500,
                   master_args=["--tls-cert", str(server.cert), "--tls-key", str(server.key)],
                   env={"STREAMROVER_TLS_CA": str(ca.cert)})  # fmt: skip
    script = ["--records", str(RECORDS), "--batch-size", "128", "--ckpt-every", "10", "--out", str(job.out)]
    try:
        job.start()  # the trainers start first: the dataset is registered (staged, its schema declared)
        job.start_agent("n0", "1", 2, script)
        code, _ = run_driver(job, topic, tmp_path, "--die-after-staging", "1")
        assert code == -signal.SIGKILL, f"the driver was to die in batch 1 before its commit ({code})\n{job.logs()}"
        with job.admin() as admin:
            assert admin.describe_dataset("stream").total_records == 1000, "only batch 0 was committed"
        code, _ = run_driver(job, topic, tmp_path, "--die-after-commit", "3")
        assert code == -signal.SIGKILL, f"the driver was to die in batch 3 after its commit ({code})\n{job.logs()}"
        code, out = run_driver(job, topic, tmp_path)
        assert code == 0, f"the last run failed ({code}): {out}\n{job.logs()}"
        history = [tuple(int(v) if v.isdigit() else v for v in m) for m in re.findall(r"\((\d+), (\d+), (\w+)\)", out)]
        assert history[0] == (3, 1000, "True"), f"batch 3 must be replayed and answered already committed: {history}"
        assert sum(n for _, n, again in history if again == "False") == RECORDS - 4000

        wait_until(lambda: job.agents["n0"].poll() is not None, 600, f"the trainer to finish\n{job.logs()}")
        assert job.agents["n0"].returncode == 0, job.logs()
        ledger = job.ledger()
        assert ledger is not None and ledger.shape == (RECORDS,), job.logs()
        assert np.all(ledger == 1), f"{int((ledger == 0).sum())} missing, {int((ledger > 1).sum())} applied twice"
        with job.admin() as admin:
            info = admin.describe_dataset("stream")
            assert info.total_records == RECORDS and info.records_committed == RECORDS and info.lag == 0
            assert list(info.commit_gaps) == [], "every batch id's commit arrived (the sink names batch id - 1)"
            committed = {p.id for p in info.partitions}
        staged = {str(p) for p in (tmp_path / "staging").rglob("*.parquet")}
        assert staged <= committed, f"uncommitted staging left: {sorted(staged - committed)[:5]}"
        # committed files are deleted once two durable checkpoints hold them (sr.staged_retention, test_staged.py)
    finally:
        job.stop()
