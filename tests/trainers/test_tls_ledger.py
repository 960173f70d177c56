"""A ledger run over TLS (issue 33): torch under dlrover-run, the worker token, the certificate swapped mid-run.

A real ``streamrover master`` with ``--tls-cert/--tls-key``; one dlrover-run agent with two DDP workers told
the CA through ``STREAMROVER_TLS_CA`` and given the worker token (as the operator hands it). At a third of the
run the master's certificate is replaced in place (a new key, the same CA: a cert-manager renewal) and a worker
is SIGKILLed, so the restarted group connects anew (new handshakes: the new certificate) and restores its
checkpoint's cursor with the worker token. The ledger must hold every record exactly once.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from streamrover.testing.certs import issue, make_ca, serial
from tests.helpers import wait_until
from tests.trainers.cluster import TorchJob
from tests.trainers.test_single_node import _parquet

pytestmark = pytest.mark.slow
RECORDS = 12_000


def test_a_ledger_run_over_tls_survives_a_certificate_swap(tmp_path: Path) -> None:
    ca = make_ca(tmp_path / "pki")
    first, renewed = issue(ca, tmp_path / "pki", "server"), issue(ca, tmp_path / "pki", "renewed")
    served = tmp_path / "tls"
    served.mkdir()
    shutil.copy(first.cert, served / "tls.crt")
    shutil.copy(first.key, served / "tls.key")
    _parquet(tmp_path / "data", RECORDS)
    job = TorchJob(
        tmp_path, str(tmp_path / "data"), records_per_shard=500, worker_role=True,
        master_args=["--tls-cert", str(served / "tls.crt"), "--tls-key", str(served / "tls.key")],
        env={"STREAMROVER_TLS_CA": str(ca.cert)},
    )  # fmt: skip
    job.start()
    try:
        job.start_agent("n0", "1", 2, ["--records", str(RECORDS), "--batch-size", "64", "--out", str(job.out)])
        wait_until(lambda: job.acked() >= RECORDS * 0.3, 180, "30% of the records acked")
        for name in ("tls.key", "tls.crt"):  # replaced whole, as a Secret volume's files are
            shutil.copy(renewed.cert if name == "tls.crt" else renewed.key, served / f"{name}.new")
            (served / f"{name}.new").rename(served / name)
        assert serial(served / "tls.crt") == serial(renewed.cert)
        wait_until(lambda: len(job.workers("n0")) == 2, 120, "the agent to report its two workers")
        random.choice(job.workers("n0")).kill()
        wait_until(lambda: job.agents["n0"].poll() is not None, 240, "the agent to finish")
        assert job.agents["n0"].returncode == 0, job.logs()
        ledger = job.ledger()
        assert ledger is not None, job.logs()
        assert ledger.shape == (RECORDS,) and np.all(ledger == 1), (
            f"{int((ledger == 0).sum())} missing, {int((ledger > 1).sum())} duplicated\n{job.logs()}"
        )
        with job.admin() as admin:
            assert admin.get_cursor()[0].size() == RECORDS
        assert "TLS certificate reloaded" in (tmp_path / "master" / "master.log").read_text(), job.logs()
    finally:
        job.stop()
