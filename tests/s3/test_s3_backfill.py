"""A backfill from ``s3://`` parquet on a real S3 server (SeaweedFS), a worker SIGKILLed mid-run: ledger exact."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamrover.shard_service import DatasetSpec, ShardClient
from streamrover.testing.ledger import Ledger
from streamrover.testing.procs import MasterProcess, start_ledger_worker
from tests.helpers import wait_until, write_parquet_dataset

from .conftest import Bucket

ROWS = 12_000
pytestmark = pytest.mark.timeout(300)


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def _applied(ledger: Path) -> int:
    led = Ledger(ledger)
    try:
        return int(led._db.execute("SELECT COALESCE(SUM(count), 0) FROM chunks").fetchone()[0])
    finally:
        led.close()


def test_an_s3_parquet_backfill_is_exact_under_a_worker_kill(
    tmp_path: Path, bucket: Bucket, master: MasterProcess
) -> None:
    """Parquet files uploaded to a bucket; the master and the workers read them through s3fs, signed with the
    AWS variables. w0 stops itself after writing its 20th batch, before acking it, and is SIGKILLed there; two
    workers finish: every id is in the ledger exactly once."""
    ids = write_parquet_dataset(tmp_path / "data", ROWS, files=2, row_group_size=2_000)
    bucket.fs.put(str(tmp_path / "data") + "/", bucket.path("data") + "/", recursive=True)
    ledger = tmp_path / "ledger.db"
    Ledger(ledger).close()
    admin = ShardClient(master.address, token=master.token, heartbeat=False, timeout=60)
    try:
        info = admin.register_dataset(DatasetSpec("rows", bucket.url("data", "*.parquet"), records_per_shard=1_000))
        assert len(info.dataset.partitions) == ROWS // 2_000  # a partition per row group, found over S3
        assert all(p.id.startswith(bucket.url("data") + "/") for p in info.dataset.partitions)
        lone = start_ledger_worker(master, "rows", ledger, name="w0", batch_size=250, extra=["--pause-at-batch", "20"])
        wait_until(lambda: lone.poll() is not None or _stopped(lone.pid), 120, "w0 to stop after its 20th batch")
        assert lone.poll() is None, lone.communicate()[0].decode(errors="replace")
        lone.kill()
        lone.wait()
        at = _applied(ledger)
        assert at == 20 * 250
        workers = {
            name: start_ledger_worker(master, "rows", ledger, name=name, batch_size=250) for name in ("w0", "w1")
        }
        for proc in workers.values():
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0, out.decode(errors="replace")
        cut, _ = admin.prepare_cut()
        admin.commit_cut(cut)
        described = admin.describe_dataset("rows")
        assert described.finished and described.records_committed == ROWS
    finally:
        admin.close()
    report = Ledger(ledger).verify(ids)
    assert report.exact, f"{report} (w0 killed at {at} rows applied)"
    assert report.catchups >= 1  # the killed batch was written, not acked: its next lease caught up
