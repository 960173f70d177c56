"""``StreamSession(exporter=, tracker=)``: the trainer API exports every durable checkpoint, with what the trainer
reported and table deltas, against a real master; a restarted session resumes the repository where it left it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from streamrover.ckpt import namespace_for, purge_shared_memory
from streamrover.serving import ExportConfig, ModelRepository, RowTracker, TorchExporter, read_tables
from streamrover.testing.procs import MasterProcess
from streamrover.trainers.torch import StreamSession
from tests.serving.test_export import checkpoint_state
from tests.serving.trainer_proc import FIELDS, TinyCtr, batch_at


def session_run(tmp_path: Path, master: MasterProcess, steps: int) -> StreamSession:
    model = TinyCtr()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    tracker = RowTracker(model)
    tracker.check_optimizer(optimizer)
    exporter = TorchExporter(ExportConfig(str(tmp_path / "repo"), name="tiny", base_every=3), None, TinyCtr,
                             (torch.zeros(1, FIELDS, dtype=torch.int64),), input_names=["ids"],
                             output_names=["logit"], tables=tracker.params)  # fmt: skip
    session = StreamSession(model, optimizer, master=master.address, token=master.token,
                            ckpt_dir=str(tmp_path / "ckpt"), ckpt_every=5, exporter=exporter,
                            tracker=tracker)  # fmt: skip
    while session.step < steps:
        ids, labels = batch_at(session.step + 1, 0)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(ids), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        session.report(loss=float(loss.detach()))
        session.step_done()
    session.close()
    return session


def test_session_exports_durable_checkpoints_with_reports_and_deltas(
    tmp_path: Path, master: MasterProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STREAMROVER_CKPT_SAVER", "thread")
    try:
        check_session_exports(tmp_path, master)
    finally:
        purge_shared_memory(namespace_for(str(tmp_path / "ckpt")))


def check_session_exports(tmp_path: Path, master: MasterProcess) -> None:
    first = session_run(tmp_path, master, 10)
    repo = ModelRepository(str(tmp_path / "repo"), "tiny")
    # checkpoints 5 (durable unless superseded by 10 before its persist began), 10, then close()'s confirming
    # one (11): every durable one is a version, exported by this session
    assert first.exporter is not None and first.exporter.exported == repo.versions()
    assert {10, 11} <= set(repo.versions()) <= {5, 10, 11}
    second = session_run(tmp_path, master, 20)
    assert second.restored_from is not None and second.restored_from.endswith(":11")
    assert {10, 11, 20, 21} <= set(repo.versions()) <= {5, 10, 11, 15, 20, 21}
    kept = {c for c in (15, 20, 21) if (tmp_path / "ckpt" / f"step-{c:012d}" / "MANIFEST.json").exists()}
    assert {20, 21} <= kept
    for version in repo.versions():
        info, chain = repo.info(version), repo.chain(version)
        assert chain[0].kind == "base" and len(chain) <= 3 and all(i.kind == "delta" for i in chain[1:])
        assert info.reported["step"] in (version, version - 1) and np.isfinite(info.reported["loss"])
        if version in kept:  # the session keeps the newest 3 checkpoints: compare with those still on storage
            _manifest, state = checkpoint_state(str(tmp_path / "ckpt"), version)
            full = state["model"]["emb.weight"].numpy()  # type: ignore[index]
            assert read_tables(repo, version)["emb.weight"].tobytes() == full.tobytes()
