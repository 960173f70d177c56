"""Exports never fail silently: a failed write stops the trainer at its next checkpoint and is reported to the
master (reporter ``serving``); a restart of the exporter (a TF-PS rollback) never cuts short an export under way."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from streamrover.ckpt import Checkpointer, RetentionPolicy, namespace_for, purge_shared_memory
from streamrover.ckpt.torch_adapter import TorchCheckpoint
from streamrover.serving import ExportConfig, ModelRepository, RowTracker, TorchExporter
from streamrover.serving.api import LINEAGE, MODEL_FILE, ExportError
from streamrover.serving.repository import version_files
from streamrover.serving.tables import TOUCHED_KEY
from streamrover.testing.procs import MasterProcess
from streamrover.trainers.torch import StreamSession
from tests.helpers import wait_until
from tests.serving.trainer_proc import FIELDS, TinyCtr, batch_at
from tests.shard_service.dashboard_job import scrape


def tiny_exporter(tmp_path: Path, tracker: RowTracker, ckpt: str | None = None) -> TorchExporter:
    return TorchExporter(ExportConfig(str(tmp_path / "repo"), name="tiny"), ckpt, TinyCtr,
                         (torch.zeros(1, FIELDS, dtype=torch.int64),), input_names=["ids"], output_names=["logit"],
                         tables=tracker.params)  # fmt: skip


def train_steps(session: StreamSession, model: TinyCtr, optimizer: Any, steps: int) -> None:
    for _ in range(steps):
        ids, labels = batch_at(session.step + 1, 0)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(ids), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        session.step_done()


def test_a_failed_export_write_stops_the_trainer_at_its_next_checkpoint_and_is_reported(
    tmp_path: Path, master: MasterProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STREAMROVER_CKPT_SAVER", "thread")
    model = TinyCtr()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = RowTracker(model)
    exporter = tiny_exporter(tmp_path, tracker)

    def disk_full(path: str, data: bytes, algo: str = "") -> str:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    session = StreamSession(model, optimizer, master=master.address, token=master.token,
                            ckpt_dir=str(tmp_path / "ckpt"), ckpt_every=5, exporter=exporter,
                            tracker=tracker)  # fmt: skip
    try:
        monkeypatch.setattr(exporter.repo.storage, "write_bytes", disk_full)  # the repository's disk is full
        train_steps(session, model, optimizer, 5)  # checkpoint 5: durable, its export fails
        failures = ("streamrover_trainer_metric", (("name", "export_failures"), ("reporter", "serving")))
        wait_until(lambda: scrape(master).get(failures) == 1.0, 60, "the failed export reported to the master")
        with pytest.raises(ExportError, match="No space left on device"):
            train_steps(session, model, optimizer, 5)  # the next checkpoint (10) stops the trainer
        assert session.step == 10 and exporter.exported == []
        newest = ("streamrover_trainer_metric", (("name", "export_version"), ("reporter", "serving")))
        assert scrape(master)[newest] == -1
    finally:
        assert session._ckpt is not None
        session._ckpt.checkpointer.close()
        session.client.leave()
        session.client.close()
        purge_shared_memory(namespace_for(str(tmp_path / "ckpt")))


def test_restarting_the_exporter_waits_for_the_export_under_way(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    model = TinyCtr()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = RowTracker(model)
    checkpointer = Checkpointer(ckpt, saver="thread", retention=RetentionPolicy(keep_last=3))
    try:
        model(batch_at(1, 0)[0])
        tracker.step_done(10)
        TorchCheckpoint(checkpointer, model, optimizer).save(10, extra={TOUCHED_KEY: tracker.state()})
        checkpointer.wait(timeout=60)
    finally:
        checkpointer.close()
        purge_shared_memory(namespace_for(ckpt))
    exporter = tiny_exporter(tmp_path, tracker, ckpt)
    writing, cleaning = threading.Event(), threading.Event()
    write, clean = exporter.repo.storage.write_bytes, exporter.repo.clean_temporaries

    def slow_write(path: str, data: bytes, algo: str = "sha256") -> str:
        out = write(path, data, algo)
        if "/.tmp-" in path and not writing.is_set():  # the first file of version 10 is in its temporary dir
            writing.set()
            cleaning.wait(timeout=2.0)  # the old exporter's restart removed that dir here, mid-publish
        return out

    def clean_temporaries() -> int:
        cleaning.set()
        return clean()

    exporter.repo.storage.write_bytes = slow_write  # type: ignore[method-assign]
    exporter.repo.clean_temporaries = clean_temporaries  # type: ignore[method-assign]
    exporter.on_durable(10)  # the export of 10 runs in the exporter's thread...
    assert writing.wait(timeout=60)
    restarted: list[int] = []
    restart = threading.Thread(target=lambda: restarted.extend(exporter.start(10)))
    restart.start()  # ...when the trainer restarts it (a TF-PS rollback to step 10)
    restart.join(timeout=60)
    exporter.close()
    repo = ModelRepository(str(tmp_path / "repo"), "tiny")
    assert repo.versions() == [10] and exporter.exported == [10] and restarted == []
    files = [MODEL_FILE, LINEAGE, *version_files(repo.info(10))]
    missing = [f for f in files if not os.path.exists(repo.path("10", f))]
    assert not missing, f"version 10 was published without {missing}"
