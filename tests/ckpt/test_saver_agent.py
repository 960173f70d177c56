"""The saver as an elastic agent hosts it: wait_idle after workers die, lower-priority persists, purging buffers."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamrover.ckpt import (
    Checkpointer,
    CheckpointSaver,
    LoadedFrom,
    namespace_for,
    purge_shared_memory,
    saver_address,
)
from streamrover.ckpt.layout import complete_steps
from streamrover.ckpt.saver import lower_thread_priority
from streamrover.ckpt.storage import Storage

from .conftest import shm_names
from .trainer_proc import state_at

TRAINER = str(Path(__file__).with_name("trainer_proc.py"))
pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def agent_saver(root: str) -> Iterator[CheckpointSaver]:
    """The node's saver, served from a thread of this process, as the elastic agent hosts it."""
    saver = CheckpointSaver(saver_address(namespace_for(root)), linger=None)
    saver.bind()
    thread = threading.Thread(target=saver.serve_forever, name="test-agent-saver", daemon=True)
    thread.start()
    yield saver
    saver.stop()
    thread.join(timeout=60)
    assert not thread.is_alive()


def test_wait_idle_returns_once_a_killed_trainers_snapshot_is_persisted(
    root: str, pids: list[int], agent_saver: CheckpointSaver
) -> None:
    assert agent_saver.wait_idle(timeout=0)  # nobody connected yet
    proc = subprocess.Popen(
        [sys.executable, TRAINER, "--root", root, "--saver", "agent", "--steps", "3", "--persist", "1", "--mib", "8"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    pids.append(proc.pid)
    assert proc.stdout is not None
    for line in proc.stdout:  # step 1 persisted, steps 2 and 3 in memory only
        if line.startswith("saver "):
            break
    assert int(line.split()[1]) == os.getpid()  # the trainer is served by our agent's saver
    assert agent_saver.sessions == 1
    assert not agent_saver.wait_idle(timeout=0)  # a live trainer keeps it busy
    assert complete_steps(Storage(root)) == [1]
    proc.kill()
    proc.wait()
    # no polling: when wait_idle returns, the dead trainer's session has persisted its newest snapshots
    assert agent_saver.wait_idle(timeout=120)
    assert agent_saver.sessions == 0
    assert complete_steps(Storage(root)) == [1, 2, 3]
    loaded = Checkpointer(root, saver="thread").load(memory=False)
    assert (loaded.step, loaded.source, loaded.state["step"]) == (3, LoadedFrom.STORAGE, 3)
    # idle and the trainer is gone for good: the agent frees its buffers
    assert len(purge_shared_memory(namespace_for(root))) == 2
    assert shm_names(namespace_for(root)) == []


def test_wait_idle_times_out_while_a_trainer_is_connected(root: str, agent_saver: CheckpointSaver) -> None:
    ckpt = Checkpointer(root, saver="agent")
    ckpt.save(1, state_at(1, 1.0))
    ckpt.wait(timeout=60)
    assert not agent_saver.wait_idle(timeout=0.05)
    ckpt.close()
    assert agent_saver.wait_idle(timeout=60)


def test_persist_threads_run_nicer_than_the_saver() -> None:
    seen: dict[str, int] = {}

    def worker() -> None:
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        lower_thread_priority(5)
        seen["lowered"] = os.getpriority(os.PRIO_PROCESS, tid) - before
        child = threading.Thread(target=lambda: seen.update(child=os.getpriority(os.PRIO_PROCESS, 0)))
        child.start()  # a thread it starts (the checksum thread) inherits its priority
        child.join()
        seen["thread"] = os.getpriority(os.PRIO_PROCESS, tid)

    main_before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["lowered"] == min(5, 19 - main_before)
    assert seen["child"] == seen["thread"]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_before  # the caller is untouched
    with pytest.raises(ValueError, match="nice must be >= 0"):
        CheckpointSaver("\0unused", nice=-1)


def test_purge_can_be_limited_to_ranks_and_rejects_a_blank_namespace(root: str) -> None:
    for rank in range(3):
        ckpt = Checkpointer(root, rank=rank, world_size=3, saver="thread")
        ckpt.save(1, state_at(1, 0.1), persist=False)
        ckpt.close()
    ns = namespace_for(root)
    assert purge_shared_memory(ns, ranks=[1]) == [f"srckpt-{ns}-r1-b{b}" for b in range(2)]
    assert shm_names(ns) == sorted(f"srckpt-{ns}-r{r}-b{b}" for r in (0, 2) for b in range(2))
    assert purge_shared_memory(ns, ranks=[1]) == []  # already gone: not an error
    # a restarted rank 0 still finds its snapshot: purging rank 1 left it alone
    assert Checkpointer(root, rank=0, world_size=3, saver="thread").load().source == LoadedFrom.MEMORY
    for blank in ("", " "):
        with pytest.raises(ValueError, match="namespace must be"):
            purge_shared_memory(blank)
    assert len(purge_shared_memory(ns)) == 4


def test_a_long_job_name_still_gives_a_saver_address_that_binds() -> None:
    """Run id (a UUID) + node id (a 63-character pod name) overflowed the 108-byte Unix socket address."""
    import socket

    job = "19f957f1-5885-4b6a-a7a1-dad098840b26." + "train-job-worker-" + "x" * 46
    address = saver_address(namespace_for("/tmp/ckpt", job))
    assert address != saver_address(namespace_for("/tmp/ckpt", job + "y")), "distinct jobs, distinct savers"
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.bind(address)
