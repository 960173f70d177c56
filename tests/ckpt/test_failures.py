"""Real processes killed with SIGKILL: trainers mid-save and after a save, savers mid-persist."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from streamrover.ckpt import Checkpointer, LoadedFrom, SaverError, namespace_for, saver_address
from streamrover.ckpt.layout import MANIFEST, step_dir
from streamrover.ckpt.memory import MemoryEngine
from streamrover.ckpt.shm import SharedBuffer

from .trainer_proc import cursor_at, state_at

TRAINER = str(Path(__file__).with_name("trainer_proc.py"))
pytestmark = pytest.mark.timeout(180)


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Bounded wait for a condition another process makes true on disk (no event exists for it)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


class Trainer:
    def __init__(self, root: str, pids: list[int], *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, TRAINER, "--root", root, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        pids.append(self.proc.pid)
        self.saver_pid = 0
        self.last_saved = 0

    def read_until(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("saved "):
                self.last_saved = int(line.split()[1])
            if line.startswith("saver "):
                self.saver_pid = int(line.split()[1])
            if line.startswith(prefix):
                return line
        raise AssertionError(f"trainer exited ({self.proc.wait()}) before printing {prefix!r}")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def buffer_states(root: str) -> list[str]:
    """What each of this root's snapshot buffers holds (for failure messages)."""
    states = []
    for name in MemoryEngine(namespace_for(root), 0).names():
        buf = SharedBuffer.open(name)
        found = buf.read_header() if buf is not None else None
        gen = buf.generation() if buf is not None else None
        states.append(f"{name[-2:]}: " + ("missing" if buf is None else f"gen {gen} step {found and found[1]['step']}"))
    return states


def load_in_new_process(root: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, TRAINER, "--root", root, "--load"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout)
    return result


def test_trainer_killed_right_after_memory_save_is_persisted_by_saver(root: str, pids: list[int]) -> None:
    trainer = Trainer(root, pids, "--steps", "2", "--persist", "1")
    trainer.read_until("saver ")
    assert trainer.saver_pid > 0
    pids.append(trainer.saver_pid)
    assert not (Path(root) / step_dir(2)).exists()  # step 2 was a memory-only save
    trainer.kill()
    wait_for(lambda: (Path(root) / step_dir(2) / MANIFEST).exists(), 60, "the saver to persist step 2")
    loaded = Checkpointer(root, saver="thread").load(memory=False, restore=False)
    assert loaded.step == 2 and loaded.source == LoadedFrom.STORAGE
    assert loaded.cursor == cursor_at(2)
    np.testing.assert_array_equal(loaded.state["w0"], state_at(2, 1.0)["w0"])
    os.kill(trainer.saver_pid, 0)  # the saver outlived its trainer and still serves a restart


def test_forked_child_does_not_hide_the_trainers_death_from_the_saver(root: str, pids: list[int]) -> None:
    trainer = Trainer(root, pids, "--steps", "2", "--persist", "1", "--fork-child")
    child = int(trainer.read_until("child ").split()[1])
    pids.append(child)
    trainer.read_until("saver ")
    pids.append(trainer.saver_pid)
    trainer.kill()
    os.kill(child, 0)  # the child still holds the trainer's descriptors
    wait_for(lambda: (Path(root) / step_dir(2) / MANIFEST).exists(), 60, "the saver to persist step 2")


def test_two_ranks_killed_after_memory_saves_get_one_complete_checkpoint(root: str, pids: list[int]) -> None:
    """Both ranks of a job die; the node's saver persists each rank's part and publishes the manifest."""
    trainers = [
        Trainer(root, pids, "--steps", "3", "--persist", "1", "--rank", str(r), "--world-size", "2") for r in (0, 1)
    ]
    for trainer in trainers:
        trainer.read_until("saver ")
        pids.append(trainer.saver_pid)
    assert trainers[0].saver_pid == trainers[1].saver_pid  # one saver per node serves every rank
    for trainer in trainers:
        trainer.kill()
    wait_for(lambda: (Path(root) / step_dir(3) / MANIFEST).exists(), 60, "the manifest of step 3")
    for rank in (0, 1):
        ckpt = Checkpointer(root, saver="thread", rank=rank, world_size=2)
        loaded = ckpt.load(memory=False, restore=False)
        assert loaded.step == 3 and loaded.cursor == cursor_at(3)
        assert float(loaded.state["w2"][0]) == 3 + rank * 1000


