"""A worker client forgets what it no longer holds: revoked leases leave its heartbeats and its memory."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

from streamrover.cursor import DataCursor
from streamrover.shard_service import DatasetSpec, ShardClient
from streamrover.testing.procs import MasterProcess
from tests.helpers import wait_until, write_parquet_dataset


def test_leases_revoked_by_another_client_are_dropped_and_not_kept_alive(tmp_path: Path) -> None:
    """A restore by an admin revokes a worker's leases; the worker learns it from a heartbeat. Its reader must
    stop, its heartbeats must stop reporting those leases, and the client must not keep them (seen in a soak:
    revoked leases stayed held for good, ~2,000 in 4 minutes, reported in every heartbeat)."""
    write_parquet_dataset(tmp_path / "data", 4_000, files=2, row_group_size=1_000)
    with MasterProcess(tmp_path / "master", lease_ttl=2.0) as master:
        with ShardClient(master.address, token=master.token, heartbeat=False) as admin:
            admin.register_dataset(DatasetSpec("rows", str(tmp_path / "data"), records_per_shard=1_000))
            with ShardClient(master.address, token=master.token, heartbeat=True, timeout=30) as worker:
                _, shards = worker.lease("rows", max_shards=2, wait=10)
                assert len(shards) == 2 and len(worker.leases.progress()) == 2
                assert admin.restore_cursor(DataCursor()).leases_revoked == 2
                wait_until(lambda: all(s.revoked for s in shards), 30, "the heartbeat to bring the revocation")
                assert worker.leases.progress() == [], "revoked leases are still reported as held"
                refs = [weakref.ref(s) for s in shards]
                shards.clear()
                gc.collect()
                assert all(r() is None for r in refs), "the client keeps revoked leases alive"
