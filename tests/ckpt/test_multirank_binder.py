"""Multi-rank checkpoints bound to a real master: one checkpoint step is one cut for every rank.

Two gloo ranks (real processes) each lease a shard of a file dataset from a real master, ack what
they read with the step, and save their part (DDP: every rank a full copy; FSDP2: each rank its
shard) through ``Checkpointer(binder=ShardClient)``. The checkpoint must be published (MANIFEST.json
with one cut id), that cut committed in the master, and a load must reset the master's cursor to the
manifest's, after later acks moved it on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from streamrover.ckpt import Checkpointer, RetentionPolicy
from streamrover.ckpt.layout import MANIFEST, read_manifest, step_dir
from streamrover.ckpt.torch_adapter import TorchCheckpoint, fsdp_sharded_state, load_fsdp_sharded_state
from streamrover.cursor import DataCursor
from streamrover.shard_service import DatasetSpec, ShardClient
from streamrover.testing.procs import MasterProcess
from tests.helpers import write_parquet_dataset

pytestmark = pytest.mark.timeout(300)

ROWS = 4_000


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _read_and_ack(client: ShardClient, step: int) -> None:
    """Lease one shard, ack its first batch with ``step``, and wait until the master recorded it."""
    _, leased = client.lease("rows", max_shards=1, wait=10.0)
    assert leased, "no shard leased"
    shard = leased[0]
    batch = next(iter(shard.batches(100)))
    shard.ack(batch.end, step=step)
    client.flush()


def _worker(rank: int, world: int, mode: str, address: str, token: str, root: str, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    client = ShardClient(address, token=token, name=f"rank{rank}", timeout=60)
    client.join()
    try:
        model = _model()
        if mode == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            fully_shard(model[0])
            fully_shard(model[2])
            fully_shard(model)
        else:
            model = torch.nn.parallel.DistributedDataParallel(model)
        optim = torch.optim.Adam(model.parameters(), lr=0.01)
        model(torch.randn(5, 6)).pow(2).sum().backward()
        optim.step()
        ckpt = Checkpointer(root, rank=rank, world_size=world, binder=client, saver="thread",
                            retention=RetentionPolicy(keep_last=5))  # fmt: skip
        adapter = TorchCheckpoint(ckpt, model, optim, replicate=True)
        _read_and_ack(client, step=1)
        dist.barrier()  # every rank's acks for step <= 1 are in the master before any rank takes the cut
        if mode == "fsdp2":
            ckpt.save(1, fsdp_sharded_state(model, optim))
        else:
            adapter.save(1)
        ckpt.wait(timeout=120)
        dist.barrier()  # both parts written: the manifest is published and its cut committed (if ever)
        _read_and_ack(client, step=2)  # progress after the checkpoint, to be thrown away by the restore
        dist.barrier()
        if rank == 0:
            committed_after_save, acked_before = client.get_cursor()
        dist.barrier()
        loaded = ckpt.load(memory=False)  # every rank restores: the same cursor, idempotent
        if mode == "fsdp2":
            load_fsdp_sharded_state(loaded.state, model, optim)
        else:
            adapter.load()
        dist.barrier()
        if rank == 0:
            committed, acked = client.get_cursor()
            Path(out).write_text(json.dumps({
                "loaded_step": loaded.step,
                "loaded_cursor": loaded.cursor.to_json(),
                "committed": committed.to_json(),
                "acked": acked.to_json(),
                "acked_before": acked_before.to_json(),
                "committed_after_save": committed_after_save.to_json(),
            }))  # fmt: skip
        dist.barrier()
        ckpt.close(unlink=True)
    finally:
        client.close()
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["ddp-every-rank", "fsdp2"])
def test_two_ranks_with_a_binder_publish_one_cut_commit_it_and_restore_it(
    tmp_path: Path, master: MasterProcess, mode: str
) -> None:
    write_parquet_dataset(tmp_path / "data", ROWS, files=2, row_group_size=500)
    with ShardClient(master.address, token=master.token, timeout=60) as client:
        client.register_dataset(DatasetSpec("rows", str(tmp_path / "data"), records_per_shard=500))
    root = str(tmp_path / "ckpt")
    out = tmp_path / "out.json"
    mp.spawn(_worker, args=(2, mode, master.address, master.token, root, str(tmp_path / "store"), str(out)), nprocs=2)

    from streamrover.ckpt.storage import Storage

    manifest_path = Path(root) / step_dir(1) / MANIFEST
    assert manifest_path.exists(), f"{mode}: both parts written but no {MANIFEST} published"
    manifest = read_manifest(Storage(root), 1)
    assert len(manifest["cut_ids"]) == 1, f"parts of several cuts: {manifest['cut_ids']}"
    result: dict[str, Any] = json.loads(out.read_text())
    cursor = DataCursor.from_json(manifest["cursor"])
    assert cursor.size() == 200, "the cut holds both ranks' acks (100 records each)"
    assert DataCursor.from_json(result["committed_after_save"]) == cursor, "the manifest's cut was committed"
    acked_before = DataCursor.from_json(result["acked_before"])
    assert acked_before.size() == 400 and acked_before != cursor
    assert result["loaded_step"] == 1
    assert DataCursor.from_json(result["loaded_cursor"]) == cursor
    assert DataCursor.from_json(result["committed"]) == cursor, "the restore resets the committed cursor to K's"
    assert DataCursor.from_json(result["acked"]) == cursor, "acks after K are thrown away by the restore"
