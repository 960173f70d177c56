"""The fast paths of issue 35: the first save into a sparse buffer (two files from a size on), persists paused
during a save."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from streamrover.ckpt import Checkpointer, copier, memory, shm
from streamrover.ckpt.memory import purge_shared_memory
from streamrover.ckpt.shm import SharedBuffer, shm_path, tail_name


def make_state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "model": {"w": torch.randn(300, 70), "b": torch.randn(70), "half": torch.randn(33).half()},
        "optim": {"state": {0: {"exp_avg": torch.randn(300, 70)}}, "lr": 0.1},
        "np": np.arange(10.0),
        "step": 5,
    }


def test_first_save_leaves_the_buffer_allocated_and_loads_back(tmp_path: Path) -> None:
    state = make_state()
    with Checkpointer(str(tmp_path / "ck"), saver="thread") as ckpt:
        ckpt.save(1, state, persist=False)
        snap = ckpt.engine.newest()
        assert snap is not None
        st = os.stat(shm_path(snap.name))
        # written into a sparse file, then allocated whole: no page is left to allocate (SIGBUS on a full
        # /dev/shm) when the header or a later save writes through the mapping
        assert st.st_blocks * 512 >= st.st_size
        loaded = ckpt.load(zero_copy=False, restore=False)
        assert torch.equal(loaded.state["model"]["w"], state["model"]["w"])
        assert torch.equal(loaded.state["model"]["half"], state["model"]["half"])
        np.testing.assert_array_equal(loaded.state["np"], state["np"])
        ckpt.save(2, state, persist=False)  # the second buffer, allocated in the background meanwhile
        ckpt.save(3, state, persist=False)  # the first buffer again, through its (populated) mapping
        assert ckpt.load(zero_copy=False, restore=False).step == 3
        ckpt.close(unlink=True)


def test_a_first_save_allocates_every_page_its_copy_did_not_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a first save's pwrite, only the pages it did not write are allocated (the header page, the header JSON,
    the tensors deferred to the background copy); they are all allocated before the save returns."""
    monkeypatch.setattr(shm, "SPLIT_FROM", 4 << 20)
    state: dict[str, Any] = {"a": torch.randn(1 << 20), "later": torch.randn(1 << 19), "b": torch.randn(3 << 18)}
    ranges: list[list[tuple[int, int]]] = []
    allocate = shm.SharedBuffer.allocate
    monkeypatch.setattr(
        shm.SharedBuffer,
        "allocate",
        lambda self, written=(): (ranges.append(list(written)), allocate(self, written))[1],
    )
    with Checkpointer(str(tmp_path / "ck"), saver="thread") as ckpt:
        ckpt.save(1, state, persist=False, defer=lambda t: t is state["later"])
        buf = ckpt.engine.buffers[0]
        assert buf is not None and buf.split
        head, tail = os.stat(shm_path(buf.name)), os.stat(shm_path(tail_name(buf.name)))
        assert (head.st_blocks * 512, tail.st_blocks * 512) == (buf.split, buf.size - buf.split)
        ckpt.wait_snapshot()
        loaded = ckpt.load(zero_copy=True, restore=False)
        assert all(torch.equal(loaded.state[k], v) for k, v in state.items())
        del loaded
        ckpt.close(unlink=True)
    assert [sorted(n for _, n in r) for r in ranges] == [sorted([state["a"].nbytes, state["b"].nbytes])]


