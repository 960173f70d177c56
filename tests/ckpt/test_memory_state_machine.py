"""Property test of the memory engine's buffer ring: saves, persists holding buffers, and torn writes."""

from __future__ import annotations

import os
import uuid

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from streamrover.ckpt.flatten import copy_into, flatten
from streamrover.ckpt.memory import MemoryEngine, plan_layout

from .conftest import SHM


def state_at(step: int, width: int) -> dict[str, object]:
    return {"a": np.full(width, step, dtype=np.int64), "b": np.full(3, -step, dtype=np.float32), "step": step}


class BufferRing(RuleBasedStateMachine):
    """The trainer saves (sometimes dying mid-copy), the saver holds up to all-but-one buffer while persisting."""

    def __init__(self) -> None:
        super().__init__()
        self.namespace = f"sm-{uuid.uuid4().hex[:10]}"
        self.engine = MemoryEngine(self.namespace, rank=0, num_buffers=3)
        self.busy: set[int] = set()
        self.step = 0
        self.completed: list[int] = []  # steps whose save finished
        self.overwritten: set[int] = set()  # completed steps whose buffer was written again since

    def teardown(self) -> None:
        self.engine.unlink()
        assert not [n for n in os.listdir(SHM) if n.startswith(f"srckpt-{self.namespace}-")]

    def _holder(self, step: int) -> int | None:
        for snap in self.engine.snapshots():
            if snap.step == step:
                return snap.index
        return None

    @rule(width=st.integers(1, 3000))
    def save(self, width: int) -> None:
        self.step += 1
        index = self.engine.choose(self.busy)
        assert index not in self.busy, "a save chose a buffer the saver is reading"
        self.overwritten.update(s for s in self.completed if self._holder(s) == index)
        self.engine.write(index, self.step, state_at(self.step, width), {"world_size": 1})
        self.completed.append(self.step)

    @rule(width=st.integers(1, 3000), fraction=st.floats(0, 1))
    def die_mid_save(self, width: int, fraction: float) -> None:
        """The trainer is killed during the copy: begin_write happened, end_write never does."""
        self.step += 1
        index = self.engine.choose(self.busy)
        self.overwritten.update(s for s in self.completed if self._holder(s) == index)
        buf = self.engine._ensure(index, self.engine.capacity_needed(flatten(state_at(self.step, width))[1]))
        buf.begin_write()
        _, entries = flatten(state_at(self.step, width))
        offsets, _ = plan_layout(entries)
        for entry, offset in list(zip(entries, offsets))[: int(len(entries) * fraction)]:
            copy_into(entry, buf.mm, offset)
        # a restarted trainer maps the same buffers again
        self.engine = MemoryEngine(self.namespace, rank=0, num_buffers=3)

    @precondition(lambda self: len(self.busy) < 2)
    @rule()
    def saver_takes_newest(self) -> None:
        newest = self.engine.newest()
        if newest is not None:
            self.busy.add(newest.index)

    @precondition(lambda self: bool(self.busy))
    @rule(data=st.data())
    def saver_finishes(self, data: st.DataObject) -> None:
        self.busy.discard(data.draw(st.sampled_from(sorted(self.busy))))

    @invariant()
    def newest_loadable_snapshot_is_consistent_and_latest_surviving(self) -> None:
        survivors = [s for s in self.completed if s not in self.overwritten]
        newest = self.engine.newest()
        if not survivors:
            assert newest is None
            return
        assert newest is not None and newest.step == max(survivors)
        state = self.engine.load(newest, zero_copy=False)
        assert state["step"] == newest.step
        assert set(state["a"].tolist()) == {newest.step} and set(state["b"].tolist()) == {-newest.step}

    @invariant()
    def busy_buffers_keep_their_snapshots(self) -> None:
        for snap in self.engine.snapshots():
            assert snap.step in self.completed


BufferRing.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
TestBufferRing = BufferRing.TestCase
