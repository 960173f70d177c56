"""The TF-PS acceptance ledger test: 2 PS + 3 workers + chief on a real Kafka topic of 200,000 records.

Half the records are produced before the start, half while the job runs (four partitions). At
random moments during the run (each after the job made progress since the previous event, so
every event lands mid-run): three workers, one parameter server and the chief are SIGKILLed, a
fourth worker joins (``SIGUSR1`` to the launcher) and later leaves (``SIGUSR2``). Afterwards the
ledger (a PS variable the training step updates) counts every record exactly once, the final
committed cut covers every record, and the loss has fallen.
"""

from __future__ import annotations

import importlib.util
import random
import signal
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers import wait_until
from tests.trainers.streams import KafkaTopic
from tests.trainers.tensorflow.job import TFJob

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1500),
    pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="tensorflow-cpu is not installed"),
]
RECORDS = 200_000



def test_tf_ps_on_kafka_is_exact_under_chaos(tmp_path: Path, kafka_broker: Any) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    topic = KafkaTopic(kafka_broker)
    ids = np.arange(RECORDS)
    topic.produce(ids[: RECORDS // 2])
    options = {"sr.format": "json", "sr.schema": "id:int64,x:float64,y:float64", "sr.max_delay_ms": "200"}
    job = TFJob(tmp_path, topic.uri, options, records_per_shard=2_000)
    events: list[str] = []
    later = threading.Thread(target=topic.produce, args=(ids[RECORDS // 2 :],))
    try:
        job.start(2, 3, ["--records", str(RECORDS), "--batch-size", "64", "--ckpt-every", "25", "--stop-at-records"])
        later.start()

        def kill_worker() -> None:
            index = rng.randrange(len(job.status()["workers"]))
            events.append(f"SIGKILL worker {index} (pid {job.kill('workers', index)})")

        def kill_ps() -> None:
            index = rng.randrange(2)
            events.append(f"SIGKILL ps {index} (pid {job.kill('ps', index)})")

        def kill_chief() -> None:
            events.append(f"SIGKILL chief (pid {job.kill('chief')})")

        def join() -> None:
            job.signal_launcher(signal.SIGUSR1)
            wait_until(lambda: len(job.status().get("workers", [])) == 4, 300, f"a 4th worker after {events}")
            events.append("a 4th worker joins")

        def leave() -> None:
            job.signal_launcher(signal.SIGUSR2)
            wait_until(lambda: len(job.status().get("workers", [])) == 3, 300, f"3 workers after {events}")
            events.append("the 4th worker leaves")

        actions = [kill_worker, join, kill_ps, kill_worker, leave, kill_chief, kill_worker]
        rng.shuffle(actions)
        if actions.index(leave) < actions.index(join):  # the 4th worker joins before it leaves
            i, j = actions.index(leave), actions.index(join)
            actions[i], actions[j] = join, leave
        fractions = sorted(rng.uniform(0.05, 0.85) for _ in actions)
        for fraction, action in zip(fractions, actions):
            # the chief is up and training again: it has acked more since the previous event
            wait_until(lambda f=fraction: job.acked() >= f * RECORDS, 600, f"{fraction:.0%} acked after {events}")
            action()
            print(f"seed {seed}: {events[-1]} at {fraction:.0%}", flush=True)
        later.join()
        rc = job.wait(900)
        assert rc == 0, f"seed {seed}, {events}\n{job.logs()}"
        ledger = job.ledger()
        assert ledger is not None, f"seed {seed}, {events}\n{job.logs()}"
        assert np.all(ledger == 1), (
            f"seed {seed}, {events}: {int((ledger == 0).sum())} missing, {int((ledger > 1).sum())} duplicated\n"
            f"{job.logs()}"
        )
        with job.admin() as admin:
            assert admin.get_cursor()[0].size() == RECORDS, "the final cut covers every record"
        losses = job.losses()
        assert np.mean(losses[-30:]) < np.mean(losses[:30]) / 4, f"the loss decreases: {losses[:5]}, {losses[-5:]}"
        restores = job.events("restore")
        assert any(r["source"] == "memory" for r in restores), f"seed {seed}, {events}: restores {restores}"
    finally:
        if later.is_alive():
            later.join()
        job.stop()
