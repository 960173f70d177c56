"""Overlapped (pipelined) saves: TorchCheckpoint(overlap=True) copies the optimizer's tensors in the background.

The background copy is gated in some tests by wrapping the raw chunk copy: a chunk taken by the
background thread blocks on an Event that the trainer thread sets when it helps with a chunk
itself, which it does only inside ``wait_snapshot`` (the optimizer step pre-hook). So the copy
is provably unfinished when ``save`` returns, and the step provably waits for it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from streamrover.ckpt import Checkpointer, SnapshotCopyError, TorchCheckpoint, copier

pytestmark = pytest.mark.timeout(300)

GATE_TIMEOUT = 60.0


def make_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    # ~6 MB of parameters, + Adam's 2 moments: several 4 MiB chunks; BatchNorm has buffers forward updates.
    return torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.BatchNorm1d(1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512)
    )


def forward_backward(model: torch.nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    optim.zero_grad()
    model(torch.randn(32, 512, generator=gen)).pow(2).mean().backward()


def clone_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    def clone(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            return node.detach().clone()
        if isinstance(node, dict):
            return {k: clone(v) for k, v in node.items()}
        if isinstance(node, list):
            return [clone(v) for v in node]
        return node

    return {"model": clone(model.state_dict()), "optimizer": clone(optim.state_dict())}


def assert_same(got: Any, want: Any, path: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert torch.equal(got, want), f"{path} differs from the state at save time"
    elif isinstance(want, dict):
        assert set(got) == set(want), path
        for k in want:
            assert_same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{i}]")
    else:
        assert got == want, path


class Gate:
    """Blocks background chunk copies until a chunk is copied by a thread that is not a background copier."""

    def __init__(self) -> None:
        self.armed = threading.Event()  # set by the test once save has returned
        self.opened = threading.Event()
        self.helped_by: set[str] = set()
        self.real = copier._memmove

    def __call__(self, dst: int, src: int, n: int) -> Any:
        name = threading.current_thread().name
        if name.startswith("ckpt-copy-bg"):
            assert self.opened.wait(GATE_TIMEOUT), "nobody helped the background copy"
        elif self.armed.is_set():
            self.helped_by.add(name)
            self.opened.set()
        return self.real(dst, src, n)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate()
    monkeypatch.setattr(copier, "_memmove", g)
    yield g
    g.opened.set()


def test_step_waits_for_the_copy_and_the_snapshot_is_the_state_at_save_time(root: str, gate: Gate) -> None:
    model = make_model()
    seen_at_step: list[Any] = []
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    forward_backward(model, optim, 0)
    optim.step()
    with Checkpointer(root, saver="thread") as ckpt:
        adapter = TorchCheckpoint(ckpt, model, optim, overlap=True)

        # Registered after the adapter's hook, so it runs after it: what does the step see when it starts?
        def record(*_: Any) -> None:
            seen_at_step.append((ckpt.snapshot_pending, ckpt.engine.newest()))

        optim.register_step_pre_hook(record)
        forward_backward(model, optim, 1)
        expected = clone_state(model, optim)
        adapter.save(7, persist=False)
        gate.armed.set()
        # save returned while the background copy is blocked: the snapshot is not visible yet.
        assert ckpt.snapshot_pending
        assert ckpt.engine.newest() is None
        optim.step()  # the hook: this thread helps with the remaining chunks, then waits for the publication
        assert gate.helped_by == {threading.current_thread().name}
        ((pending, newest),) = seen_at_step
        assert not pending and newest is not None and newest.step == 7
        after_step = clone_state(model, optim)
        loaded = ckpt.load(zero_copy=False, restore=False)
    assert loaded.step == 7
    assert_same(loaded.state, expected)
    changed = [k for k, v in after_step["model"].items() if not torch.equal(v, expected["model"][k])]
    assert "0.weight" in changed and "3.weight" in changed  # the step did mutate what the snapshot holds


def test_buffers_are_copied_before_save_returns(root: str, gate: Gate) -> None:
    model = make_model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    forward_backward(model, optim, 0)
    optim.step()
    with Checkpointer(root, saver="thread") as ckpt:
        adapter = TorchCheckpoint(ckpt, model, optim, overlap=True)
        forward_backward(model, optim, 1)
        expected = clone_state(model, optim)
        adapter.save(3, persist=False)
        gate.armed.set()
        forward_backward(model, optim, 2)  # updates BatchNorm's running stats while the params are being copied
        assert not torch.equal(model.state_dict()["1.running_mean"], expected["model"]["1.running_mean"])
        optim.step()
        loaded = ckpt.load(zero_copy=False, restore=False)
    assert_same(loaded.state, expected)


def test_every_snapshot_of_a_training_loop_is_its_save_time_state(root: str) -> None:
    model = make_model()
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    with Checkpointer(root, saver="thread") as ckpt:
        adapter = TorchCheckpoint(ckpt, model, optim, overlap=True)
        for step in range(1, 6):
            forward_backward(model, optim, step)
            optim.step()
            expected = clone_state(model, optim)
            adapter.save(step, persist=False)
            forward_backward(model, optim, 100 + step)
            optim.step()  # mutates every parameter right after the save returned
            loaded = ckpt.load(zero_copy=False, restore=False)
            assert loaded.step == step
            assert_same(loaded.state, expected)
        adapter.close()
        optim.step()  # the hook is gone: no wait, no error


def test_copy_failure_surfaces_on_the_next_step_and_save(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    real = copier._memmove

    def failing(dst: int, src: int, n: int) -> Any:
        if threading.current_thread().name.startswith("ckpt-copy-bg"):
            raise OSError("injected copy failure")
        return real(dst, src, n)

    model = make_model()
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    forward_backward(model, optim, 0)
    optim.step()
    with Checkpointer(root, saver="thread") as ckpt:
        adapter = TorchCheckpoint(ckpt, model, optim, overlap=True)
        adapter.save(1, persist=False)
        adapter.wait()
        good = clone_state(model, optim)
        monkeypatch.setattr(copier, "_memmove", failing)
        adapter.save(2, persist=False)
        forward_backward(model, optim, 2)
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(SnapshotCopyError, match="step 2.*injected copy failure"):
            optim.step()
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # the step did not run
        adapter.save(3, persist=False)  # the failure was reported once; this copy fails again...
        with pytest.raises(SnapshotCopyError, match="step 3"):
            adapter.save(4, persist=False)  # ...and the next save reports it before taking its own snapshot
        monkeypatch.setattr(copier, "_memmove", real)
        newest = ckpt.engine.newest()
        assert newest is not None and newest.step == 1
        assert_same(ckpt.load(zero_copy=False, restore=False).state, good)
        adapter.save(5, persist=False)
        optim.step()
        assert ckpt.load(zero_copy=False, restore=False).step == 5


CHILD = r"""
import sys, threading, torch
from streamrover.ckpt import Checkpointer, TorchCheckpoint, copier
real = copier._memmove
never = threading.Event()
def gated(dst, src, n):
    if threading.current_thread().name.startswith("ckpt-copy-bg") and GATED[0]:
        print("copying", flush=True)
        never.wait()  # SIGKILLed here, in the middle of the background copy
    return real(dst, src, n)
