"""The checkpointer's persist reports are bounded when nobody calls wait() (issue 15, item 10)."""

from __future__ import annotations

import numpy as np

from streamrover.ckpt import Checkpointer, RetentionPolicy
from streamrover.ckpt import checkpointer as checkpointer_module


def _persisted(ckpt: Checkpointer) -> None:
    """Until the saver has finished every requested persist (what wait() waits for, without taking the reports)."""
    with ckpt._cond:
        assert ckpt._cond.wait_for(lambda: not ckpt._busy and not ckpt._want_persist, 60)


def test_reports_kept_without_wait_are_bounded_and_failures_are_not_lost(root: str) -> None:
    limit = getattr(checkpointer_module, "MAX_RESULTS", 64)
    with Checkpointer(root, saver="thread", retention=RetentionPolicy(keep_last=2)) as ckpt:
        for step in range(3 * limit):  # a training loop that saves and never waits
            ckpt.save(step, {"w": np.full((8, 8), step, dtype=np.float32)})
            _persisted(ckpt)
        assert len(ckpt._results) <= limit, f"{len(ckpt._results)} persist reports kept"
        results = ckpt.wait(timeout=60)
        assert results[-1].step == 3 * limit - 1 and all(r.ok for r in results)
