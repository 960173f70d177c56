"""One master, a thousand workers: each holds its own session stream, and every shard is acked exactly once.

1,000 simulated workers (:mod:`streamrover.testing.swarm`: 250 per process, each its own ``Join``, its own
``WorkerSession`` stream over real gRPC) first answer a heartbeat on their stream; the master's
``streamrover_worker_sessions`` gauge must then count all 1,000 (a master that refused some would make
those workers fall back to unary calls: an older master refused the 49th). Then they lease and ack a
batch dataset of 2,000 one-record shards until its END: the ledger of acks the master recorded holds
every shard once, no ack was refused, and the master counts every shard acked.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from streamrover.shard_service import DatasetSpec, ShardClient
from streamrover.testing.procs import MasterProcess
from streamrover.testing.swarm import Swarm
from tests.helpers import write_parquet_dataset
from tests.shard_service.dashboard_job import scrape

WORKERS = 1000
SHARDS = 2000


@pytest.mark.slow
def test_a_thousand_workers_each_hold_a_session_and_ack_exactly_once(tmp_path: Path) -> None:
    # a long lease: 1,000 workers on a loaded 2-core machine may answer slowly; nothing here should expire
    master = MasterProcess(tmp_path / "master", lease_ttl=300.0)
    master.start()
    try:
        write_parquet_dataset(tmp_path / "data", SHARDS, files=1, row_group_size=SHARDS)
        with ShardClient(master.address, token=master.token, heartbeat=False, timeout=60) as admin:
            admin.register_dataset(DatasetSpec("rows", str(tmp_path / "data"), records_per_shard=1))
            with Swarm(master.address, master.token, "rows", WORKERS, processes=4) as swarm:
                assert swarm.start(timeout=240) == WORKERS, "every worker's stream answered its heartbeat"
                m = scrape(master)
                assert m[("streamrover_worker_sessions", ())] == WORKERS, "the master serves every worker a stream"
                assert m[("streamrover_workers", ())] == WORKERS
                result = swarm.run(timeout=240)
            assert not result.errors, result.errors[:5]
            ledger = Counter(shard for shard, _ in result.acked)
            assert len(ledger) == SHARDS and set(ledger.values()) == {1}, "each shard acked once, none refused"
            info = admin.describe_dataset("rows")
            assert info.finished and info.shards.acked + info.shards.committed == SHARDS
            assert len(result.lease_rtt) >= SHARDS
    finally:
        master.stop()
