"""A storage blip is not a fresh start (a real master; storage that fails on cue).

An I/O error while reading checkpoints is retried with backoff and, if it lasts, raised as
:class:`StorageUnavailableError`: no checkpoint is skipped as corrupt, and the master's cursor is not
touched. The master refuses to reset to an empty cursor while it has committed progress unless the
caller says it means to throw that away (``discard_committed``; CLI ``--discard-committed``), so a
trainer that finds no loadable checkpoint fails loudly instead of rewinding the job to nothing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from streamrover.ckpt import Checkpointer, StorageUnavailableError
from streamrover.ckpt.layout import part_names, step_dir
from streamrover.cursor import DataCursor
from streamrover.shard_service import DatasetSpec, FailedPreconditionError, ShardClient
from streamrover.testing.procs import MasterProcess, python_env
from streamrover.trainers.torch.session import StreamSession
from tests.helpers import write_parquet_dataset

from .gated_fs import GatedFS

pytestmark = pytest.mark.timeout(300)


def _ack_some(client: ShardClient, step: int, records: int = 100) -> None:
    _, leased = client.lease("rows", max_shards=1, wait=10.0)
    shard = leased[0]
    batch = next(iter(shard.batches(records)))
    shard.ack(batch.end, step=step)
    client.flush()


@pytest.fixture
def client(tmp_path: Path, master: MasterProcess) -> ShardClient:
    write_parquet_dataset(tmp_path / "data", 2_000, files=1, row_group_size=500)
    c = ShardClient(master.address, token=master.token, timeout=60)
    c.register_dataset(DatasetSpec("rows", str(tmp_path / "data"), records_per_shard=500))
    c.join()
    return c


def test_a_storage_blip_is_retried_and_an_outage_fails_loudly_without_touching_the_cursor(
    client: ShardClient,
) -> None:
    url = GatedFS.reset()
    ckpt = Checkpointer(url, binder=client, saver="thread")
    ckpt.storage.read_backoff = 0.01  # the test's blips are injected: no need to wait for them
    try:
        _ack_some(client, step=1)
        ckpt.save(1, {"w": np.arange(8.0)})
        ckpt.wait(timeout=60)
        committed = client.get_cursor()[0]
        assert committed.size() == 100
        _ack_some(client, step=2)

        GatedFS.fail_reads = 3  # a blip: three reads fail, the fourth works
        loaded = ckpt.load(memory=False)
        assert loaded.step == 1 and GatedFS.failed_reads == 3
        assert client.get_cursor() == (committed, committed), "the blip was ridden out: restored to step 1"

        _ack_some(client, step=2)
        GatedFS.fail_reads = 10**6  # an outage longer than the retries
        with pytest.raises(StorageUnavailableError, match="no checkpoint was skipped"):
            ckpt.load(memory=False)
        now_committed, now_acked = client.get_cursor()
        assert now_committed == committed and now_acked.size() == 200, "a failed load leaves the master alone"
    finally:
        GatedFS.reset()
        ckpt.close(unlink=True)
        client.close()


def _cli(master: MasterProcess, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "streamrover.cli", "restore", *args, "--master", master.address,
           "--token", master.token]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, env=python_env(), timeout=120)


def test_the_master_refuses_an_empty_reset_while_it_has_committed_progress(
    client: ShardClient, master: MasterProcess
) -> None:
    try:
        assert client.restore_cursor(DataCursor()).leases_revoked == 0  # nothing committed yet: a reset is fine
        _ack_some(client, step=1)
        cut_id, cursor = client.prepare_cut(1)
        client.commit_cut(cut_id)
        with pytest.raises(FailedPreconditionError, match="discard_committed"):
            client.restore_cursor(DataCursor())
        refused = _cli(master, "--empty")
        assert refused.returncode == 2 and "--discard-committed" in refused.stdout, refused.stdout + refused.stderr
        assert client.get_cursor()[0] == cursor, "a refused reset changes nothing"
        done = _cli(master, "--empty", "--discard-committed")
        assert done.returncode == 0 and "empty cursor" in done.stdout, done.stdout + done.stderr
        assert client.get_cursor()[0] == DataCursor()
    finally:
        client.close()


def test_a_trainer_that_finds_no_loadable_checkpoint_fails_instead_of_starting_over(
    tmp_path: Path, client: ShardClient, master: MasterProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = str(tmp_path / "ckpt")
    first = Checkpointer(root, binder=client, saver="thread")
    _ack_some(client, step=1)
    first.save(1, {"w": np.arange(8.0)})
    first.wait(timeout=60)
    first.close(unlink=True)
    committed = client.get_cursor()[0]
    tensors = Path(root) / step_dir(1) / part_names(0)[0]
    tensors.write_bytes(b"\0" * tensors.stat().st_size)  # the only checkpoint is unreadable
    monkeypatch.setenv("STREAMROVER_CKPT_JOB", "blip")
    monkeypatch.setenv("STREAMROVER_CKPT_SAVER", "thread")
    with pytest.raises(FailedPreconditionError, match="refusing to reset to an empty cursor"):
        StreamSession(torch.nn.Linear(2, 2), master=master.address, token=master.token, ckpt_dir=root)
    assert client.get_cursor()[0] == committed, "the committed progress is still there"
    client.close()
