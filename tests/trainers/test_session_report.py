"""``StreamSession.report``: a trainer's metrics reach the master's ``/metrics`` (issue 13, item 4)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from streamrover.testing.procs import MasterProcess
from streamrover.trainers.torch import StreamSession
from tests.shard_service.dashboard_job import scrape


def test_session_report_reaches_metrics_with_the_rank_and_step(
    tmp_path: Path, master: MasterProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STREAMROVER_CKPT_SAVER", "thread")
    session = StreamSession(torch.nn.Linear(1, 1), master=master.address, token=master.token,
                            ckpt_dir=str(tmp_path / "ckpt"))  # fmt: skip
    try:
        session.report(loss=0.625, auc=0.75)
        session.step_done()
        session.step_done()
        session.report(auc=0.8125, calibration=1.03125)
        m = scrape(master)
    finally:
        session.close(final_checkpoint=False)
    who = session.client.name
    assert who == "rank0@local"
    assert m[("streamrover_trainer_metric", (("name", "auc"), ("reporter", who)))] == 0.8125
    assert m[("streamrover_trainer_metric", (("name", "loss"), ("reporter", who)))] == 0.625
    assert m[("streamrover_trainer_metric", (("name", "calibration"), ("reporter", who)))] == 1.03125
    assert m[("streamrover_trainer_step", (("reporter", who),))] == 2
