"""FlashRun never rewrites a durable checkpoint: a second save of a persisted step (Lightning's own checkpoint
callback at the same global step) and close() at a step restored from storage leave its files as they are."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from streamrover.ckpt import namespace_for, purge_shared_memory
from streamrover.ckpt.layout import MANIFEST, complete_steps, part_names, step_dir
from streamrover.ckpt.storage import Storage
from streamrover.trainers.flash import FlashRun


def _files(root: Path, step: int) -> dict[str, bytes]:
    d = root / step_dir(step)
    return {n: (d / n).read_bytes() for n in (*part_names(0), MANIFEST)}


def test_a_persisted_step_is_saved_again_to_shared_memory_only(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    try:
        run = FlashRun(ckpt_dir=str(root), stream=False, every_n_steps=5)
        run.open(0)
        run.save(5, {"w": np.full(1000, 5.0)})
        assert run.checkpointer is not None
        run.checkpointer.wait(timeout=60)
        written = _files(root, 5)
        run.save(5, {"w": np.full(1000, 5.0)}, persist=True)  # what raised (or rewrote the files under a reader)
        run.close(5, {"w": np.full(1000, 5.0)})
        assert _files(root, 5) == written and complete_steps(Storage(str(root))) == [5]

        purge_shared_memory(namespace_for(str(root)))  # another node: storage alone
        again = FlashRun(ckpt_dir=str(root), stream=False, every_n_steps=5)
        again.open(0)
        loaded = again.restore()
        assert loaded is not None and again.restored_from == "storage:5" and again.last_persisted == 5
        again.close(5, loaded.state)  # ended at once: the durable checkpoint stands
        assert _files(root, 5) == written
    finally:
        purge_shared_memory(namespace_for(str(root)))