def test_a_large_first_save_is_two_files_written_in_parallel_and_read_as_one_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From ``SPLIT_FROM`` bytes a first save's buffer is two files (one inode lock each, so two threads pwrite in
    parallel); every reader maps the tail file's pages right after the first file's, and no byte is allocated in
    both. 1 GiB is the size this is for; 4 MiB here exercises the same paths, a tensor across the split included."""
    monkeypatch.setattr(shm, "SPLIT_FROM", 4 << 20)
    torch.manual_seed(1)
    state: dict[str, Any] = {"a": torch.randn(1 << 20), "b": torch.randn(1 << 19).double(), "np": np.arange(5e3)}
    root = str(tmp_path / "ck")
    with Checkpointer(root, saver="thread") as ckpt:
        ckpt.save(1, state)
        buf = ckpt.engine.buffers[0]
        assert buf is not None and buf.split, "not split"
        head, tail = os.stat(shm_path(buf.name)), os.stat(shm_path(tail_name(buf.name)))
        assert head.st_size == buf.size and tail.st_size == buf.size - buf.split
        # every page allocated once: the first file up to the split (a hole after it), the tail whole
        assert (head.st_blocks * 512, tail.st_blocks * 512) == (buf.split, buf.size - buf.split)
        snap = ckpt.engine.newest()
        assert snap is not None
        spans = [(int(r["offset"]), int(r["offset"]) + int(r["nbytes"])) for r in snap.header["tensors"]]
        assert any(start < buf.split < end for start, end in spans), "no tensor crosses the split"
        for step in (2, 3):  # the second buffer (one file, allocated in the background), then this one again
            state["a"].add_(1.0)
            ckpt.save(step, state)
        ckpt.wait()
        again = Checkpointer(root, saver="thread")  # maps the buffers afresh, the tail included
        loaded = again.load(zero_copy=True, restore=False)
        assert loaded.step == 3
        assert torch.equal(loaded.state["a"], state["a"]) and torch.equal(loaded.state["b"], state["b"])
        np.testing.assert_array_equal(loaded.state["np"], state["np"])
        del loaded
        ns = ckpt.namespace
        removed = purge_shared_memory(ns)  # the names go now; both processes' mappings stay valid until closed
        assert sorted(removed) == sorted([f"srckpt-{ns}-r0-b0", f"srckpt-{ns}-r0-b0-tail", f"srckpt-{ns}-r0-b1"])
        again.close()
    stored = Checkpointer(root, saver="thread").load(zero_copy=False, restore=False)  # from storage now
    assert stored.step == 3 and torch.equal(stored.state["a"], state["a"])


def test_a_failed_first_save_returns_only_once_neither_file_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first file's writes fail at once while the tail's thread still has 5 chunks to write: the save fails,
    and only after the tail's writer stopped (the files it writes are closed on return: a late write would hit a
    closed, or reused, descriptor)."""
    monkeypatch.setattr(shm, "SPLIT_FROM", 4 << 20)
    real = memory.file_writer
    returned = threading.Event()
    late: list[int] = []

    def writer(fd: int) -> Any:
        write = real(fd)
        tail = os.readlink(f"/proc/self/fd/{fd}").endswith(shm.TAIL)

        def copy(dst: int, src: int, n: int) -> None:
            if not tail:
                raise OSError(5, "injected: the first file's write fails")
            try:
                write(dst, src, n)
            finally:
                if returned.is_set():
                    late.append(n)

        return copy

    monkeypatch.setattr(memory, "file_writer", writer)
    state = {"w": torch.randn(10 << 20)}  # 40 MiB: a tail of ~20 MiB, 5 chunks
    with Checkpointer(str(tmp_path / "ck"), saver="thread") as ckpt:
        with pytest.raises(memory.SnapshotCopyError, match="injected"):
            ckpt.save(1, state, persist=False)
        returned.set()
        assert ckpt.engine.newest() is None
        ckpt.close(unlink=True)
    assert late == [], f"{len(late)} tail chunk(s) written after the failed save returned"


def test_a_save_pauses_the_persist_of_the_other_buffer_until_its_copy_is_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memory, "MIN_PAUSE", 120.0)  # only the end of the copy may end this pause
    state = {"w": torch.randn(1 << 20)}  # 4 MiB: one chunk
    copying, release = threading.Event(), threading.Event()
    real = copier._memmove

    def gated(dst: int, src: int, n: int) -> Any:
        copying.set()
        assert release.wait(60)
        return real(dst, src, n)

    with Checkpointer(str(tmp_path / "ck"), saver="thread") as ckpt:
        ckpt.save(1, state, persist=False)  # buffer 0 (a fresh buffer's copy: not gated)
        ckpt.save(2, state, persist=False)  # buffer 1
        first = ckpt.engine.newest()
        assert first is not None and first.step == 2
        reader = SharedBuffer.open(first.name)  # what the saver maps to persist step 2
        assert reader is not None
        assert reader.wait_while_paused() == 0.0  # nobody writes: a persist goes on at once
        monkeypatch.setattr(copier, "_memmove", gated)
        saving = threading.Thread(target=ckpt.save, args=(3, state), kwargs={"persist": False})
        saving.start()  # writes buffer 0 through its mapping, blocked in the copy
        assert copying.wait(60)
        waited: list[float] = []
        persist = threading.Thread(target=lambda: waited.append(reader.wait_while_paused()))
        persist.start()
        persist.join(0.3)
        assert persist.is_alive()  # paused while the save copies
        release.set()
        saving.join(60)
        persist.join(60)
        assert not persist.is_alive() and waited and waited[0] > 0
        assert reader.wait_while_paused() == 0.0  # the copy cleared the pause
        reader.close()
        assert ckpt.load(zero_copy=False, restore=False).step == 3
        ckpt.close(unlink=True)


def test_a_pause_left_by_a_dead_writer_expires(tmp_path: Path) -> None:
    buf = SharedBuffer.create(f"srckpt-test-pause-{os.getpid()}", 1 << 16)
    try:
        buf.set_pause(0.05)  # the writer dies without clearing it
        assert buf.wait_while_paused() >= 0.04
    finally:
        buf.close()
        buf.unlink()


