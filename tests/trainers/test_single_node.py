"""One dlrover-run agent, two DDP workers on gloo, a parquet dataset: a worker SIGKILLed mid-run.

The agent restarts its worker group (not itself); rank 0 restores the newest checkpoint
(from the agent-hosted saver's shared memory or storage) and resets the shard service's
cursor before any rank leases again; rank 1 maps the snapshot rank 0 restored from shared memory
(no state broadcast). The ledger inside the model must count every record
exactly once, and the master must report the restart in the node's health document.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streamrover.trainers.torch.agent import read_health
from tests.helpers import wait_until
from tests.trainers.cluster import TorchJob, records_table

pytestmark = pytest.mark.slow
RECORDS = 30_000


def _parquet(root: Path, records: int) -> None:
    root.mkdir(parents=True)
    ids = np.random.default_rng(1).permutation(records)
    for i, part in enumerate(np.array_split(ids, 3)):
        pq.write_table(pa.table(records_table(part)), root / f"part-{i}.parquet", row_group_size=2_000)


def test_worker_sigkill_restarts_the_group_and_the_ledger_is_exact(tmp_path: Path) -> None:
    _parquet(tmp_path / "data", RECORDS)
    job = TorchJob(tmp_path, str(tmp_path / "data"), records_per_shard=1_000)
    job.start()
    try:
        job.start_agent("n0", "1", 2, ["--records", str(RECORDS), "--batch-size", "64", "--out", str(job.out)])
        wait_until(lambda: job.acked() >= RECORDS * 0.3, 180, "30% of the records acked")
        wait_until(lambda: len(job.workers("n0")) == 2, 120, "the agent to report its two workers")
        victim = random.choice(job.workers("n0"))
        victim.kill()
        wait_until(lambda: job.agents["n0"].poll() is not None, 240, "the agent to finish")
        assert job.agents["n0"].returncode == 0, job.logs()
        ledger = job.ledger()
        assert ledger is not None, job.logs()
        assert ledger.shape == (RECORDS,) and np.all(ledger == 1), (
            f"{int((ledger == 0).sum())} missing, {int((ledger > 1).sum())} duplicated\n{job.logs()}"
        )
        with job.admin() as admin:
            committed, _ = admin.get_cursor()
            assert committed.size() == RECORDS, "the final checkpoint's cut covers every record"
            health = read_health(admin, "job", "n0")
        assert health is not None and health["state"] == "SUCCEEDED"
        assert any(e["exitcode"] == -9 for e in health["exits"]), health
        assert health["restarts_left"] == 29
        losses = job.losses()
        assert np.mean(losses[-20:]) < np.mean(losses[:20]) / 5, "the loss decreases"
        attempts = [ln for ln in (job.out / "loss.txt").read_text().splitlines() if ln.startswith("# attempt")]
        assert len(attempts) == 2 and "from None via broadcast" in attempts[0], attempts  # a fresh start: rank 0's
        # restart on the same node: rank 1 mapped the snapshot rank 0 restored, no broadcast
        assert "from memory:" in attempts[1] and "via shared memory" in attempts[1], attempts
    finally:
        job.stop()
