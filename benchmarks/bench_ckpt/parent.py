"""The parent: one fresh process per size, cleanup of everything it started, the DLRover peer."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from benchmarks.bench_ckpt.measure import (
    CHILD_GRACE,
    DISK_FACTOR,
    DLROVER_PY,
    GIB,
    MEMORY_MARGIN,
    PEAK_FACTOR,
    REPO,
    free_bytes,
    meminfo,
)
from streamrover.operator import die_with_parent


class Run:
    """What one size started: removed by :meth:`cleanup` on every exit path."""

    def __init__(self, base: str | None) -> None:
        self.work = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=base))
        self.procs: list[subprocess.Popen[str]] = []  # each leads its own process group
        self.stopped: set[int] = set()
        self.dlrover_job = f"srbench-{uuid.uuid4().hex[:12]}"
        self.namespaces: list[str] = []

    def start(self, cmd: list[str], **kwargs: Any) -> subprocess.Popen[str]:
        # SIGTERM when this process dies (even by SIGKILL): the child cleans up; no preexec_fn (die_with_parent.py)
        argv = die_with_parent.wrap(cmd, sig=signal.SIGTERM)
        proc = subprocess.Popen(argv, cwd=REPO, text=True, start_new_session=True, **kwargs)
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
        return {"error": f"no DLRover venv at {DLROVER_PY} (make dlrover-venv, or set STREAMROVER_DLROVER_PYTHON)"}
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
