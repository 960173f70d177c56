"""Model-state ledger runs on every broker: a double apply anywhere shows up as a 2 in the model.

The stream tests in tests/sources/ write into a compare-and-set ledger that absorbs a
re-delivered record, so they prove fencing, not the model's exactly-once. Here the ledger is a
buffer inside the trained model (tests/trainers/ledger_train.py): it lives and dies with the
model, is restored from its checkpoints, and counts every application of every record id.

One run per broker (Kafka, Pulsar on pulsar-lite, RocketMQ): one dlrover-run agent with two
DDP workers on gloo train from a fresh 4-partition topic of :data:`RECORDS` records (half
produced before the start, half while the job runs). Every fault below happens once, in a
seeded random order at seeded random progress points (the seed is printed; set
``LEDGER_SEED`` to replay one):

- SIGKILL of a worker (the agent restarts its group, rank 0 restores the newest checkpoint);
- SIGKILL of the master and a restart on the same state dir and port;
- the broker SIGKILLed and restarted (RocketMQ twice: the broker alone, then with its name server).

Each fault waits until the job has trained past where it stood after the previous one. At the
end the ledger must hold every id exactly once, the final cut must commit every record, and the
loss must have fallen.

Sizes (2 cores): 40,000 records, 1,000-record shards, batch 128 per rank, a checkpoint every
10 steps, ~1-2 min per broker.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from streamrover.cursor import IntervalSet, PartitionKey
from tests.helpers import wait_until
from tests.trainers.cluster import TorchJob
from tests.trainers.streams import SCHEMA, BrokerTopic, KafkaTopic, PulsarTopic, RocketMQTopic

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
RECORDS = 40_000
_TOPICS: dict[str, Callable[[Any], BrokerTopic]] = {
    "kafka": KafkaTopic,
    "pulsar": PulsarTopic,
    "rocketmq": RocketMQTopic,
}
_RUN = ["kafka", "pulsar", "rocketmq"]


@pytest.fixture(params=_RUN)
def topic(request: pytest.FixtureRequest) -> Iterator[BrokerTopic]:
    made = _TOPICS[request.param](request.getfixturevalue(f"{request.param}_broker"))
    try:
        yield made
    finally:
        made.ensure_running()  # a failed run must not leave the shared broker down for later tests


class _Run:
    """The job, its faults and the checks that stop a wait early when the run cannot end well."""

    def __init__(self, job: TorchJob, seed: int) -> None:
        self.job = job
        self.seed = seed
        self.events: list[str] = []
        self.t0 = time.monotonic()

    def context(self) -> str:
        return f"seed {self.seed}, events {self.events}"

    def acked(self) -> int:
        """Records acked or committed (the master's count of records, not of positions)."""
        with self.job.admin() as admin:
            info = admin.describe_dataset("stream")
        if info.failed:
            raise AssertionError(f"{self.context()}: the dataset FAILED: {info.error}\n{self.job.logs()}")
        agent = self.job.agents["n0"]
        if agent.poll() is not None and not self.job.out.joinpath("ledger.npy").exists():
            raise AssertionError(f"{self.context()}: the agent exited {agent.returncode}\n{self.job.logs()}")
        return int(info.records_acked)

    def fault(self, name: str, action: Callable[[], None]) -> None:
        before, t = self.acked(), time.monotonic() - self.t0
        action()
        took = time.monotonic() - self.t0 - t
        self.events.append(f"{name} at {before} acked, {t:.0f} s (took {took:.1f} s; {self.acked()} acked after)")
        print(self.events[-1], file=sys.stderr)

    def kill_worker(self, rng: random.Random) -> None:
        wait_until(lambda: len(self.job.workers("n0")) == 2, 120, f"two running workers ({self.context()})")
        rng.choice(self.job.workers("n0")).kill()

    def kill_master(self) -> None:
        self.job.master.kill()
        self.job.master.start()


def test_model_ledger_is_exact_under_worker_master_and_broker_kills(tmp_path: Path, topic: BrokerTopic) -> None:
    seed = int(os.environ.get("LEDGER_SEED") or random.randrange(1 << 30))
    print(f"LEDGER_SEED={seed} ({type(topic).__name__})", file=sys.stderr)
    rng = random.Random(seed)
    ids = np.arange(RECORDS)
    topic.produce(ids[: RECORDS // 2])
    options = {"sr.format": "json", "sr.schema": SCHEMA, "sr.max_delay_ms": "200"}
    job = TorchJob(tmp_path, topic.uri, options, records_per_shard=1_000)
    run = _Run(job, seed)
    script = ["--records", str(RECORDS), "--batch-size", "128", "--ckpt-every", "10", "--out", str(job.out)]
    later = threading.Thread(target=topic.produce, args=(ids[RECORDS // 2 :],), daemon=True)
    try:
        job.start()
        job.start_agent("n0", "1", 2, script)
        later.start()

        def broker(restart: Callable[[], None]) -> Callable[[], None]:
            def act() -> None:
                later.join(timeout=300)  # non-idempotent producers: restart only after every record is stored
                assert not later.is_alive(), "the producer did not finish"
                restart()

            return act

        faults: dict[str, Callable[[], None]] = {
            "SIGKILL a worker": lambda: run.kill_worker(rng),
            "SIGKILL + restart the master": run.kill_master,
            **{name: broker(restart) for name, restart in topic.restarts().items()},
        }
        order = list(faults)
        rng.shuffle(order)
        moments = sorted(rng.uniform(0.1, 0.6) for _ in order)
        print(f"faults {list(zip(order, [f'{m:.0%}' for m in moments]))}", file=sys.stderr)
        floor = 0
        for moment, name in zip(moments, order):
            want = max(int(moment * RECORDS), floor + 1)
            wait_until(lambda w=want: run.acked() >= w, 300, f"{want} records acked ({run.context()})")
            run.fault(name, faults[name])
            floor = run.acked()  # the next fault waits until the job trained past this point again
        later.join(timeout=300)
        wait_until(lambda: job.agents["n0"].poll() is not None, 300, f"the agent to finish ({run.context()})")
        assert job.agents["n0"].returncode == 0, f"{run.context()}\n{job.logs()}"
        ledger = job.ledger()
        assert ledger is not None, f"{run.context()}\n{job.logs()}"
        assert ledger.shape == (RECORDS,) and np.all(ledger == 1), (
            f"{run.context()}: {int((ledger == 0).sum())} missing, {int((ledger > 1).sum())} applied twice or more"
            f" (e.g. ids {np.flatnonzero(ledger > 1)[:10].tolist()})\n{job.logs()}"
        )
        with job.admin() as admin:  # the final checkpoint's cut covers every record, each partition once
            info = admin.describe_dataset("stream")
            committed, _ = admin.get_cursor()
        assert info.records_committed == RECORDS and info.lag == 0, f"{run.context()}: {info}"
        for part in info.partitions:
            assert committed.get(PartitionKey("stream", 0, part.id)) == IntervalSet([(part.start, part.end)]), part
        losses = job.losses()
        assert np.mean(losses[-20:]) < np.mean(losses[:20]) / 5, "the loss decreases"
        print(f"{type(topic).__name__}: exact after {run.events} in {time.monotonic() - run.t0:.0f} s",
              file=sys.stderr)  # fmt: skip
    finally:
        job.stop()
