"""One state size, in a fresh process: the save peers (memcpy, torch.save, DCP) and ours, then the restores."""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.bench_ckpt.measure import (
    REPO,
    drop_cache,
    empty_model,
    install_signal_handlers,
    into_model,
    into_model_ours,
    make_state,
    summary,
    timed,
)


def memcpy_peers(state: dict[str, Any]) -> dict[str, Callable[[], None]]:
    """The same bytes copied into pre-touched private memory: ``Tensor.copy_`` and libc ``memmove``."""
    import torch

    dst = {k: torch.empty_like(v) for k, v in state.items()}

    def copy() -> None:
        for k, v in state.items():
            dst[k].copy_(v)

    def memmove() -> None:
        for k, v in state.items():
            ctypes.memmove(dst[k].data_ptr(), v.data_ptr(), v.nbytes)

    copy()  # touch the destination once, as a reused buffer is
    return {"copy_": copy, "memmove": memmove}


def bench_torch_save(state: dict[str, Any], work: Path, a: argparse.Namespace) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    path = work / "torch-save.pt"
    for fsync in (False, True):

        def save(fsync: bool = fsync) -> None:
            with open(path, "wb") as fh:
                torch.save(state, fh)
                if fsync:
                    fh.flush()
                    os.fsync(fh.fileno())

        def reset() -> None:  # untimed: the previous file written back, dropped from the cache, removed
            if path.exists():
                drop_cache(path)
                path.unlink()
            os.sync()

        out["fsync" if fsync else "plain"] = summary(timed(save, a.warmups, a.repeats, before=reset))
        reset()
    final = work / "torch.pt"  # the file the restore children torch.load
    with open(final, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    drop_cache(final)
    return out


def bench_dcp(state: dict[str, Any], work: Path, a: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dist.init_process_group("gloo", init_method=f"file://{work}/pg-store", rank=0, world_size=1)
    target = work / "dcp"
    times = []
    first: float | None = None
    try:
        for i in range(a.warmups + a.repeats):
            if target.exists():
                shutil.rmtree(target)
            os.sync()
            t = time.perf_counter()
            fut = dcp.async_save(state, checkpoint_id=str(target))
            elapsed = time.perf_counter() - t
            (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
            drop_cache(target)
            if i == 0:
                first = elapsed
            if i >= a.warmups:
                times.append(elapsed)
    finally:
        shutil.rmtree(target, ignore_errors=True)
        dist.destroy_process_group()
    return {"save": summary(times), "first": first}


def pwrite_floor(state: dict[str, Any]) -> tuple[float, Callable[[], None]]:
    """The kernel's part of any first snapshot in shared memory, without our code: the same bytes ``pwrite``n into
    two fresh ``/dev/shm`` files, one thread each (the fastest way into fresh tmpfs pages measured here: session 23).

    Returns the seconds and a cleanup that removes the files. The files are kept until then, so the pages they took
    are not freed right before our first save (a page freed a moment ago is still backed by the host, and would
    make our first save look faster than it is)."""
    import threading

    views = [memoryview(v.numpy()).cast("B") for v in state.values()]
    halves: list[list[memoryview]] = [[], []]
    sizes = [0, 0]
    for view in views:
        i = sizes.index(min(sizes))
        halves[i].append(view)
        sizes[i] += view.nbytes
    paths = [f"/dev/shm/srbench-floor-{os.getpid()}-{i}" for i in range(2)]
    fds = [os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600) for path in paths]

    def write(i: int) -> None:
        pos = 0
        for view in halves[i]:
            done = 0
            while done < view.nbytes:  # os.pwrite releases the GIL; 4 MiB a call, as our copier's chunks
                done += os.pwrite(fds[i], view[done : done + (4 << 20)], pos + done)
            pos += view.nbytes

    threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
    t = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - t

    def cleanup() -> None:
        for fd, path in zip(fds, paths):
            os.close(fd)
            os.unlink(path)

    return elapsed, cleanup


def bench_ours(state: dict[str, Any], root: str, a: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    from streamrover.ckpt import Checkpointer, RetentionPolicy

    # saver="agent": the saver process the parent started, as dlrover-run's agent hosts it; keep_last=1 bounds
    # the disk the bench uses (retention deletes the previous checkpoint after publishing the next).
    ckpt = Checkpointer(root, saver="agent", retention=RetentionPolicy(keep_last=1), persist_on_exit=False)
    out: dict[str, Any] = {}
    step = 0

    def save(persist: bool) -> Callable[[], None]:
        def run() -> None:
            nonlocal step
            step += 1
            ckpt.save(step, state, persist=persist)

        return run

    # The kernel floor of a first save, measured just before ours (its pages kept until ours is done), then ours.
    floor, remove_floor = pwrite_floor(state)
    try:
        t = time.perf_counter()
        save(False)()  # allocates and pre-faults the first buffer; the second is pre-faulted in the background
        out["first"] = time.perf_counter() - t
    finally:
        remove_floor()
    out["first_floor"] = floor
    # Memory-only saves (what DLRover's memory saves and memcpy do) interleaved with the memcpy peers, one of
    # each per round, so drift in what else runs on the machine hits both sides alike. The first warm-up
    # round's save is the second buffer's first use.
    peers = memcpy_peers(state)
    runs: dict[str, list[float]] = {"save": [], **{name: [] for name in peers}}
    for i in range(a.warmups + 1 + a.repeats):
        for name, fn in [("save", save(False)), *peers.items()]:
            t = time.perf_counter()
            fn()
            if i > a.warmups:
                runs[name].append(time.perf_counter() - t)
    del peers
    out["save"] = summary(runs["save"])
    out["memcpy"] = {name: summary(runs[name]) for name in ("copy_", "memmove")}
    out["memcpy"]["best"] = min(out["memcpy"][n]["median"] for n in ("copy_", "memmove"))
    os.sync()
    # each save while the saver persists an earlier one (2 cores shared with it); the warm-up starts a persist
    out["during_persist"] = summary(timed(save(True), 1, a.repeats))
    ckpt.wait()

    def persisted() -> None:
        save(True)()
        ckpt.wait()

    def settle() -> None:
        drop_cache(root)
        os.sync()

    out["persist"] = summary(timed(persisted, 0, a.repeats, before=settle))
    save(False)()  # the newest snapshot is in memory only: a restart must load it from there
    return out, ckpt  # the caller closes it after the restore child (mapped meanwhile, like a live node's)


def run_child(role: str, *args: str) -> dict[str, Any]:
    """A restore measured in a fresh process (a restarted trainer); its JSON result."""
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_ckpt", "--role", role, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        raise RuntimeError(f"{role} child failed (exit {res.returncode}): {res.stderr.strip()[-2000:]}")
    result: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    return result


def size_main(a: argparse.Namespace) -> int:
    """One state size: every save peer and ours, then the restores; prints one JSON line."""
    import torch

    from streamrover.ckpt import namespace_for, purge_shared_memory

    install_signal_handlers()
    work = Path(a.work)
    root = str(work / "ours")
    out: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    try:
        state = make_state(a.bytes, a.tensors)
        out["torch_save"] = bench_torch_save(state, work, a)
        if not a.skip_dcp:
            out["dcp"] = bench_dcp(state, work, a)
        os.sync()
        out["ours"], ckpt = bench_ours(state, root, a)
        out["memcpy"] = out["ours"].pop("memcpy")
        del state  # freed before the restore children build their models
        common = [str(a.bytes), str(a.tensors), str(a.warmups), str(a.repeats)]
        out["restore_ours"] = run_child("restore-ours", root, *common)
        ckpt.close(unlink=True)
        purge_shared_memory(namespace_for(root))  # our buffers go before torch.load's child allocates
        out["restore_torch"] = run_child("restore-torch", str(work / "torch.pt"), *common)
    finally:
        purge_shared_memory(namespace_for(root))
    print(json.dumps(out), flush=True)
    return 0


def restore_ours_main(a: argparse.Namespace) -> int:
    from streamrover.ckpt import Checkpointer, LoadedFrom

    root = a.target

    def load(zero_copy: bool) -> Any:
        loaded = Checkpointer(root, saver="thread").load(zero_copy=zero_copy, restore=False)
        assert loaded.source == LoadedFrom.MEMORY, loaded.source
        return loaded

    out = {
        "zero_copy": summary(timed(lambda: load(True), a.warmups, a.repeats)),
        "copied": summary(timed(lambda: load(False), a.warmups, a.repeats)),
    }
    model = empty_model(a.bytes, a.tensors)
    out["into_model"] = summary(timed(lambda: into_model_ours(load(True).state, model), a.warmups, a.repeats))
    out["into_model_torch_copy"] = summary(timed(lambda: into_model(load(True).state, model), a.warmups, a.repeats))

    print(json.dumps(out), flush=True)
    return 0


def restore_torch_main(a: argparse.Namespace) -> int:
    import torch

    path = a.target
    model = empty_model(a.bytes, a.tensors)

    def load() -> Any:
        return torch.load(path, weights_only=True)

    out = {
        "load": summary(timed(load, a.warmups, a.repeats)),
        "into_model": summary(timed(lambda: into_model(load(), model), a.warmups, a.repeats)),
        "cold_into_model": summary(
            timed(lambda: into_model(load(), model), 0, a.repeats, before=lambda: drop_cache(path))
        ),
    }
    print(json.dumps(out), flush=True)
    return 0
