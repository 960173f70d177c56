"""Flash checkpoint benchmark: blocking save time and restore time against peers measured in the same run.

Peers, on the same state (float32 tensors of random values):

* memcpy: the same bytes copied into pre-touched memory, the physical limit; the faster of
  ``Tensor.copy_`` (torch's intra-op threads) and libc ``memmove`` (one thread);
* ``torch.save`` to local disk, with ``fsync`` (durable, like our persist) and without (page cache);
* ``torch.distributed.checkpoint.async_save`` (blocking part);
* DLRover's flash checkpoint (``DdpCheckpointer``, run from its own venv by ``bench_ckpt/dlrover_peer.py``);
* restore after a process restart: ours from shared memory in a fresh process against
  ``torch.load(weights_only=True)`` of the ``torch.save`` file, both copied into an already built model.

Method: every timed operation runs ``--warmups`` untimed times first, then ``--repeats`` timed times; the
median is reported (with min-max). Our memory saves and the memcpy peers run interleaved, one of each per
round, so drift in the machine's other load hits both alike. Each state size runs in a fresh process (no
allocator or page-cache state carries over between sizes), restores run in fresh processes of their own,
and our saver is a process of its own, as an elastic agent would host it. Page cache: every file a phase
writes is fsync'd and dropped from the page cache (``posix_fadvise(DONTNEED)``) once timed, and dirty data
is flushed (``sync``) between phases, so no phase pays for another's writeback. ``torch.load`` is timed from disk (its
file dropped from the page cache before each call: the goal's "torch.load from disk") and from the page
cache (its best case, shown beside it). Both restores end with the weights copied into a built model.
Free memory, ``/dev/shm`` and disk are checked before each size; a size that cannot fit fails with a
message. Temp dirs, shared memory and child processes are removed on exit, on errors and on SIGTERM/SIGINT.

    python -m benchmarks ckpt --sizes 256M,1G,4G
    python -m benchmarks ckpt --quick                      # 16M, 2 repeats

Goals (issue 4): save <= 1.5x memcpy; >= 20x faster than torch.save+fsync; restore >= 5x faster than torch.load.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._common import load as load_average
from benchmarks._common import table

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
GIB = 1 << 30
REPO = Path(__file__).resolve().parents[2]
DLROVER_PY = os.environ.get("STREAMROVER_DLROVER_PYTHON", "/work/venvs/dlrover/bin/python")
# Peak resident memory of one size, in state sizes: the state, our two shared-memory buffers and the memcpy
# peer's destination while saving (page cache is reclaimable); the restore children need less.
PEAK_FACTOR = 4.0
MEMORY_MARGIN = GIB  # interpreters, torch, the saver, the DLRover peer's own process
DISK_FACTOR = 4.0  # torch.save file + a DCP checkpoint + our newest and next persisted checkpoint
CHILD_GRACE = 15.0


class Interrupted(BaseException):
    """SIGTERM or SIGINT arrived; unwinds through every ``finally`` so cleanup runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def _raise_interrupted(signum: int, _frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # cleanup must not be interrupted in turn
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise Interrupted(signum)


def install_signal_handlers() -> None:
    signal.signal(signal.SIGTERM, _raise_interrupted)
    signal.signal(signal.SIGINT, _raise_interrupted)


def _die_with_parent() -> None:
    """In a child, before exec: SIGTERM when the parent dies (even by SIGKILL), so nothing is orphaned."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


# -- measuring ---------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(text[:-1]) * UNITS[text[-1]]) if text[-1] in UNITS else int(text)


def meminfo(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def summary(times: list[float]) -> dict[str, float]:
    return {"median": statistics.median(times), "min": min(times), "max": max(times), "n": len(times)}


def timed(fn: Callable[[], Any], warmups: int, repeats: int, before: Callable[[], Any] | None = None) -> list[float]:
    """``fn`` run ``warmups`` times untimed, then ``repeats`` times timed; ``before`` runs untimed each time."""
    times = []
    for i in range(warmups + repeats):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - t
        if i >= warmups:
            times.append(elapsed)
    return times


def drop_cache(path: Path | str) -> None:
    """Write back and drop the page cache of a file, or of every file under a directory."""
    paths = [Path(path)] if Path(path).is_file() else [p for p in Path(path).rglob("*") if p.is_file()]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def make_state(nbytes: int, tensors: int) -> dict[str, Any]:
    import torch

    n = nbytes // 4 // tensors
    return {f"layer{i}.weight": torch.randn(n) for i in range(tensors)}


def empty_model(nbytes: int, tensors: int) -> dict[str, Any]:
    """The restarted trainer's model, already built (pages touched), that a restore copies into."""
    import torch

    n = nbytes // 4 // tensors
    return {f"layer{i}.weight": torch.zeros(n) for i in range(tensors)}


def into_model(state: dict[str, Any], model: dict[str, Any]) -> None:
    """What ``load_state_dict`` does: copy into the live parameters."""
    import torch

    with torch.no_grad():
        for k, v in state.items():
            model[k].copy_(v)


# -- one size, in a fresh process ------------------------------------------------------------------
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

    t = time.perf_counter()
    save(False)()  # allocates and pre-faults the first buffer; the second is pre-faulted in the background
    out["first"] = time.perf_counter() - t
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


# -- a training loop that checkpoints: the time the trainer really loses per checkpoint ------------------------
TRAIN_WIDTH = 2048
TRAIN_BATCH = 64


def train_model(nbytes: int) -> Any:
    """An MLP whose parameters plus Adam's two moments are about ``nbytes`` (a BatchNorm adds buffers)."""
    import torch

    layers = max(2, round(nbytes / 3 / (TRAIN_WIDTH * TRAIN_WIDTH * 4)))
    mods: list[Any] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(TRAIN_WIDTH, TRAIN_WIDTH), torch.nn.ReLU()]
    mods[-1] = torch.nn.BatchNorm1d(TRAIN_WIDTH)
    return torch.nn.Sequential(*mods)


