"""An Iceberg table as a dataset (sources/iceberg.py): pyiceberg's SQL catalog (SQLite) on a local warehouse.

Pinned to a snapshot, sharded by data file and row group, exactly once under a worker SIGKILL; followed, each
appended snapshot trained once; bad input refused at registration.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from streamrover.shard_service import DatasetSpec, InvalidArgumentError, NotFoundError, ShardClient
from streamrover.testing.ledger import Ledger
from streamrover.testing.procs import MasterProcess, start_ledger_worker
from tests.helpers import wait_until
from tests.sources.stream_job import StreamJob

pytestmark = pytest.mark.slow


def _catalog(root: Path) -> tuple[Any, dict[str, str]]:
    from pyiceberg.catalog import load_catalog

    props = {"type": "sql", "uri": f"sqlite:///{root}/catalog.db", "warehouse": f"file://{root}/warehouse"}
    catalog = load_catalog("lake", **props)
    if ("lake",) not in catalog.list_namespaces():
        catalog.create_namespace("lake")
    return catalog, {**props, "sr.catalog": "lake"}


def _rows(ids: range) -> pa.Table:
    return pa.table({"id": pa.array(ids, pa.int64()), "day": pa.array([i % 3 for i in ids], pa.int64())})


def _applied(ledger: Path) -> int:
    led = Ledger(ledger)
    try:
        return int(led._db.execute("SELECT COALESCE(SUM(count), 0) FROM chunks").fetchone()[0])
    finally:
        led.close()


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def test_a_pinned_snapshot_trains_exactly_once_under_a_worker_kill(tmp_path: Path, master: MasterProcess) -> None:
    """Three appends; the dataset is pinned to the second snapshot. A worker is SIGKILLed after writing a batch it
    did not ack; two workers finish: the ledger holds exactly the rows of that snapshot, the cursor names it."""
    catalog, options = _catalog(tmp_path)
    table = catalog.create_table("lake.clicks", schema=_rows(range(0)).schema)
    table.append(_rows(range(0, 6_000)))
    table.append(_rows(range(6_000, 10_000)))
    pinned = table.current_snapshot().snapshot_id
    table.append(_rows(range(10_000, 13_000)))  # after the pin: never trained
    ledger = tmp_path / "ledger.db"
    Ledger(ledger).close()
    admin = ShardClient(master.address, token=master.token, heartbeat=False, timeout=60)
    try:
        with pytest.raises(NotFoundError, match="has no snapshot 1 "):
            admin.register_dataset(DatasetSpec("a", "iceberg://lake.clicks", options={**options, "sr.snapshot": "1"}))
        with pytest.raises(NotFoundError, match="no Iceberg table 'lake.none'"):
            admin.register_dataset(DatasetSpec("b", "iceberg://lake.none", options=options))
        with pytest.raises(InvalidArgumentError, match="sr.follow=true needs sr.snapshot"):
            admin.register_dataset(DatasetSpec("c", "iceberg://lake.clicks", options={**options, "sr.follow": "true"}))
        spec = DatasetSpec("table", "iceberg://lake.clicks", options={**options, "sr.snapshot": str(pinned)},
                           records_per_shard=1_000)  # fmt: skip
        info = admin.register_dataset(spec).dataset
        assert {p.id.split(":", 1)[0] for p in info.partitions} == {f"s{pinned}"}
        assert sum(p.end - p.start for p in info.partitions) == 10_000
        lone = start_ledger_worker(master, "table", ledger, name="w0", batch_size=250, extra=["--pause-at-batch", "12"])
        wait_until(lambda: _stopped(lone.pid), 120, "w0 to stop itself after its 12th batch")
        lone.kill()
        lone.wait()
        at = _applied(ledger)
        assert at == 12 * 250
        workers = [start_ledger_worker(master, "table", ledger, name=n, batch_size=250) for n in ("w0", "w1")]
        for proc in workers:
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0, out.decode(errors="replace")
        cut, cursor = admin.prepare_cut()
        admin.commit_cut(cut)
        assert admin.describe_dataset("table").finished
    finally:
        admin.close()
    report = Ledger(ledger).verify(np.arange(10_000))
    assert report.exact and report.catchups >= 1, f"{report} (a worker killed at {at} rows applied)"
    assert {k.partition.split(":", 1)[0] for k in cursor.only("table").keys()} == {f"s{pinned}"}


def test_a_followed_table_trains_each_appended_snapshot_once(tmp_path: Path) -> None:
    """``sr.follow``: the pinned snapshot, then two appended snapshots while ledger workers run (one SIGKILLed): each
    row once, the cursor naming the snapshots; a delete stops it. (A compaction's ``replace`` snapshot is not
    tested: pyiceberg 0.12 cannot commit one.)"""
    catalog, options = _catalog(tmp_path)
    table = catalog.create_table("lake.clicks", schema=_rows(range(0)).schema)
    table.append(_rows(range(0, 3_000)))
    first = table.current_snapshot().snapshot_id
    job = StreamJob(tmp_path, "iceberg://lake.clicks", {**options, "sr.snapshot": str(first), "sr.follow": "true",
                    "sr.max_delay_ms": "100"}, records_per_shard=500, workers=2, batch_size=250)  # fmt: skip
    try:
        job.start()
        wait_until(lambda: job.applied() >= 3_000, 60, "the pinned snapshot applied")
        table.append(_rows(range(3_000, 5_000)))
        second = table.current_snapshot().snapshot_id
        wait_until(lambda: job.applied() >= 3_250, 60, "the second snapshot being applied")
        job.kill_worker(random.Random(0))
        table.append(_rows(range(5_000, 6_500)))
        third = table.current_snapshot().snapshot_id
        report, cursor, _ = job.finish(6_500, timeout=120)
        assert report.exact, f"{job.events}: {report}\n{job.logs()}"
        tags = {k.partition.split(":", 1)[0] for k in cursor.only("stream").keys()}
        assert tags == {f"s{first}", f"s{second}", f"s{third}"}
        table.delete("id < 10")
        with job.admin() as admin:
            wait_until(lambda: "changes rows" in admin.describe_dataset("stream").error, 30, "the refusal")
    finally:
        job.stop()