GATED = [False]
copier._memmove = gated
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(512, 1024), torch.nn.BatchNorm1d(1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512)
)
optim = torch.optim.Adam(model.parameters(), lr=0.1)
with torch.no_grad():
    for p in model.parameters():
        p.fill_(1.0)
ckpt = Checkpointer(sys.argv[1], saver="thread")
adapter = TorchCheckpoint(ckpt, model, optim, overlap=True)
adapter.save(1, persist=False)
adapter.wait()
with torch.no_grad():
    for p in model.parameters():
        p.fill_(2.0)
GATED[0] = True
adapter.save(2, persist=False)
"""


def test_sigkill_during_the_background_copy_leaves_the_previous_snapshot(root: str, tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    proc = subprocess.Popen([sys.executable, str(script), root], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "copying"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    model = make_model()
    with Checkpointer(root, saver="thread") as ckpt:
        loaded = ckpt.load(zero_copy=False, restore=False)
        assert loaded.step == 1
        assert all(bool((t == 1.0).all()) for k, t in loaded.state["model"].items() if k.endswith("weight"))
        assert len(ckpt.engine.snapshots()) == 1  # the torn buffer of step 2 is not a snapshot
        TorchCheckpoint(ckpt, model, torch.optim.Adam(model.parameters())).load(restore=False)
    assert all(bool((p == 1.0).all()) for p in model.parameters() if p.dim() == 2)


def test_persisting_every_overlapped_save_never_sends_a_buffer_being_rewritten(root: str) -> None:
    # A persist finishing while an overlapped copy rewrites the buffer of the newest snapshot must not dispatch
    # that (superseded) snapshot: the saver would report it as failed.
    model = make_model()
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    with Checkpointer(root, saver="thread") as ckpt:
        adapter = TorchCheckpoint(ckpt, model, optim, overlap=True)
        for step in range(1, 13):
            forward_backward(model, optim, step)
            optim.step()
            expected = clone_state(model, optim)
            adapter.save(step, persist=True)
        optim.step()
        results = ckpt.wait(timeout=120)
        assert results and all(r.ok for r in results)
        loaded = ckpt.load(memory=False, restore=False)
    assert loaded.step == 12
    assert_same(loaded.state, expected)
