"""Memory never runs ahead of the journal (issue 15, item 9): a journal write that fails stops the master.

The state dir lives on a small tmpfs that the test fills: a real full filesystem, not a mock.
"""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamrover.shard_service import DatasetSpec, ShardClient, ShardServiceError
from streamrover.testing.procs import MasterProcess
from tests.helpers import wait_until, write_parquet_dataset

ROWS = 20_000


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def _fill(path: Path) -> None:
    """Write ``path`` until the filesystem has no space left."""
    block = b"\0" * (64 << 10)
    with open(path, "wb", buffering=0) as fh:
        while True:
            try:
                fh.write(block)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                break
    with open(path, "ab", buffering=0) as fh:  # the last few bytes too
        for _ in range(64 << 10):
            try:
                fh.write(b"\0" * 512)
            except OSError:
                break


@pytest.mark.slow
def test_a_failed_journal_write_stops_the_master_and_a_restart_replays_the_journal(
    tmp_path: Path, small_fs: Path
) -> None:
    write_parquet_dataset(tmp_path / "data", ROWS, files=1, row_group_size=ROWS)
    master = MasterProcess(small_fs / "state", lease_ttl=120, log_path=tmp_path / "master.log")
    master.start()
    admin = ShardClient(master.address, token=master.token, heartbeat=False, timeout=5)
    admin.register_dataset(DatasetSpec("rows", str(tmp_path / "data"), records_per_shard=ROWS))
    worker = ShardClient(master.address, token=master.token, heartbeat=False, timeout=5)
    worker.join()
    _, (shard,) = worker.lease("rows")
    lease = shard.lease
    worker.ack(lease, 1, wait=True)

    _fill(small_fs / "filler")
    answered = 1  # the highest position the master said it recorded
    failed_at = 0
    for position in range(2, ROWS):
        try:
            worker.ack(lease, position, wait=True)
        except ShardServiceError as exc:
            failed_at, first_error = position, exc
            break
        answered = position
    assert failed_at, "the acks never hit the full filesystem"

    # the retry of that ack must not be answered "duplicate, OK": it was never durable
    try:
        retry = worker.ack(lease, failed_at, wait=True)
    except ShardServiceError:
        retry = None
    assert retry is None, f"ack {failed_at} failed ({first_error}) but its retry was answered {retry}"
    assert master.proc is not None
    wait_until(lambda: master.proc is not None and master.proc.poll() is not None, 30, "the master to stop")
    assert master.proc.returncode not in (0, None), master.log_tail()
    log = master.log_tail()
    assert "journal" in log and "full" in log, log

    (small_fs / "filler").unlink()
    master.start()  # replays the journal: exactly the acks that were answered
    admin.timeout = worker.timeout = 60.0  # the channels reconnect with backoff: give them time on a busy machine
    assert admin.get_cursor()[1].size() == answered
    assert worker.ack(lease, failed_at, wait=True).duplicate is False
    worker.close()
    admin.close()
    master.stop()
