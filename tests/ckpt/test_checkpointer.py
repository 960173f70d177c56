"""Checkpointer behaviour with an in-process saver: fallback, retention, cursor binding, multi-rank, storage URLs."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import torch

from streamrover.ckpt import (
    Checkpointer,
    CheckpointError,
    CheckpointFallbackWarning,
    LoadedFrom,
    NoCheckpointError,
    RetentionPolicy,
    SharedMemoryTooSmallError,
    SnapshotRefusedError,
    namespace_for,
    purge_shared_memory,
)
from streamrover.ckpt.layout import MANIFEST, complete_steps, part_names, step_dir
from streamrover.ckpt.shm import SharedBuffer
from streamrover.cursor import DataCursor, PartitionKey

from .conftest import FakeShardService, shm_names


def state_at(step: int) -> dict[str, object]:
    return {"w": np.full((64, 16), step, dtype=np.float32), "step": step}


def save_persisted(ckpt: Checkpointer, steps: list[int]) -> None:
    for step in steps:
        ckpt.save(step, state_at(step))
        ckpt.wait(timeout=60)


def test_load_prefers_memory_when_newer_and_storage_otherwise(root: str) -> None:
    with Checkpointer(root, saver="thread") as ckpt:
        save_persisted(ckpt, [1])
        ckpt.save(2, state_at(2), persist=False)
        mem = ckpt.load()
        assert (mem.step, mem.source) == (2, LoadedFrom.MEMORY)
        assert mem.state["w"][0, 0] == 2
        disk = ckpt.load(memory=False)
        assert (disk.step, disk.source) == (1, LoadedFrom.STORAGE)
    # another "node": same storage, no shared memory of this namespace
    fresh = Checkpointer(root, saver="thread", job="other-node")
    fresh.storage = ckpt.storage
    assert fresh.load().step == 1


def test_a_persisted_step_is_never_saved_to_persist_again(root: str) -> None:
    """Its files would change under a reader (an export, a restore) and a crash mid-rewrite would corrupt it."""
    with Checkpointer(root, saver="thread") as ckpt:
        save_persisted(ckpt, [1])
        part = Path(root) / step_dir(1) / part_names(0)[1]
        before = part.read_bytes()
        with pytest.raises(CheckpointError, match="step 1 was already saved to persist"):
            ckpt.save(1, state_at(1))
        ckpt.save(1, state_at(1), persist=False)  # to shared memory alone it may
        save_persisted(ckpt, [2])
        assert part.read_bytes() == before and complete_steps(ckpt.storage) == [1, 2]


@pytest.mark.parametrize("algo", ["crc32", "sha256"])
def test_corrupted_file_falls_back_to_previous_checkpoint(root: str, algo: str) -> None:
    with Checkpointer(root, saver="thread", checksum=algo) as ckpt:
        save_persisted(ckpt, [1, 2])
    path = Path(root) / step_dir(2) / part_names(0)[0]
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.warns(CheckpointFallbackWarning, match="step 2: .*fails its checksum"):
        loaded = Checkpointer(root, saver="thread").load(memory=False)
    assert loaded.step == 1 and loaded.state["w"][3, 3] == 1
    assert "step 2" in loaded.extra["skipped"][0]


@pytest.mark.parametrize("victim", ["part", "manifest", "truncate"])
def test_damaged_metadata_falls_back(root: str, victim: str) -> None:
    with Checkpointer(root, saver="thread") as ckpt:
        save_persisted(ckpt, [1, 2])
    d = Path(root) / step_dir(2)
    if victim == "part":
        p = d / part_names(0)[1]
        p.write_text(p.read_text().replace('"step":2', '"step":3'))
    elif victim == "manifest":
        p = d / MANIFEST
        p.write_text(p.read_text().replace("rank-00000", "rank-00001"))
    else:
        p = d / part_names(0)[0]
        p.write_bytes(p.read_bytes()[:100])
    with pytest.warns(CheckpointFallbackWarning):
        assert Checkpointer(root, saver="thread").load(memory=False).step == 1


def test_partial_checkpoint_without_manifest_is_not_loaded(root: str) -> None:
    with Checkpointer(root, saver="thread") as ckpt:
        save_persisted(ckpt, [1, 2])
    os.unlink(Path(root) / step_dir(2) / MANIFEST)
    assert complete_steps(ckpt.storage) == [1]
    assert Checkpointer(root, saver="thread").load(memory=False).step == 1


def test_nothing_to_load_is_a_clear_error(root: str) -> None:
    with pytest.raises(NoCheckpointError, match="no consistent checkpoint for rank 0"):
        Checkpointer(root, saver="thread").load()


def test_retention_keeps_last_n_and_every_kth(root: str) -> None:
    with Checkpointer(root, saver="thread", retention=RetentionPolicy(keep_last=2, keep_every=4)) as ckpt:
        save_persisted(ckpt, list(range(1, 10)))
        assert complete_steps(ckpt.storage) == [4, 8, 9]
    assert sorted(os.listdir(root)) == [step_dir(4), step_dir(8), step_dir(9)]
    assert RetentionPolicy(keep_last=1).to_delete([3, 1, 2]) == [1, 2]
    with pytest.raises(ValueError, match="keep_last"):
        RetentionPolicy(keep_last=0)


def test_cursor_binding_prepare_commit_restore(root: str, shard_service: FakeShardService) -> None:
    with Checkpointer(root, saver="thread", binder=shard_service) as ckpt:
        shard_service.ack("p0", 0, 100)
        ckpt.save(1, state_at(1))
        ckpt.wait(timeout=60)
        assert shard_service.committed == [1]
        shard_service.ack("p1", 5, 9)
        ckpt.save(2, state_at(2), persist=False)  # a memory-only cut is never committed
        shard_service.ack("p0", 100, 150)
        ckpt.wait(timeout=60)
        assert shard_service.committed == [1]
        # restore from memory: the cursor of the memory snapshot (step 2)
        loaded = ckpt.load()
        assert (loaded.source, loaded.step, loaded.cut_id) == (LoadedFrom.MEMORY, 2, 2)
        assert shard_service.cursor == shard_service.cuts[2]
        # restore from storage: cursor of checkpoint 1 exactly, and the shard service is reset to it
        loaded = ckpt.load(memory=False)
        expected = DataCursor()
        expected.add(PartitionKey("clicks", 0, "p0"), 0, 100)
        assert loaded.cursor == expected == shard_service.cuts[1]
        assert shard_service.cursor == expected and shard_service.restored[-1] == expected
        assert loaded.cut_id == 1


def test_manifest_published_only_when_every_rank_part_is_written(root: str) -> None:
    cursors = []
    for rank in range(3):
        cursor = DataCursor()
        cursor.add(PartitionKey("clicks", 0, f"p{rank}"), 0, 10 * (rank + 1))
        cursors.append(cursor)
    ranks = [Checkpointer(root, rank=r, world_size=3, saver="thread") for r in range(3)]
    try:
        for rank in (2, 0):
            ranks[rank].save(7, {"w": np.full(4, rank)}, cursor=cursors[rank])
            assert not ranks[rank].wait(timeout=60)[0].manifest_published
        assert complete_steps(ranks[0].storage) == []
        with pytest.raises(NoCheckpointError):
            ranks[1].load(memory=False)
        ranks[1].save(7, {"w": np.full(4, 1)}, cursor=cursors[1])
        assert ranks[1].wait(timeout=60)[0].manifest_published
        for rank in range(3):
            loaded = ranks[rank].load(memory=False)
            assert loaded.state["w"].tolist() == [rank] * 4
            merged = DataCursor()
            for c in cursors:
                merged.update(c)
            assert loaded.cursor == merged  # the manifest cursor is the union of the ranks' cursors
        assert ranks[2].load(memory=False, part=0).state["w"].tolist() == [0] * 4  # "one copy" mode reads part 0
    finally:
        for r in ranks:
            r.close(unlink=True)


def test_fsspec_url_round_trip(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/remote"
    with Checkpointer(url, saver="thread") as ckpt:
        save_persisted(ckpt, [5])
        loaded = ckpt.load(memory=False)
        assert (loaded.step, loaded.state["w"][0, 0]) == (5, 5)
        ckpt.close(unlink=True)
    assert (tmp_path / "remote" / step_dir(5) / MANIFEST).exists()


def test_memory_filesystem_url(tmp_path: Path) -> None:
    url = f"memory://{tmp_path.name}/ck"
    with Checkpointer(url, saver="thread") as ckpt:
        save_persisted(ckpt, [1, 2])
        assert ckpt.load(memory=False).step == 2
        ckpt.close(unlink=True)


def test_persisted_tensors_are_standard_safetensors_without_pickle(root: str) -> None:
    with Checkpointer(root, saver="thread") as ckpt:
        ckpt.save(1, {"a": np.arange(10, dtype=np.int16), "b": np.ones((2, 3), dtype=np.float64)})
        ckpt.wait(timeout=60)
    path = Path(root) / step_dir(1) / part_names(0)[0]
    tensors = safetensors.numpy.load_file(str(path))
    assert sorted(tensors) == ["t0", "t1"]
    assert tensors["t0"].tolist() == list(range(10)) and tensors["t1"].shape == (2, 3)
    assert b"pickle" not in path.read_bytes() and not path.read_bytes().startswith(b"\x80")


def test_zero_copy_memory_load_views_shared_memory(root: str) -> None:
    ckpt = Checkpointer(root, saver="thread")
    ckpt.save(1, {"w": torch.arange(1000.0)}, persist=False)
    view = ckpt.load(zero_copy=True).state["w"]
    copy = ckpt.load(zero_copy=False).state["w"]
    snap = ckpt.engine.newest()
    assert snap is not None
    buf = ckpt.engine.buffers[snap.index]
    assert buf is not None
    ptr = torch.frombuffer(buf.mm, dtype=torch.uint8).data_ptr()
    assert ptr <= view.data_ptr() < ptr + buf.size
    assert not ptr <= copy.data_ptr() < ptr + buf.size
    assert torch.equal(view, copy)
    del view
    ckpt.close(unlink=True)


def test_double_buffering_never_overwrites_the_buffer_being_persisted(root: str) -> None:
    ckpt = Checkpointer(root, saver="thread")
    ckpt.save(1, state_at(1), persist=False)
    first = ckpt.engine.newest()
    assert first is not None
    for step in (2, 3, 4):  # pretend the saver holds buffer `first.index`
        ckpt._busy = {first.index}
        ckpt.save(step, state_at(step), persist=False)
    ckpt._busy = set()
    found = SharedBuffer.open(first.name)
    assert found is not None and found.read_header() is not None
    assert found.read_header()[1]["step"] == 1  # type: ignore[index]
    assert ckpt.load().step == 4
    ckpt.close(unlink=True)
    assert shm_names(ckpt.namespace) == []


def test_dev_shm_too_small_is_a_clear_error(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.statvfs

    class Small:
        f_bavail, f_frsize, f_blocks = 16, 4096, 16384  # 64 KiB free of 64 MiB

    monkeypatch.setattr(os, "statvfs", lambda p: Small() if p == "/dev/shm" else real(p))
    ckpt = Checkpointer(root, saver="thread")
    with pytest.raises(SharedMemoryTooSmallError, match=r"needs .* MiB more, 0\.1 MiB free of 64\.0 MiB.*shm-size"):
        ckpt.save(1, {"w": np.zeros(1 << 20)}, persist=False)


def test_resuming_from_an_older_storage_checkpoint_drops_newer_memory_snapshots(root: str) -> None:
    with Checkpointer(root, saver="thread") as ckpt:
        save_persisted(ckpt, [10])
        ckpt.save(30, state_at(30), persist=False)
        assert ckpt.load().step == 30
        assert ckpt.load(memory=False).step == 10  # the caller chose storage: training resumes from 10
        assert [s.step for s in ckpt.engine.snapshots()] == [10]
        assert ckpt.load().step == 10  # the abandoned step-30 snapshot is gone for good


def test_purge_removes_every_rank_of_a_namespace_and_nothing_else(root: str, tmp_path: Path) -> None:
    other = Checkpointer(str(tmp_path / "other"), saver="thread")
    other.save(1, state_at(1), persist=False)
    for rank in range(2):
        ckpt = Checkpointer(root, rank=rank, world_size=2, saver="thread")
        ckpt.save(1, state_at(1), persist=False)
        ckpt.close()  # keeps the snapshots (a restart could use them): purging is what removes them
    ns = namespace_for(root)
    removed = purge_shared_memory(ns)
    assert sorted(removed) == sorted(f"srckpt-{ns}-r{r}-b{b}" for r in range(2) for b in range(2))
    assert shm_names(ns) == [] and len(shm_names(other.namespace)) == 2
    other.close(unlink=True)


def test_a_commit_superseded_by_a_restore_is_not_a_failure(root: str, shard_service: FakeShardService) -> None:
    """A restore between a cut's prepare and its commit makes the master forget the cut (NOT_FOUND): the
    checkpoint is durable, a later checkpoint commits a later cut, nothing failed. Seen in CI: a TF-PS chief
    rolled back to its memory snapshot while step 325's commit was in flight; at the end of the run
    wait() raised 'commit_cut: cannot commit: cut 15 (step 325) was discarded by a restore' and the chief,
    done with every record, exited 1 and was restarted."""

    class CutForgotten(Exception):
        code = "NOT_FOUND"  # as the shard service's NotFoundError

    forget = {1}

    def commit_cut(cut_id: int) -> None:
        if cut_id in forget:
            raise CutForgotten(f"cannot commit: cut {cut_id} (step 1) was discarded by a restore (cut 2)")
        shard_service.committed.append(cut_id)

    shard_service.commit_cut = commit_cut  # type: ignore[method-assign]
    with Checkpointer(root, saver="thread", binder=shard_service) as ckpt:
        shard_service.ack("p0", 0, 100)
        ckpt.save(1, state_at(1))
        ckpt.wait(timeout=60)  # raised SaverError
        shard_service.ack("p0", 100, 200)
        ckpt.save(2, state_at(2))
        ckpt.wait(timeout=60)
        assert shard_service.committed == [2]


class Refused(Exception):
    def __init__(self, code: str) -> None:
        super().__init__(f"refused [{code}]")
        self.code = code


class RunBinder(FakeShardService):
    """A fake shard service of one run (``run_id``): a memory snapshot of another run is refused with ``error``
    (by default :class:`SnapshotRefusedError`, as the binder contract says)."""

    def __init__(self, run_id: str, error: Exception | None = None) -> None:
        super().__init__()
        self.run_id, self.error = run_id, error or SnapshotRefusedError("not of this run")

    def restore_cursor(self, cursor: DataCursor, *, from_memory: bool = False, **snapshot: object) -> None:
        if from_memory and snapshot.get("snapshot_run") != self.run_id:
            raise self.error
        super().restore_cursor(cursor, from_memory=from_memory)


def test_a_snapshot_the_shard_service_refuses_is_discarded_and_storage_loaded(root: str) -> None:
    first = RunBinder("run-1")
    first.ack("p0", 0, 10)
    ckpt = Checkpointer(root, binder=first, saver="thread")
    save_persisted(ckpt, [2])
    first.ack("p0", 10, 20)
    ckpt.save(4, state_at(4), persist=False)

    same = RunBinder("run-1")  # the run's master restarted on its journal: takes its snapshot
    loaded = Checkpointer(root, binder=same, saver="thread").load()
    assert (loaded.source, loaded.step, same.restored) == (LoadedFrom.MEMORY, 4, [first.cuts[2]])
    for code in ("UNAVAILABLE", "FAILED_PRECONDITION"):  # not a SnapshotRefusedError: raised, nothing discarded
        with pytest.raises(Refused):
            Checkpointer(root, binder=RunBinder("run-2", Refused(code)), saver="thread").load()
    kept = ckpt.engine.newest()
    assert kept is not None and kept.step == 4, "a load that raised must not discard the snapshot"

    other = RunBinder("run-2")  # a new run: storage's checkpoint, and the old run's snapshots are gone
    loaded = Checkpointer(root, binder=other, saver="thread").load()
    assert (loaded.source, loaded.step, other.restored) == (LoadedFrom.STORAGE, 2, [first.cuts[1]])
    assert ckpt.engine.newest() is None, "the refused run's snapshots must be invalidated"
    ckpt.close(unlink=True)