def test_a_persist_after_the_trainer_died_ignores_its_pause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from streamrover.ckpt import RetentionPolicy
    from streamrover.ckpt.persist import PersistTarget, persist_buffer
    from streamrover.ckpt.storage import Storage

    with Checkpointer(str(tmp_path / "ck"), saver="thread") as ckpt:
        ckpt.save(1, make_state(), persist=False)
        snap = ckpt.engine.newest()
        assert snap is not None
        reader = SharedBuffer.open(snap.name)
        assert reader is not None
        target = PersistTarget(Storage(str(tmp_path / "ck")), 0, 1, RetentionPolicy())

        def waits() -> float:
            raise AssertionError("a persist on death waited for a pause")

        monkeypatch.setattr(reader, "wait_while_paused", waits)
        result = persist_buffer(target, reader, snap.generation, yield_to_saves=False)
        assert result.ok and result.manifest_published
        with pytest.raises(AssertionError, match="waited"):  # the live path does consult it
            persist_buffer(target, reader, snap.generation)
        reader.close()
        ckpt.close(unlink=True)


def test_a_hashing_error_fails_the_write_and_leaves_no_file(tmp_path: Path) -> None:
    """The checksum is computed on a thread beside the write; an error there (here: its pause) used to kill the
    thread quietly and the write published the file with the checksum of what was hashed before it."""
    from streamrover.ckpt.storage import Storage

    def pause() -> None:
        if threading.current_thread().name == "ckpt-hash":
            raise OSError("the hashing thread failed")

    storage = Storage(str(tmp_path))
    path = str(tmp_path / "part.safetensors")
    data = np.ones(40 << 20, dtype=np.uint8)  # two 32 MiB chunks
    with pytest.raises(OSError, match="hashing thread"):
        storage.write(path, [memoryview(data)], pause=pause)
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "neither the file nor its temporary is left"


def test_non_temporal_copy_is_built_and_exact_at_any_alignment_and_length() -> None:
    """The package install builds ``_ntcopy`` (a C compiler is part of the set-up); its copy is byte-exact."""
    import shutil

    if shutil.which("cc") or shutil.which("gcc"):
        assert copier.NT_AVAILABLE, "streamrover/ckpt/_ntcopy.c was not built: run `make install`"
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, size=(copier.NT_FROM * 3), dtype=np.uint8)
    for src_off, dst_off, n in [(0, 0, copier.NT_FROM), (3, 5, copier.NT_FROM + 77), (16, 1, 2 * copier.NT_FROM + 63),
                                (1, 15, 100), (7, 0, copier.NT_FROM * 2 + 1)]:  # fmt: skip
        dst = np.zeros(n + 64, dtype=np.uint8)
        copier.copy_nt(int(dst.ctypes.data) + dst_off, int(src.ctypes.data) + src_off, n)
        assert np.array_equal(dst[dst_off : dst_off + n], src[src_off : src_off + n])
        assert not dst[:dst_off].any() and not dst[dst_off + n :].any()  # nothing written outside the range


def test_the_non_temporal_copy_is_found_by_the_import_system_and_off_when_switched_off_or_not_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``_load_ext`` loads the file the import system finds for ``streamrover.ckpt._ntcopy``; none: memmove."""
    import streamrover.ckpt

    assert (copier._load_ext() is not None) == copier.NT_AVAILABLE
    monkeypatch.setattr(streamrover.ckpt, "__path__", [str(tmp_path)])  # a package directory without the extension
    assert copier._load_ext() is None
    monkeypatch.undo()
    monkeypatch.setenv("STREAMROVER_NT_COPY", "0")
    assert copier._load_ext() is None


def test_a_save_while_a_grown_buffer_is_allocated_in_the_background_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save that outgrows the buffers reallocates the other one in the background (closed, then created anew);
    the next save's choice of a buffer read the closed one ("mmap closed or invalid"), seen in CI after a saver
    SIGKILL. The background allocation is held inside ``create`` here until the next save has begun."""
    entered, release = threading.Event(), threading.Event()
    create = SharedBuffer.create.__func__  # type: ignore[attr-defined]

    def held_create(cls: type[SharedBuffer], name: str, size: int, *args: Any, **kwargs: Any) -> SharedBuffer:
        if threading.current_thread().name == "ckpt-prefault" and size > 4 << 20:
            entered.set()
            release.wait(30)  # bounded: the fixed code waits here for the release below
        return create(cls, name, size, *args, **kwargs)  # type: ignore[no-any-return]

    with Checkpointer(str(tmp_path / "ck"), saver="thread", persist_on_exit=False) as ckpt:
        ckpt.save(1, {"w": torch.ones(16)}, persist=False)
        ckpt.save(2, {"w": torch.ones(16)}, persist=False)  # both buffers allocated, small
        monkeypatch.setattr(SharedBuffer, "create", classmethod(held_create))
        big = {"w": torch.full((3 << 20,), 3.0)}  # 12 MiB: outgrows both
        ckpt.save(3, big, persist=False)
        assert entered.wait(30), "the grown buffer was not allocated in the background"
        threading.Timer(0.2, release.set).start()  # lets the allocation finish while the next save waits for it
        ckpt.save(4, {"w": torch.full((3 << 20,), 4.0)}, persist=False)
        loaded = ckpt.load(restore=False)
        assert loaded.step == 4 and float(loaded.state["w"][0]) == 4.0
