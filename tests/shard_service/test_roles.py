"""Two roles (issue 33, item 3): the worker token works a job, only the admin token administers it.

A real master in this process, real gRPC clients: the worker token (what the operator hands workers) may lease,
ack, cut, restore to a checkpoint's cursor and use the key-value store, and is refused PERMISSION_DENIED,
naming the call and the role, when it removes a dataset, adds one, restores to anything else or stops the
master; the admin token may. Tokens given as a file are reloaded when the file changes.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from streamrover.cursor import DataCursor
from streamrover.shard_service import (
    DatasetSpec,
    MasterServer,
    PermissionDeniedError,
    ShardClient,
    UnauthenticatedError,
)
from streamrover.shard_service.master.auth import Tokens
from streamrover.testing.procs import python_env
from streamrover.tokens import new_token, worker_token
from tests.helpers import write_parquet_dataset


def _client(master: MasterServer, token: str) -> ShardClient:
    return ShardClient(master.address, token=token, heartbeat=False, timeout=5, tls=None)


def test_a_worker_token_works_the_job_but_cannot_administer_it(tmp_path: Path) -> None:
    write_parquet_dataset(tmp_path / "data", 400, files=1, row_group_size=100)
    spec = DatasetSpec("rows", str(tmp_path / "data"), records_per_shard=100)
    admin_token = new_token()
    master = MasterServer(tmp_path / "state", admin_token)
    admin, worker = _client(master, admin_token), _client(master, worker_token(admin_token))
    try:
        admin.register_dataset(spec)
        assert not worker.register_dataset(spec).created, "a worker may 'ensure' a dataset the admin registered"
        with pytest.raises(PermissionDeniedError, match="RegisterDataset of a new dataset 'more'.*worker role"):
            worker.register_dataset(DatasetSpec("more", str(tmp_path / "data")))

        worker.join()  # a worker's life: lease, ack, cut, the key-value store, a checkpoint's restore
        _, leases = worker.lease("rows", max_shards=2)
        worker.ack(leases[0].lease, leases[0].lease.end, wait=True)
        cut_id, cursor = worker.prepare_cut(step=1)
        worker.commit_cut(cut_id)
        assert worker.kv_set("k", b"v", 0)[0]
        assert worker.restore_cursor(cursor).leases_revoked == 1, "restoring its checkpoint's cursor is a worker's"

        with pytest.raises(PermissionDeniedError, match=r"RemoveDataset \(an administrator's call\).*worker role"):
            worker.remove_dataset("rows")
        with pytest.raises(PermissionDeniedError, match="Restore to a cursor this master did not issue"):
            worker.restore_cursor(DataCursor())  # e.g. skipping or replaying data at will
        with pytest.raises(PermissionDeniedError, match="Restore to a cut or discarding"):
            worker.restore_cut(cut_id)
        with pytest.raises(PermissionDeniedError, match="ResumeDataset"):
            worker.resume_dataset("rows")
        with pytest.raises(PermissionDeniedError, match="Stop"):
            worker.stop("a worker tries")
        assert [d.spec.name for d in admin.list_datasets()] == ["rows"], "nothing a refused call did stays"

        assert admin.restore_cursor(DataCursor(), discard_committed=True).records_requeued == 400
        assert admin.remove_dataset("rows").shards_removed == 4
        admin.stop("test over")
        master.wait()  # the Stop call stopped it: wait returns
        assert master.servicer.stopping
    finally:
        worker.close()
        admin.close()
        master.stop()


def test_tokens_in_files_are_reloaded_when_they_change(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    old, new = new_token(), new_token()
    token_file.write_text(old + "\n")
    master = MasterServer(tmp_path / "state", Tokens(admin_file=token_file))
    try:
        with _client(master, old) as c:
            assert c.list_datasets() == []
        token_file.write_text(new + "\n")  # a rotation (a Secret updated in place): no restart
        with _client(master, old) as c, pytest.raises(UnauthenticatedError):
            c.list_datasets()
        with _client(master, new) as c:
            assert c.list_datasets() == []
        with _client(master, worker_token(new)) as c:  # the worker token follows the admin token
            assert c.status().uptime_seconds >= 0
        token_file.write_text("")  # caught half-written: the token read before holds
        with _client(master, new) as c:
            assert c.list_datasets() == []
    finally:
        master.stop()


def test_a_master_off_loopback_without_tls_warns_in_its_log_and_status(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    token = new_token()
    with caplog.at_level(logging.WARNING):
        master = MasterServer(tmp_path / "state", token, host="0.0.0.0")
    try:
        assert any("INSECURE" in r.getMessage() and "0.0.0.0" in r.getMessage() for r in caplog.records)
        with ShardClient(f"127.0.0.1:{master.port}", token=token, heartbeat=False, tls=None) as c:
            assert "without TLS" in c.status().security_warning
        address = f"127.0.0.1:{master.port}"
        cmd = [sys.executable, "-m", "streamrover.cli", "status", "--master", address, f"--token={token}"]
        shown = subprocess.run(cmd, capture_output=True, text=True, env=python_env(), timeout=60)
        assert "INSECURE" in shown.stdout, shown.stdout + shown.stderr
    finally:
        master.stop()
    quiet = MasterServer(tmp_path / "state2", token)  # 127.0.0.1: nothing to warn about
    assert quiet.security_warning == ""
    quiet.stop()
