"""TF parameter-server jobs under ``streamrover tf-ps-run`` with real SIGKILLs: 2 PS, 2 workers, a parquet dataset.

A killed worker: the coordinator re-runs its closure (which may have pushed part of its
updates already); the chief sees the re-run, rolls the PS variables and the cursor back to the
last flash checkpoint, and the ledger (a PS variable updated by the step) counts every record
once. A killed parameter server and a killed chief: the chief restarts and restores from the
flash checkpoint in this host's shared memory (the events say so), before leasing anything. The first job's
master serves TLS: ``tf-ps-run --tls-ca`` and every process it starts reach it only over TLS.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streamrover.shard_service import ShardClient, ShardServiceError
from tests.helpers import wait_until
from tests.trainers.cluster import records_table
from tests.trainers.tensorflow.job import TFJob

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="tensorflow-cpu is not installed"),
]
RECORDS = 40_000


def _job(tmp_path: Path, records: int = RECORDS, tls: bool = False) -> TFJob:
    data = tmp_path / "data"
    data.mkdir()
    ids = np.random.default_rng(3).permutation(records)
    for i, part in enumerate(np.array_split(ids, 2)):
        pq.write_table(pa.table(records_table(part)), data / f"part-{i}.parquet", row_group_size=2_000)
    return TFJob(tmp_path, str(data), records_per_shard=1_000, tls=tls)


def _check_exact(job: TFJob, rc: int) -> np.ndarray:
    assert rc == 0, job.logs()
    ledger = job.ledger()
    assert ledger is not None, job.logs()
    assert np.all(ledger == 1), (
        f"{int((ledger == 0).sum())} missing, {int((ledger > 1).sum())} applied more than once\n{job.logs()}"
    )
    with job.admin() as admin:
        assert admin.get_cursor()[0].size() == RECORDS, "the final committed cut covers every record"
    losses = job.losses()
    assert np.mean(losses[-20:]) < np.mean(losses[:20]) / 4, f"the loss decreases: {losses[:5]} ... {losses[-5:]}"
    return ledger


def test_worker_sigkill_rolls_back_to_the_flash_checkpoint_and_the_ledger_is_exact(tmp_path: Path) -> None:
    job = _job(tmp_path, tls=True)  # over TLS: tf-ps-run --tls-ca, its chief, PS and workers all speak it
    try:
        job.start(2, 2, ["--records", str(RECORDS), "--batch-size", "32", "--ckpt-every", "25"])
        plain = ShardClient(job.master.address, token=job.master.token, heartbeat=False, timeout=1, tls=None)
        with plain, pytest.raises(ShardServiceError, match="set STREAMROVER_TLS_CA"):  # the master speaks TLS only
            plain.status()
        for fraction, worker in ((0.25, 0), (0.6, 1)):
            wait_until(lambda f=fraction: job.acked() >= f * RECORDS, 300, f"{fraction:.0%} acked\n{job.logs()}")
            job.kill("workers", worker)
        _check_exact(job, job.wait(600))
        rollbacks = job.events("rollback")
        # a worker's loss: a closure re-run, or a step whose fetch found the worker gone (whichever comes first)
        assert rollbacks and all("re-run" in r["why"] or "UNAVAILABLE" in r["why"] for r in rollbacks), job.logs()
        assert job.status()["restarts"]["worker"] == 2
        assert job.status()["chief_starts"] == 1, "a worker loss does not restart the chief"
    finally:
        job.stop()


def test_ps_and_chief_sigkill_restore_from_shared_memory_and_the_ledger_is_exact(tmp_path: Path) -> None:
    job = _job(tmp_path)
    try:
        job.start(2, 2, ["--records", str(RECORDS), "--batch-size", "32", "--ckpt-every", "25"])
        wait_until(lambda: job.acked() >= 0.3 * RECORDS, 300, f"30% acked\n{job.logs()}")
        job.kill("ps", 1)
        wait_until(lambda: len(job.events("restore")) >= 2, 300, f"the chief restored after the PS loss\n{job.logs()}")
        wait_until(lambda: job.acked() >= 0.65 * RECORDS, 300, f"65% acked\n{job.logs()}")
        job.kill("chief")
        _check_exact(job, job.wait(600))
        restores = job.events("restore")
        # the first start restores nothing; each later start (PS loss, chief kill) restores from shared memory,
        # and so does each rollback (a closure the coordinator re-ran after the PS came back: seen in a run)
        rollbacks = job.events("rollback")
        assert [r["source"] for r in restores] == [None] + ["memory"] * (2 + len(rollbacks)), job.logs()
        assert all(r["step"] > 0 for r in restores[1:])
        status = job.status()
        assert status["restarts"]["ps"] == 1 and status["chief_starts"] == 3, status
    finally:
        job.stop()