def test_restarted_trainer_on_same_node_loads_from_memory(root: str, pids: list[int]) -> None:
    trainer = Trainer(root, pids, "--steps", "3", "--persist", "1", "--mib", "8")
    trainer.read_until("saver ")
    pids.append(trainer.saver_pid)
    trainer.kill()
    result = load_in_new_process(root)
    assert result["source"] == "memory" and result["step"] == 3 and result["values"] == [3.0]
    assert result["state_step"] == 3 and result["cursor"] == cursor_at(3).to_json()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_trainer_killed_mid_save_never_exposes_a_torn_snapshot(root: str, pids: list[int], seed: int) -> None:
    trainer = Trainer(root, pids, "--steps", "100000", "--mib", "48")  # memory-only saves, as fast as it can
    trainer.read_until("saved 2")
    time.sleep(random.Random(seed).uniform(0.0, 0.05))  # a random kill point, not synchronisation
    trainer.kill()
    result = load_in_new_process(root)
    assert result["source"] == "memory"
    step = result["step"]
    assert isinstance(step, int) and step >= 2, f"loaded step {step}; buffers now: {buffer_states(root)}"
    assert result["values"] == [float(step)] and result["state_step"] == step  # every tensor from the same save


def start_saver(root: str, pids: list[int]) -> subprocess.Popen[str]:
    address = saver_address(namespace_for(root))
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamrover.ckpt", "--address", "@" + address[1:], "--linger", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    pids.append(proc.pid)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
    return proc


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_saver_killed_mid_persist_leaves_previous_checkpoint_loadable(root: str, pids: list[int], seed: int) -> None:
    rng = random.Random(seed)
    saver = start_saver(root, pids)
    ckpt = Checkpointer(root, saver="agent")  # the saver an agent would host, here a process we own
    ckpt.save(1, state_at(1, 16), cursor=cursor_at(1))
    ckpt.wait(timeout=60)
    big = 192 if seed == 0 else 64  # seed 0 kills mid-write: make the write last well beyond one poll
    ckpt.save(2, state_at(2, big), cursor=cursor_at(2))
    step2 = Path(root) / step_dir(2)
    if seed == 0:  # deterministic: kill once the tensors file is being written
        tmp = ".rank-00000.safetensors.tmp"
        wait_for(lambda: step2.exists() and any(p.name.startswith(tmp) for p in step2.iterdir()), 30, "a temp file")
    else:
        time.sleep(rng.uniform(0.0, 0.4))  # a random kill point
    saver.send_signal(signal.SIGKILL)
    saver.wait()
    try:
        ckpt.wait(timeout=60)
        reported_done = True
    except SaverError as exc:
        assert "went away" in str(exc)
        reported_done = False
    loaded = Checkpointer(root, saver="thread").load(memory=False, restore=False)
    complete = (step2 / MANIFEST).exists()
    assert loaded.step == (2 if complete else 1)
    assert loaded.cursor == cursor_at(loaded.step)
    np.testing.assert_array_equal(loaded.state["w3"], state_at(loaded.step, 16 if loaded.step == 1 else big)["w3"])
    assert complete or not reported_done, "wait() reported step 2 persisted but it has no manifest"
    if seed == 0:
        assert not complete, "the saver was killed mid-persist, yet step 2 was published"
        start_saver(root, pids)  # the agent restarts its saver: the next persist goes through
        ckpt.save(3, state_at(3, 1), cursor=cursor_at(3))
        assert [r.step for r in ckpt.wait(timeout=60)] == [3]
        assert Checkpointer(root, saver="thread").load(memory=False, restore=False).step == 3
