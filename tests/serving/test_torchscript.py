"""TorchScript versions (``model.pt``): loaded back with ``torch.jit.load``, they predict as their checkpoint."""

from __future__ import annotations

import io
from pathlib import Path

import torch

from streamrover.ckpt import Checkpointer, RetentionPolicy, namespace_for, purge_shared_memory
from streamrover.ckpt.torch_adapter import TorchCheckpoint
from streamrover.serving import ExportConfig, ModelRepository, RowTracker, read_tables
from streamrover.serving.tables import TOUCHED_KEY
from streamrover.serving.torchscript import TORCHSCRIPT_FILE, TorchScriptExporter
from tests.serving.test_export import checkpoint_state
from tests.serving.trainer_proc import FIELDS, TinyCtr, batch_at


def test_torchscript_versions_load_back_and_predict_as_their_checkpoints(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    torch.manual_seed(0)
    model = TinyCtr()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    tracker = RowTracker(model)
    exporter = TorchScriptExporter(ExportConfig(str(tmp_path / "repo"), name="tiny", base_every=3), ckpt, TinyCtr,
                                   (torch.zeros(1, FIELDS, dtype=torch.int64),), input_names=["ids"],
                                   output_names=["logit"], tables=tracker.params)  # fmt: skip
    checkpointer = Checkpointer(ckpt, saver="thread", retention=RetentionPolicy(keep_last=5),
                                on_durable=exporter.on_durable)  # fmt: skip
    try:
        exporter.start(0)
        for step in range(1, 7):
            ids, labels = batch_at(step, 0)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(ids), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            tracker.step_done(step)
            if step % 2 == 0:
                TorchCheckpoint(checkpointer, model, optimizer).save(step, extra={TOUCHED_KEY: tracker.state()})
                checkpointer.wait(timeout=60)
        exporter.close()
    finally:
        checkpointer.close()
        purge_shared_memory(namespace_for(ckpt))
    repo = ModelRepository(str(tmp_path / "repo"), "tiny")
    assert [(v, repo.info(v).kind) for v in repo.versions()] == [(2, "base"), (4, "delta"), (6, "delta")]
    assert 'platform: "pytorch_libtorch"' in (tmp_path / "repo" / "tiny" / "config.pbtxt").read_text()
    ids = torch.arange(48, dtype=torch.int64).reshape(16, 3) * 5
    for version in repo.versions():
        served = torch.jit.load(io.BytesIO(repo.read(version, TORCHSCRIPT_FILE)))
        tables = read_tables(repo, version)
        _manifest, state = checkpoint_state(ckpt, version)
        expected_model = TinyCtr()
        expected_model.load_state_dict(state["model"])  # type: ignore[arg-type]
        with torch.no_grad():
            got = served(ids, *(torch.from_numpy(tables[t]) for t in repo.info(version).inputs[1:]))
            assert torch.equal(got, expected_model(ids)), f"version {version} predicts as its checkpoint"
            zeros = served(ids, *(torch.zeros(tables[t].shape) for t in repo.info(version).inputs[1:]))
            assert not torch.equal(zeros, got), "the tables are inputs of the module, not constants"