def train_variants(model: Any, optim: Any, work: Path, root: str) -> dict[str, tuple[Callable[[int], None], Any]]:
    """name -> (checkpoint(step), after(): untimed, waits for what the variant left running). As users run each."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from streamrover.ckpt import Checkpointer, RetentionPolicy, TorchCheckpoint

    # saver="agent": the node's saver the parent started, as dlrover-run's agent hosts it. Both adapters share
    # it; the overlapped one's step hook stays installed for every variant (a no-op call when nothing is pending).
    cp = Checkpointer(root, saver="agent", retention=RetentionPolicy(keep_last=1), persist_on_exit=False)
    ckpts = {"overlap": TorchCheckpoint(cp, model, optim, overlap=True), "blocking": TorchCheckpoint(cp, model, optim)}
    path = work / "train-torch.pt"
    dcp_dir = work / "train-dcp"
    futures: list[Any] = []

    def ours(kind: str, persist: bool) -> Callable[[int], None]:
        return lambda step: ckpts[kind].save(step, persist=persist)

    def torch_save(fsync: bool) -> Callable[[int], None]:
        def run(step: int) -> None:
            with open(path, "wb") as fh:
                torch.save({"model": model.state_dict(), "optimizer": optim.state_dict(), "step": step}, fh)
                if fsync:
                    fh.flush()
                    os.fsync(fh.fileno())

        return run

    def dcp_async(step: int) -> None:
        if futures:  # DCP's documented pattern: the previous async save must be done before the next
            futures.pop().result()
        model_sd, optim_sd = get_state_dict(model, optim)
        futures.append(dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(dcp_dir)))

    def after_ours(kind: str) -> Callable[[], None]:
        def run() -> None:
            ckpts[kind].checkpointer.wait()

        return run

    def after_file() -> None:
        if path.exists():
            drop_cache(path)

    def after_dcp() -> None:
        while futures:
            fut = futures.pop()
            (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
        if dcp_dir.exists():
            drop_cache(dcp_dir)

    return {
        "ours_overlap": (ours("overlap", False), after_ours("overlap")),
        "ours_overlap_persist": (ours("overlap", True), after_ours("overlap")),
        "ours_blocking": (ours("blocking", False), after_ours("blocking")),
        "torch_save_fsync": (torch_save(True), after_file),
        "torch_save": (torch_save(False), after_file),
        "dcp_async": (dcp_async, after_dcp),
    }


def train_main(a: argparse.Namespace) -> int:
    """The training-loop rows, in a fresh process: extra seconds per checkpoint over a step without one."""
    import torch
    import torch.distributed as dist

    from streamrover.ckpt import namespace_for, purge_shared_memory

    install_signal_handlers()
    work = Path(a.work)
    root = str(work / "train")
    dist.init_process_group("gloo", init_method=f"file://{work}/train-pg", rank=0, world_size=1)
    out: dict[str, Any] = {}
    try:
        torch.manual_seed(0)
        model = train_model(a.bytes)
        optim = torch.optim.Adam(model.parameters(), lr=1e-4)
        x = torch.randn(TRAIN_BATCH, TRAIN_WIDTH)

        def step() -> None:
            optim.zero_grad()
            model(x).pow(2).mean().backward()
            optim.step()

        step()  # Adam's state exists from here on: the state has its full size
        state_bytes = sum(t.nbytes for t in model.state_dict().values())
        state_bytes += sum(t.nbytes for s in optim.state.values() for t in s.values() if torch.is_tensor(t))
        out["state_bytes"] = state_bytes
        variants = train_variants(model, optim, work, root)
        src = [t for t in model.state_dict().values()] + [
            t for s in optim.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0
        ]
        dst = [torch.empty_like(t) for t in src]

        def memcpy() -> None:  # the same bytes into pre-touched memory, libc memmove (the faster peer here)
            for d, s_ in zip(dst, src):
                ctypes.memmove(d.data_ptr(), s_.data_ptr(), s_.nbytes)

        memcpy()
        every = a.train_every
        windows = max(3, a.train_steps // every)
        # A run is `windows` windows of `every` steps with a checkpoint after each window but the last. A sample
        # is one steady window plus its checkpoint (windows 2..W-1): it includes the wait, in its first
        # optimizer step, for the previous overlapped save's copy, and the slowdown that copy caused. The
        # figure is median(sample) - median(the same windows without checkpoints): medians resist the spikes
        # other engineers' jobs cause on this shared 2-core machine.
        samples: dict[str, list[float]] = {"none": [], "memcpy": [], **{name: [] for name in variants}}
        for r in range(a.train_rounds + 1):  # round 0 warms everything up (first saves allocate, DCP plans)
            for name in ["none", "memcpy", *variants]:
                if name == "memcpy":
                    t = time.perf_counter()
                    memcpy()
                    if r:
                        samples[name].append(time.perf_counter() - t)
                    continue
                ckpt, after = variants.get(name, (None, None))
                for w in range(1, windows + 1):
                    t = time.perf_counter()
                    for _ in range(every):
                        step()
                    if ckpt is not None and w < windows:
                        ckpt(w + 1000 * r)
                    if r and 1 < w < windows:
                        samples[name].append(time.perf_counter() - t)
                if after is not None:
                    after()
                os.sync()
        base = statistics.median(samples["none"])
        out["step"] = summary([v / every for v in samples["none"]])
        out["memcpy"] = summary(samples["memcpy"])
        out["samples"] = len(samples["none"])
        for name in variants:
            out[name] = summary([v - base for v in samples[name]])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        purge_shared_memory(namespace_for(root))
    print(json.dumps(out), flush=True)
    return 0


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
    out["into_model"] = summary(timed(lambda: into_model(load(True).state, model), a.warmups, a.repeats))
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


# -- the parent: one fresh process per size, cleanup of everything it started ---------------------------
class Run:
    """What one size started: removed by :meth:`cleanup` on every exit path."""

    def __init__(self, base: str | None) -> None:
        self.work = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=base))
        self.procs: list[subprocess.Popen[str]] = []  # each leads its own process group
        self.stopped: set[int] = set()
        self.dlrover_job = f"srbench-{uuid.uuid4().hex[:12]}"
        self.namespaces: list[str] = []

    def start(self, cmd: list[str], **kwargs: Any) -> subprocess.Popen[str]:
        proc = subprocess.Popen(cmd, cwd=REPO, text=True, start_new_session=True, preexec_fn=_die_with_parent, **kwargs)
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[str], grace: float = CHILD_GRACE) -> None:
        """SIGTERM the process group, then SIGKILL what is left after ``grace`` seconds."""
        if proc.pid in self.stopped or proc.returncode is not None:  # stopped, or ended and reaped already
            return
        self.stopped.add(proc.pid)
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=wait)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # forked helpers that outlive the leader
                return
            except subprocess.TimeoutExpired:
                continue

    def cleanup(self) -> None:
        for proc in self.procs:
            self.stop(proc)
        if self.namespaces:
            from streamrover.ckpt import purge_shared_memory

            for namespace in self.namespaces:
                purge_shared_memory(namespace)
        for name in os.listdir("/dev/shm"):  # the DLRover peer's buffers, named after its job id
            if name.startswith(self.dlrover_job):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join("/dev/shm", name))
        shutil.rmtree(f"/tmp/ckpt_sock/{self.dlrover_job}", ignore_errors=True)
        shutil.rmtree(self.work, ignore_errors=True)


def fits(size: int, base: str | None) -> str | None:
    """Why ``size`` cannot run now (memory, /dev/shm, disk), or None."""
    from streamrover.ckpt.memory import HEADER_RESERVE

    problems = []
    need, have = PEAK_FACTOR * size + MEMORY_MARGIN, meminfo("MemAvailable")
    if have is not None and need > have:
        problems.append(f"~{need / GIB:.1f} GiB of memory at its peak, {have / GIB:.1f} GiB is available")
    need = 2 * (size + HEADER_RESERVE) + (64 << 20)
    if need > (shm := free_bytes("/dev/shm")):
        problems.append(f"{need / GIB:.1f} GiB in /dev/shm for two snapshot buffers, {shm / GIB:.1f} GiB is free")
    need = DISK_FACTOR * size
    if need > (disk := free_bytes(base or tempfile.gettempdir())):
        problems.append(f"{need / GIB:.1f} GiB of disk, {disk / GIB:.1f} GiB is free")
    return "; ".join(problems) or None


def run_size(size: int, a: argparse.Namespace) -> dict[str, Any]:
    from streamrover.ckpt import namespace_for, saver_address

    run = Run(a.dir)

    def start_saver(root: str) -> subprocess.Popen[str]:
        """The node's saver for ``root``, a process of its own as the agent hosts it."""
        run.namespaces.append(namespace_for(root))
        address = "@" + saver_address(namespace_for(root))[1:]
        saver = run.start(
            [sys.executable, "-m", "streamrover.ckpt", "--address", address, "--linger", "3600"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert saver.stdout is not None
        if saver.stdout.readline().strip() != "READY":
            raise RuntimeError("the checkpoint saver did not start")
        return saver

    try:
        saver = start_saver(str(run.work / "ours"))
        common = ["--bytes", str(size), "--tensors", str(a.tensors), "--warmups", str(a.warmups)]
        common += ["--repeats", str(a.repeats)]
        cmd = [sys.executable, "-m", "benchmarks.bench_ckpt", "--role", "size", "--work", str(run.work), *common]
        if a.skip_dcp:
            cmd.append("--skip-dcp")
        child = run.start(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        stdout, stderr = child.communicate()
        if child.returncode != 0:
            raise RuntimeError(f"size child failed (exit {child.returncode}): {stderr.strip()[-3000:]}")
        result: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
        run.stop(saver)
        os.sync()
        if not a.skip_train:
            saver = start_saver(str(run.work / "train"))
            train = ["--train-steps", str(a.train_steps), "--train-every", str(a.train_every)]
            train += ["--train-rounds", str(a.train_rounds)]
            child = run.start([*cmd[:4], "train", *cmd[5:], *train], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            stdout, stderr = child.communicate()
            if child.returncode != 0:  # the other rows of this size stand; the run still exits 1
                result["train"] = {"error": f"train child failed (exit {child.returncode}): {stderr.strip()[-3000:]}"}
            else:
                result["train"] = json.loads(stdout.strip().splitlines()[-1])
            run.stop(saver)
            os.sync()
        result["dlrover"] = {"error": "skipped"} if a.skip_dlrover else bench_dlrover(run, size, a)
        return result
    finally:
        run.cleanup()


def bench_dlrover(run: Run, size: int, a: argparse.Namespace) -> dict[str, Any]:
    if not os.path.exists(DLROVER_PY):
        return {"error": f"no DLRover venv at {DLROVER_PY} (set STREAMROVER_DLROVER_PYTHON)"}
    script = Path(__file__).with_name("dlrover_peer.py")
    cmd = [DLROVER_PY, str(script), "--bytes", str(size), "--tensors", str(a.tensors), "--dir", str(run.work)]
    cmd += ["--warmups", str(a.warmups), "--repeats", str(a.repeats)]
    errors = tempfile.TemporaryFile(mode="w+", dir=run.work)
    # its job id names its shared memory and socket directory, so cleanup finds exactly its own
    env = {**os.environ, "TORCHELASTIC_RUN_ID": run.dlrover_job}
    proc = run.start(cmd, stdout=subprocess.PIPE, stderr=errors, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # its forked saver keeps the pipe open: read the one line, then end the group
    run.stop(proc, grace=0)
    try:
        result: dict[str, Any] = json.loads(line)
    except ValueError:
        errors.seek(0)
        tail = errors.read().strip().splitlines()[-1:] or ["no output"]
        return {"error": f"DLRover peer failed: {tail[0]}"}
    return result


# -- report -------------------------------------------------------------------------------------------
def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


RATIOS: list[tuple[str, str, tuple[str, ...], tuple[str, ...]]] = [
    # (comparison, goal, numerator, denominator): medians; "memcpy best" is the faster of the two memcpy peers
    ("save blocking / memcpy (x, lower is better)", "<= 1.5", ("ours", "save"), ("memcpy", "best")),
    ("save during a persist / memcpy", "", ("ours", "during_persist"), ("memcpy", "best")),
    ("torch.save+fsync / our save", ">= 20", ("torch_save", "fsync"), ("ours", "save")),
    ("  ceiling: torch.save+fsync / memcpy", "", ("torch_save", "fsync"), ("memcpy", "best")),
    ("torch.save (page cache) / our save", "", ("torch_save", "plain"), ("ours", "save")),
    ("DCP async_save blocking / our save", "", ("dcp", "save"), ("ours", "save")),
    ("DLRover memory save / our save", "", ("dlrover", "memory_save"), ("ours", "save")),
    ("DLRover first save / our first save", "", ("dlrover", "first_memory_save"), ("ours", "first")),
    ("DLRover persist / our persist", "", ("dlrover", "persisted"), ("ours", "persist")),
    ("torch.load+copy (from disk) / our restore+copy", ">= 5", ("restore_torch", "cold_into_model"),
     ("restore_ours", "into_model")),
    ("torch.load+copy (page cache) / our restore+copy", "", ("restore_torch", "into_model"),
     ("restore_ours", "into_model")),
    ("torch.load (page cache) / our zero-copy load", "", ("restore_torch", "load"), ("restore_ours", "zero_copy")),
    ("torch.load (page cache) / our load, private copy", "", ("restore_torch", "load"), ("restore_ours", "copied")),
    # the training loop: extra seconds per checkpoint over the same round's steps without one
    ("train: ours overlapped / memcpy (x, lower is better)", "", ("train", "ours_overlap"), ("train", "memcpy")),
    ("train: ours blocking / memcpy (x, lower is better)", "", ("train", "ours_blocking"), ("train", "memcpy")),
    ("train: ours blocking / ours overlapped", "", ("train", "ours_blocking"), ("train", "ours_overlap")),
    ("train: torch.save+fsync / ours overlapped", ">= 20", ("train", "torch_save_fsync"), ("train", "ours_overlap")),
    ("train: torch.save+fsync / ours blocking", "", ("train", "torch_save_fsync"), ("train", "ours_blocking")),
    ("train: torch.save (page cache) / ours overlapped", "", ("train", "torch_save"), ("train", "ours_overlap")),
    ("train: DCP async_save / ours overlapped", "", ("train", "dcp_async"), ("train", "ours_overlap")),
    ("train: ours overlapped+persist / ours overlapped", "", ("train", "ours_overlap_persist"),
     ("train", "ours_overlap")),
]  # fmt: skip

# Each goal of issue 4, the row it is judged on, and why that row.
GOALS: list[tuple[str, str, float, bool, str]] = [
    ("save <= 1.5x memcpy", "save blocking / memcpy (x, lower is better)", 1.5, False,
     "written for a save that blocks for its whole copy (Checkpointer.save's default, TorchCheckpoint without "
     "overlap): the physical limit of such a save is the memcpy"),
    (">= 20x faster than torch.save", "train: torch.save+fsync / ours overlapped", 20.0, True,
     "the blocking time the trainer sees: extra seconds per checkpoint in a training loop, ours overlapped "
     "(TorchCheckpoint(overlap=True)) vs torch.save+fsync as a user runs it (durable like our persist). "
     "A save that is a full copy cannot reach 20x here: see the ceiling row"),
    ("restore >= 5x faster than torch.load", "torch.load+copy (from disk) / our restore+copy", 5.0, True,
     "both end with the weights in a built model; torch.load reads its file from disk after a restart"),
]  # fmt: skip


def median_at(result: dict[str, Any], path: tuple[str, ...]) -> float | None:
    node: Any = result
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node = node.get("median")
    return float(node) if isinstance(node, (int, float)) else None


def ratio_rows(results: dict[str, dict[str, Any]]) -> list[list[Any]]:
    """(comparison, goal, ratio per size): > 1 means ours is faster, except the memcpy rows (ours / memcpy)."""
    rows = []
    for name, goal, num, den in RATIOS:
        cells = []
        for r in results.values():
            d = median_at(r, den)
            value = ratio(median_at(r, num), d)
            if d is not None and d <= 0:
                cells.append("ours <= 0 (noise)")
            else:
                cells.append(f"{value:.2f}x" if value is not None else "-")
        rows.append([name, goal, *cells])
    return rows


def goal_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    rows = {name: (num, den) for name, _, num, den in RATIOS}
    lines = []
    for goal, row, bound, higher, why in GOALS:
        num, den = rows[row]
        cells = []
        for label, r in results.items():
            d = median_at(r, den)
            value = ratio(median_at(r, num), d)
            if d is not None and d <= 0:
                peer = median_at(r, num)
                cells.append(
                    f"{label}: ratio undefined: our median extra is {d * 1e3:.1f} ms (<= 0, below this run's "
                    f"noise), the peer's {peer * 1e3 if peer is not None else float('nan'):.1f} ms"
                )
            elif value is None:
                cells.append(f"{label}: not measured")
            else:
                met = value >= bound if higher else value <= bound
                cell = f"{label}: {value:.2f}x {'met' if met else 'NOT met'}"
                floor = median_at(r, ("train", "memcpy"))
                blocking = median_at(r, ("train", "ours_blocking"))
                if num[0] == "train" and floor and blocking is not None and blocking < floor:
                    # a blocking save costs at least its memcpy: below that, the loop's noise dominates ours
                    cell += (
                        f" (UNRELIABLE: ours blocking extra {blocking * 1e3:.0f} ms < the memcpy floor "
                        f"{floor * 1e3:.0f} ms, so step noise dominates our figure here)"
                    )
                cells.append(cell)
        lines.append(f"- {goal}: judged on row '{row}' ({why}).\n    " + "; ".join(cells))
    return lines


def time_rows(r: dict[str, Any]) -> list[list[Any]]:
    def cell(node: Any) -> str:
        if node is None:
            return "-"
        if isinstance(node, dict):
            return f"{node['median']:.4f}  [{node['min']:.4f}-{node['max']:.4f}]"
        return f"{node:.4f}"

    def get(*path: str) -> Any:
        node: Any = r
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        return node

    return [
        [name, cell(get(*path))]
        for name, path in [
            ("memcpy, Tensor.copy_", ("memcpy", "copy_")),
            ("memcpy, libc memmove (1 thread)", ("memcpy", "memmove")),
            ("our save (memory only)", ("ours", "save")),
            ("our save during a persist", ("ours", "during_persist")),
            ("our first save (allocates)", ("ours", "first")),
            ("our persist (save + wait, durable)", ("ours", "persist")),
            ("torch.save+fsync", ("torch_save", "fsync")),
            ("torch.save (page cache)", ("torch_save", "plain")),
            ("DCP async_save blocking", ("dcp", "save")),
            ("DCP async_save first call", ("dcp", "first")),
            ("DLRover memory save", ("dlrover", "memory_save")),
            ("DLRover first save", ("dlrover", "first_memory_save")),
            ("DLRover persist (save to persisted)", ("dlrover", "persisted")),
            ("our restore, zero-copy views", ("restore_ours", "zero_copy")),
            ("our restore, private copy", ("restore_ours", "copied")),
            ("our restore + copy into model", ("restore_ours", "into_model")),
            ("torch.load (page cache)", ("restore_torch", "load")),
            ("torch.load + copy into model (page cache)", ("restore_torch", "into_model")),
            ("torch.load + copy into model (from disk)", ("restore_torch", "cold_into_model")),
            ("train: step without checkpoint", ("train", "step")),
            ("train: memcpy of the model+Adam state (libc memmove)", ("train", "memcpy")),
            ("train: extra per checkpoint, ours overlapped", ("train", "ours_overlap")),
            ("train: extra per checkpoint, ours overlapped + persist", ("train", "ours_overlap_persist")),
            ("train: extra per checkpoint, ours blocking", ("train", "ours_blocking")),
            ("train: extra per checkpoint, torch.save+fsync", ("train", "torch_save_fsync")),
            ("train: extra per checkpoint, torch.save (page cache)", ("train", "torch_save")),
            ("train: extra per checkpoint, DCP async_save", ("train", "dcp_async")),
        ]
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="256M,1G,4G", help="comma-separated state sizes (K/M/G suffixes)")
    parser.add_argument("--tensors", type=int, default=16, help="tensors per state dict")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats of each operation (median reported)")
    parser.add_argument("--warmups", type=int, default=1, help="untimed runs of each operation before its repeats")
    parser.add_argument("--dir", default=None, help="working directory on the local disk (default: system temp)")
    parser.add_argument("--skip-dcp", action="store_true")
    parser.add_argument("--skip-dlrover", action="store_true")
    parser.add_argument("--quick", action="store_true", help="smoke-sized run: 16M, 2 repeats")
    parser.add_argument("--skip-train", action="store_true", help="skip the training-loop rows")
    parser.add_argument("--train-steps", type=int, default=8, help="training steps per run of a variant")
    parser.add_argument("--train-every", type=int, default=1, help="checkpoint every K steps in the training loop")
    parser.add_argument("--train-rounds", type=int, default=3, help="timed rounds of every variant (median)")
    # internal: the fresh processes of one size and of its restores
    parser.add_argument("--role", choices=["size", "train", "restore-ours", "restore-torch"], help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("target", nargs="?", help=argparse.SUPPRESS)
    parser.add_argument("pos", nargs="*", help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args(argv)  # `python -m benchmarks` passes every benchmark the same options
    if args.role == "size":
        return size_main(args)
    if args.role == "train":
        return train_main(args)
    if args.role in ("restore-ours", "restore-torch"):
        args.bytes, args.tensors, args.warmups, args.repeats = (int(x) for x in args.pos)
        return restore_ours_main(args) if args.role == "restore-ours" else restore_torch_main(args)
    if args.quick:
        args.sizes, args.repeats = "16M", 2
    return parent_main(args)


def parent_main(a: argparse.Namespace) -> int:
    install_signal_handlers()
    print(
        f"flash checkpoint benchmark: {os.cpu_count()} cores, load average {load_average()}; "
        f"{a.warmups} warm-up(s) + median of {a.repeats} repeats per operation; one fresh process per size",
        flush=True,
    )
    results: dict[str, dict[str, Any]] = {}
    status = 0
    try:
        for text in a.sizes.split(","):
            label, size = text.strip(), parse_size(text)
            problem = fits(size, a.dir)
            if problem:
                print(f"\n== state dict {label}: CANNOT RUN, it needs {problem} ==", flush=True)
                results[label] = {"error": problem}
                status = 1
                continue
            t = time.perf_counter()
            try:
                r = run_size(size, a)
            except RuntimeError as exc:
                print(f"\n== state dict {label}: FAILED: {exc} ==", flush=True)
                results[label] = {"error": str(exc)}
                status = 1
                continue
            results[label] = r
            print(
                f"\n== state dict {label} ({size / (1 << 20):.0f} MiB, {a.tensors} tensors; torch {r['torch']}, "
                f"{r['threads']} intra-op threads; {time.perf_counter() - t:.0f} s; "
                f"load average {load_average()}) ==",
                flush=True,
            )
            print(table(["operation", "seconds: median [min-max]"], time_rows(r)), flush=True)
            if "state_bytes" in r.get("train", {}):
                tr = r["train"]
                print(
                    f"  training loop: model + Adam state {tr['state_bytes'] / (1 << 20):.0f} MiB, "
                    f"a checkpoint every {a.train_every} step(s), {tr['samples']} samples per variant over "
                    f"{a.train_rounds} rounds; extra = median(steps + checkpoint) - median(steps without), "
                    "min-max are of single samples minus that median; an overlapped copy's wait (in the next "
                    "optimizer step) and its slowdown of forward/backward are inside it",
                    flush=True,
                )
            if "error" in r.get("train", {}):
                print(f"  TRAINING-LOOP ROWS FAILED: {r['train']['error']}", flush=True)
                status = 1
            if "error" in r.get("dlrover", {}):
                print(f"  DLRover peer not measured: {r['dlrover']['error']}", flush=True)
    except Interrupted as exc:
        print(f"\ninterrupted by signal {exc.signum}: temp dirs, shared memory and children removed", flush=True)
        return 128 + exc.signum
    print(f"\n== ratios (ours faster by, medians; {a.repeats} repeats after {a.warmups} warm-up) ==", flush=True)
    print(table(["comparison", "goal", *results], ratio_rows(results)), flush=True)
    print("\n== issue 4 goals: the row each is judged on, and why ==", flush=True)
    print("\n".join(goal_lines(results)), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
