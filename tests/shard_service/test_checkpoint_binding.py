"""Flash checkpoints bound to the shard service: restoring checkpoint K resets the cursor to K's manifest.

The model is a per-record counter (a ledger inside the model state). It trains
from a file dataset, acking each batch with its step, and checkpoints every few
steps through ``Checkpointer(binder=ShardClient)``. Then the trainer "crashes"
(its live state is dropped), restores a checkpoint, the shard service cursor is
checked against that checkpoint's manifest (also after the master is SIGKILLed
and restarted), and training goes on to the end: every record counted once.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from streamrover.ckpt import Checkpointer, CheckpointFallbackWarning, RetentionPolicy
from streamrover.ckpt.layout import read_manifest
from streamrover.cursor import DataCursor
from streamrover.shard_service import DatasetSpec, LeaseLostError, ShardClient
from streamrover.testing.procs import MasterProcess
from tests.helpers import write_parquet_dataset

ROWS = 20_000


def _train(
    client: ShardClient,
    ckpt: Checkpointer,
    state: dict[str, np.ndarray],
    step: int,
    stop_at: int | None,
    every: int = 5,
) -> int:
    """Consume until the dataset ends (or ``stop_at`` steps); checkpoint every ``every`` steps."""
    for shard in client.shards("rows"):
        try:
            for batch in shard.batches(500):
                ids = batch.records.column("id").to_numpy()
                np.add.at(state["seen"], ids, 1)
                state["w"] += 0.01 * ids.mean()
                step += 1
                shard.ack(batch.end, step=step)
                if step % every == 0:
                    ckpt.save(step, state)
                    ckpt.wait(timeout=60)
                if stop_at is not None and step >= stop_at:
                    return step
        except LeaseLostError:  # revoked by a restore: its records are read again by the next lease
            continue
    return step


def _manifest_cursor(ckpt: Checkpointer, step: int) -> DataCursor:
    return DataCursor.from_json(read_manifest(ckpt.storage, step)["cursor"])


def test_restore_resets_the_cursor_to_the_manifest_even_after_a_master_restart(
    tmp_path: Path, master: MasterProcess
) -> None:
    write_parquet_dataset(tmp_path / "data", ROWS, files=2, row_group_size=2_500)
    client = ShardClient(master.address, token=master.token, timeout=60)
    client.register_dataset(DatasetSpec("rows", str(tmp_path / "data"), records_per_shard=1_000))
    ckpt = Checkpointer(str(tmp_path / "ckpt"), binder=client, saver="thread", retention=RetentionPolicy(keep_last=10))
    state = {"seen": np.zeros(ROWS, np.int32), "w": np.zeros(4, np.float64)}
    step = _train(client, ckpt, state, 0, stop_at=23)  # checkpoints at steps 5, 10, 15, 20
    assert step == 23

    # Crash: the live state (3 steps past checkpoint 20) is gone. Restore the newest checkpoint.
    loaded = ckpt.load(memory=False)
    assert loaded.step == 20
    committed, acked = client.get_cursor()
    manifest_cursor = _manifest_cursor(ckpt, 20)
    assert loaded.cursor == manifest_cursor
    assert committed == manifest_cursor and acked == manifest_cursor, "restore must reset the service to K's cursor"
    assert int(loaded.state["seen"].sum()) == manifest_cursor.size(), "the model holds exactly the cursor's records"

    master.kill()
    master.start()  # same journal: the restored cursor survives the master's death
    committed, acked = client.get_cursor()
    assert committed == manifest_cursor and acked == manifest_cursor

    # An older checkpoint (K = 15) when the newer one is unreadable: the service follows it.
    shutil.rmtree(tmp_path / "ckpt" / "step-000000000020" / "rank-00000", ignore_errors=True)
    for f in (tmp_path / "ckpt" / "step-000000000020").glob("*.safetensors"):
        f.write_bytes(b"torn")
    with pytest.warns(CheckpointFallbackWarning):
        older = ckpt.load(memory=False)
    assert older.step == 15
    assert client.get_cursor()[0] == _manifest_cursor(ckpt, 15)

    # Train on from checkpoint 15 to the end: every record in the model exactly once.
    state = {k: np.array(v) for k, v in older.state.items()}
    _train(client, ckpt, state, older.step, stop_at=None)
    assert np.all(state["seen"] == 1), f"{int((state['seen'] != 1).sum())} records not seen exactly once"
    ckpt.close(unlink=True)
    client.close()
