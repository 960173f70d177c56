"""``StreamSession`` in one process against a real master and a Kafka-protocol broker (tansu): what a run leaves behind.

- The launcher's checkpoint settings (``STREAMROVER_CKPT_EVERY`` / ``STREAMROVER_CKPT_KEEP``, which
  ``streamrover run`` sets from the job spec's ``checkpoint`` section) decide how often the session
  checkpoints and how many checkpoints storage keeps.
- A finished run commits its final cursor upstream: the consumer group's offset equals the final
  cursor, although upstream commits lag durable storage by one checkpoint (a second, confirming
  checkpoint of the same cursor at close).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from streamrover.ckpt.layout import complete_steps
from streamrover.testing.procs import MasterProcess
from streamrover.trainers.torch import StreamSession
from tests.ckpt.test_upstream_commits import _group_offset, _poller_rounds_done, _stream

pytestmark = pytest.mark.timeout(300)


def test_a_finished_run_commits_its_final_cursor_upstream_and_the_spec_s_checkpoint_settings_apply(
    tmp_path: Path, master: MasterProcess, tansu_broker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    admin, topic = _stream(master, tansu_broker)  # 300 records in shards of 100, dataset "s"
    monkeypatch.setenv("STREAMROVER_CKPT_JOB", "final")
    monkeypatch.setenv("STREAMROVER_CKPT_SAVER", "thread")
    monkeypatch.setenv("STREAMROVER_CKPT_EVERY", "2")
    monkeypatch.setenv("STREAMROVER_CKPT_KEEP", "2")
    session = StreamSession(torch.nn.Linear(1, 1), master=master.address, token=master.token,
                            ckpt_dir=str(tmp_path / "ckpt"))  # fmt: skip
    try:
        assert session.ckpt_every == 2
        assert session._ckpt is not None
        checkpointer = session._ckpt.checkpointer
        assert checkpointer.retention.keep_last == 2
        seen = 0
        for batch in session.dataset("s", batch_size=50, columns=["id"]):
            seen += len(batch["id"])
            session.step_done()
            if seen >= 300:
                break
        assert seen == 300
        last = session.step
        checkpointer.wait(timeout=120)
        steps = complete_steps(checkpointer.storage)
        # (a persist still running when newer snapshots come persists only the newest of them next)
        assert steps[-1] == last and len(steps) <= 2 and all(s % 2 == 0 for s in steps), (steps, last)
        session.close()
        assert admin.get_cursor()[0].size() == 300, "the final cut commits every record"
        assert complete_steps(checkpointer.storage)[-1] == session.step
        _poller_rounds_done(admin, tansu_broker, topic, 300)
        assert _group_offset(tansu_broker, topic) == 300, "the finished run's group offset is its final cursor"
    finally:
        admin.close()
