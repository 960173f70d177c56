"""The chaos ledger test: elastic DDP on a real Kafka topic under dlrover-run, with worker and agent SIGKILLs.

Two nodes (two dlrover-run agents, ``--nnodes 2:3``) with two gloo workers each train
from a 200,000-record Kafka topic (four partitions; half produced before the start, half
while the job runs). During the run: five SIGKILLs of random worker processes, one
SIGKILL of an agent (its workers die with it; the node is relaunched under a new id, as
a platform would), and a third node that joins and later leaves (SIGTERM). Each event
waits until the job has made progress since the previous one (the acked cursor grows).
Afterwards the ledger in the model counts every record exactly once, the final cut
covers every record, and the loss has fallen.

Sizes (2-core machine, ~2.5 min): 200k records, batch 128 per rank, 2,000-record shards,
a 1-64-1 MLP, a checkpoint every 10 steps.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers import wait_until
from tests.trainers.cluster import TorchJob
from tests.trainers.streams import KafkaTopic

pytestmark = pytest.mark.slow
RECORDS = 200_000



def test_elastic_ddp_on_kafka_is_exact_under_chaos(tmp_path: Path, kafka_broker: Any) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    topic = KafkaTopic(kafka_broker)
    ids = np.arange(RECORDS)
    topic.produce(ids[: RECORDS // 2])
    options = {"sr.format": "json", "sr.schema": "id:int64,x:float64,y:float64", "sr.max_delay_ms": "200"}
    job = TorchJob(tmp_path, topic.uri, options, records_per_shard=2_000)
    script = ["--records", str(RECORDS), "--batch-size", "128", "--ckpt-every", "10", "--out", str(job.out)]
    events: list[str] = []
    try:
        job.start()
        job.start_agent("n0", "2:3", 2, script)
        job.start_agent("n1", "2:3", 2, script)
        later = threading.Thread(target=topic.produce, args=(ids[RECORDS // 2 :],))
        later.start()

        def kill_worker() -> None:
            wait_until(lambda: bool(job.workers()), 120, f"a running worker to kill after {events}")
            victim = rng.choice(job.workers())
            victim.kill()
            events.append(f"SIGKILL worker {victim.pid}")

        def kill_agent() -> None:
            job.kill_agent("n1")
            job.start_agent("n1b", "2:3", 2, script)  # the platform relaunches the lost node
            events.append("SIGKILL agent n1; relaunched as n1b")

        def join() -> None:
            job.start_agent("n2", "2:3", 2, script)
            events.append("node n2 joins")

        def leave() -> None:
            job.stop_agent("n2")
            events.append("node n2 leaves")

        actions = [kill_worker, join, kill_worker, kill_agent, kill_worker, leave, kill_worker, kill_worker]
        fractions = np.linspace(0.06, 0.85, len(actions))
        for fraction, action in zip(fractions, actions):
            wait_until(lambda f=fraction: job.acked() >= f * RECORDS, 300, f"{fraction:.0%} acked after {events}")
            action()
        later.join()
        for name in ("n0", "n1b"):
            wait_until(lambda n=name: job.agents[n].poll() is not None, 300, f"agent {name} to finish after {events}")
            assert job.agents[name].returncode == 0, f"seed {seed}, {events}\n{job.logs()}"
        ledger = job.ledger()
        assert ledger is not None, f"seed {seed}, {events}\n{job.logs()}"
        assert np.all(ledger == 1), (
            f"seed {seed}, {events}: {int((ledger == 0).sum())} missing, {int((ledger > 1).sum())} duplicated"
        )
        with job.admin() as admin:
            assert admin.get_cursor()[0].size() == RECORDS, "the final cut covers every record"
        losses = job.losses()
        assert np.mean(losses[-50:]) < np.mean(losses[:50]) / 5, "the loss decreases"
    finally:
        job.stop()
