"""A slow persist still commits (a real master; storage whose writes are held until the test releases them).

A checkpoint's persist blocks while training saves 44 more snapshots (more than the master keeps of
cuts that are not being persisted). The cut of the persisted checkpoint must still commit, and so must
the newest one, after which the journal holds no acked shard and no pending cut. A commit that cannot
land says why in ``status``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from streamrover.ckpt import Checkpointer, RetentionPolicy
from streamrover.ckpt.layout import read_manifest
from streamrover.cursor import DataCursor
from streamrover.shard_service import DatasetSpec, NotFoundError, ShardClient
from streamrover.shard_service.master.cuts import MAX_PREPARED_CUTS
from streamrover.testing.procs import MasterProcess
from tests.helpers import write_parquet_dataset

from .gated_fs import GatedFS

pytestmark = pytest.mark.timeout(300)

SHARD = 20
SAVES = 45  # the first save's persist outlasts the 44 saves after it


def _ack_one_shard(client: ShardClient, step: int) -> None:
    _, leased = client.lease("rows", max_shards=1, wait=10.0)
    shard = leased[0]
    end = shard.lease.start
    for batch in shard.batches(SHARD):
        end = batch.end
    shard.ack(end, step=step)
    client.flush()


@pytest.fixture
def client(tmp_path: Path, master: MasterProcess) -> ShardClient:
    write_parquet_dataset(tmp_path / "data", SHARD * 60, files=1, row_group_size=SHARD * 10)
    c = ShardClient(master.address, token=master.token, timeout=60)
    c.register_dataset(DatasetSpec("rows", str(tmp_path / "data"), records_per_shard=SHARD))
    c.join()
    return c


def test_a_persist_slower_than_40_saves_still_commits_and_the_journal_compacts(client: ShardClient) -> None:
    url = GatedFS.reset()
    GatedFS.gate.clear()  # every write waits until the test opens the gate
    ckpt = Checkpointer(url, binder=client, saver="thread", retention=RetentionPolicy(keep_last=5))
    try:
        _ack_one_shard(client, step=1)
        ckpt.save(1, {"w": np.full(8, 1.0)})
        assert GatedFS.entered.wait(60), "the persist of step 1 never started"
        for step in range(2, SAVES + 1):  # training goes on while step 1 is being persisted
            _ack_one_shard(client, step)
            ckpt.save(step, {"w": np.full(8, float(step))})
        assert client.status().persisting_cuts >= 2
        GatedFS.gate.set()
        results = ckpt.wait(timeout=120)  # raises SaverError if a durable checkpoint's cut did not commit
        persisted = sorted(r.step for r in results if r.manifest_published)
        assert persisted[0] == 1 and persisted[-1] == SAVES, persisted
        status = client.status()
        assert status.cut_commit_error == "" and status.persisting_cuts == 0
        committed = client.get_cursor()[0]
        assert committed == DataCursor.from_json(read_manifest(ckpt.storage, SAVES)["cursor"])
        assert committed.size() == SHARD * SAVES
        info = client.describe_dataset("rows")
        assert info.shards.acked == 0 and info.shards.committed == SAVES, "the committed shards were compacted"
    finally:
        GatedFS.reset()
        ckpt.close(unlink=True)
        client.close()


def test_a_commit_that_cannot_land_says_why_in_status(client: ShardClient) -> None:
    try:
        _ack_one_shard(client, step=1)
        first, _ = client.prepare_cut()  # a memory-only snapshot's cut: evicted by newer ones
        for _ in range(MAX_PREPARED_CUTS):
            client.prepare_cut()
        with pytest.raises(NotFoundError, match="evicted"):
            client.commit_cut(first)
        assert f"cut {first}" in client.status().cut_commit_error
        assert "evicted" in client.status().cut_commit_error

        doomed, _ = client.prepare_cut(2, persisting=True)
        client.restore_cursor(client.get_cursor()[0])
        with pytest.raises(NotFoundError, match="discarded by a restore"):
            client.commit_cut(doomed)
        assert "discarded by a restore" in client.status().cut_commit_error

        newest, _ = client.prepare_cut(3, persisting=True)
        client.commit_cut(newest)
        assert client.status().cut_commit_error == "", "a successful commit clears the error"
    finally:
        client.close()
