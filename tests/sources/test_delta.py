"""A Delta table as a batch dataset (sources/delta.py): pinned to a version, sharded by data file and row group."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from deltalake import WriterProperties, write_deltalake

from streamrover.shard_service import DatasetSpec, InvalidArgumentError, NotFoundError, ShardClient
from streamrover.testing.ledger import Ledger
from streamrover.testing.procs import MasterProcess, start_ledger_worker
from tests.helpers import wait_until
from tests.sources.stream_job import StreamJob

pytestmark = pytest.mark.slow


def _append(path: Path, ids: range, partition_by: list[str] | None = None) -> None:
    table = pa.table({"id": pa.array(ids, pa.int64()), "day": pa.array([i % 3 for i in ids], pa.int64())})
    props = WriterProperties(max_row_group_size=2_000)
    write_deltalake(str(path), table, mode="append", writer_properties=props, partition_by=partition_by)


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def _applied(ledger: Path) -> int:
    led = Ledger(ledger)
    try:
        return int(led._db.execute("SELECT COALESCE(SUM(count), 0) FROM chunks").fetchone()[0])
    finally:
        led.close()


def test_a_pinned_version_trains_exactly_once_under_a_worker_kill(tmp_path: Path, master: MasterProcess) -> None:
    """Three versions are written; the dataset is pinned to the second. Two ledger workers, one SIGKILLed mid-run:
    the ledger holds exactly the rows of version 1 (versions 0 and 1's appends), and the cursor names the version."""
    table = tmp_path / "clicks"
    _append(table, range(0, 12_000))  # version 0
    _append(table, range(12_000, 20_000))  # version 1
    _append(table, range(20_000, 26_000))  # version 2: after the pin, never trained
    ledger = tmp_path / "ledger.db"
    Ledger(ledger).close()
    admin = ShardClient(master.address, token=master.token, heartbeat=False, timeout=60)
    try:
        spec = DatasetSpec("table", f"delta://{table}", options={"sr.version": "1"}, records_per_shard=1_000)
        info = admin.register_dataset(spec).dataset
        assert {p.id.split(":", 1)[0] for p in info.partitions} == {"v1"}
        assert sum(p.end - p.start for p in info.partitions) == 20_000
        # w0 reads alone and stops itself (SIGSTOP) after writing its 30th batch, before acking it; SIGKILLed there.
        lone = start_ledger_worker(master, "table", ledger, name="w0", batch_size=250, extra=["--pause-at-batch", "30"])
        wait_until(lambda: _stopped(lone.pid), 120, "w0 to stop itself after its 30th batch")
        lone.kill()
        lone.wait()
        at = _applied(ledger)
        assert at == 30 * 250
        workers = {
            name: start_ledger_worker(master, "table", ledger, name=name, batch_size=250) for name in ("w0", "w1")
        }
        for proc in workers.values():
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0, out.decode(errors="replace")
        cut, cursor = admin.prepare_cut()
        admin.commit_cut(cut)
        assert admin.describe_dataset("table").finished
    finally:
        admin.close()
    report = Ledger(ledger).verify(np.arange(20_000))
    assert report.exact, f"{report} (a worker killed at {at} rows applied)"
    assert report.catchups >= 1  # the killed batch was written, not acked: its next lease caught up
    print(f"killed w0 at {at} rows applied: {report}")
    keys = list(cursor.only("table").keys())
    assert keys and all(k.partition.startswith("v1:") for k in keys)  # the snapshot is in the cursor


def test_a_table_that_cannot_be_read_as_pinned_is_refused(tmp_path: Path, master: MasterProcess) -> None:
    """A version the table does not have, a missing table and a partitioned table are refused at registration."""
    table, parted = tmp_path / "t", tmp_path / "p"
    _append(table, range(100))
    _append(parted, range(100), partition_by=["day"])
    admin = ShardClient(master.address, token=master.token, heartbeat=False, timeout=60)
    try:
        with pytest.raises(NotFoundError, match="cannot open version 4 of the Delta table"):
            admin.register_dataset(DatasetSpec("a", f"delta://{table}", options={"sr.version": "4"}))
        with pytest.raises(NotFoundError, match="no Delta table at"):
            admin.register_dataset(DatasetSpec("b", f"delta://{tmp_path / 'none'}"))
        with pytest.raises(InvalidArgumentError, match="partitioned by day"):
            admin.register_dataset(DatasetSpec("c", f"delta://{parted}"))
    finally:
        admin.close()


def test_a_followed_table_trains_each_appended_version_once(tmp_path: Path) -> None:
    """``sr.follow``: the pinned version, then each appended version as new shards while ledger workers run (one
    SIGKILLed after the first append); a compaction (OPTIMIZE) in between brings nothing new. Each row is applied
    exactly once, the cursor names the version that brought it, and a later DELETE stops the dataset, in status."""
    from deltalake import DeltaTable


    table = tmp_path / "clicks"
    _append(table, range(0, 3_000))  # version 0: pinned
    options = {"sr.version": "0", "sr.follow": "true", "sr.max_delay_ms": "100"}
    job = StreamJob(tmp_path, f"delta://{table}", options, records_per_shard=500, workers=2, batch_size=250)
    try:
        job.start()
        wait_until(lambda: job.applied() >= 3_000, 60, "version 0 applied")
        _append(table, range(3_000, 5_000))  # version 1
        wait_until(lambda: job.applied() >= 3_250, 60, "version 1 being applied")
        job.kill_worker(random.Random(0))
        DeltaTable(str(table)).optimize.compact()  # version 2: the same rows rearranged, dataChange false
        _append(table, range(5_000, 6_500))  # version 3
        report, cursor, _ = job.finish(6_500, timeout=120)
        assert report.exact, f"{job.events}: {report}\n{job.logs()}"
        versions = {k.partition.split(":", 1)[0] for k in cursor.only("stream").keys()}
        assert versions == {"v0", "v1", "v3"}
        DeltaTable(str(table)).delete("id < 10")  # version 4: rows removed, cannot be followed
        with job.admin() as admin:
            wait_until(lambda: "removes or rewrites rows" in admin.describe_dataset("stream").error, 30, "the refusal")
            assert "version 4 of the Delta table" in admin.describe_dataset("stream").error
    finally:
        job.stop()


def test_a_followed_table_stops_at_a_schema_change_naming_the_version(tmp_path: Path) -> None:
    """Source level (no master): a version that changes the schema is refused, naming it; the versions before it
    are kept, and a later poll says the same."""
    from streamrover.sources.api import SourceSchemaError
    from streamrover.sources.delta import DeltaSource

    table = tmp_path / "t"
    _append(table, range(100))  # version 0
    source = DeltaSource(f"delta://{table}", options={"sr.version": "0", "sr.follow": "true"})
    assert sum(p.end for p in source.partitions()) == 100
    _append(table, range(100, 150))  # version 1
    wider = pa.table({"id": pa.array([1], pa.int64()), "day": pa.array([1], pa.int64()), "x": pa.array([0.5])})
    write_deltalake(str(table), wider, mode="append", schema_mode="merge")  # version 2: a new column
    for _ in range(2):
        with pytest.raises(SourceSchemaError, match=r"version 2 of the Delta table .* changes the table's metadata"):
            source.poll()
    assert {p.id.split(":")[0] for p in source._log.partitions} == {"v1"}  # type: ignore[union-attr]
