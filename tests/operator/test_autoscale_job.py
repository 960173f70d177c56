"""Autoscaling a real job from consumer lag: a burst scales it out, a drained stream scales it back in.

The torch ledger job (nodes 1:2, autoscaling target 4,000 records of lag, cooldown 10 s) reads a Kafka
topic. A burst of records puts the lag far above the target: the autoscaler (fed by the controller from
the master's status every 2 s) scales out to 2 nodes. Once the lag has stayed under half the target for a
cooldown it scales back in to 1, gracefully; then the last records arrive. Each decision is in ``status``
with its inputs; the ledger is exact over the whole run.

This checks the control loop end to end, not the throughput gain: on this project's 2 shared cores a second
node adds little speed, so "lag back under target within N s" would measure the machine.
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
# a step's modelled compute: a node trains at most 2 ranks x 128 records / 0.1 s = 2,560 records/s, under the
# burst's production rate, so that one node cannot drain the burst before the autoscaler's first decision (a
# faster machine trained 30,000 records with no scale-out at all: the decision depends on the node's speed)
STEP_SECONDS = 0.1


def _decisions(job: RunningJob) -> list[dict[str, Any]]:
    return list(job.status().get("autoscaling", {}).get("decisions", []))


def test_lag_scales_the_job_out_and_back_in(tmp_path: Path, kafka_broker: Any) -> None:
    topic = kafka_topic(kafka_broker, 0)
    ids = np.arange(RECORDS)
    spec = ledger_spec("autoscaled", f"kafka://{kafka_broker.bootstrap}/{topic}", RECORDS, tmp_path / "out",
                       nodes="1:2")  # fmt: skip
    spec["autoscaling"] = {"target_lag_records": 4_000, "cooldown_seconds": 10}
    spec["trainer"]["args"] += ["--step-seconds", STEP_SECONDS]
    job = RunningJob(tmp_path, spec)
    try:
        job.start()
        wait_until(lambda: job.running("n0"), 180, "the first node training")
        burst = time.monotonic()
        produce(kafka_broker, topic, ids[: 3 * RECORDS // 4])
        wait_until(lambda: job.node("n1") is not None, 120, f"a scale-out decision: {_decisions(job)}")
        print(f"burst -> scale-out decided {time.monotonic() - burst:.1f} s")
        out = _decisions(job)[0]
        assert out["nodes_from"] == 1 and out["nodes_to"] == 2 and out["lag"] > out["target_lag"], out
        wait_until(lambda: job.node("n1") is None, 400, f"a scale-in decision after the lag drained: {_decisions(job)}")
        print(f"burst -> scaled back in {time.monotonic() - burst:.1f} s")
        back = _decisions(job)[-1]
        assert back["nodes_to"] == 1 and back["lag"] < back["target_lag"] / 2, back
        assert back["at"] - out["at"] >= 10, "scale-in waits a cooldown"
        produce(kafka_broker, topic, ids[3 * RECORDS // 4 :])
        assert job.wait(timeout=300) == 0, job.logs()
        doc = job.status()
        assert doc["phase"] == "succeeded", job.logs()
        kinds = [e["kind"] for e in doc["events"]]
        assert "autoscale" in kinds and "scale-in" in kinds, kinds
        assert any("lag above target: lag" in e["message"] for e in doc["events"] if e["kind"] == "autoscale")
        ledger = job.ledger()
        assert ledger is not None and np.all(ledger == 1), job.logs()
    finally:
        job.stop()
