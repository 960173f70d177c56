"""The flagship's DeepFM (examples/streaming_ctr/model.py: hashed ids, 12 EmbeddingBag tables) through the exporter:
each version served by onnxruntime (base + deltas fed as inputs) predicts what the checkpoint's torch model does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from examples.streaming_ctr.clickstream import CATEGORICAL, NUMERIC
from examples.streaming_ctr.model import DeepFM
from streamrover.ckpt import Checkpointer, RetentionPolicy, namespace_for, purge_shared_memory
from streamrover.ckpt.torch_adapter import TorchCheckpoint
from streamrover.serving import ExportConfig, ModelRepository, RowTracker, TorchExporter, read_tables
from streamrover.serving.api import MODEL_FILE
from streamrover.serving.tables import TOUCHED_KEY
from tests.serving.test_export import checkpoint_state

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")


@pytest.mark.parametrize("adam", [False, True], ids=["adagrad", "adam-sticky"])
def test_deepfm_versions_predict_as_their_checkpoints(tmp_path: Path, adam: bool) -> None:
    """Adagrad moves only looked-up rows; Adam (the demo's optimizer) keeps moving every row it saw: sticky."""
    ckpt_url, repo_root = str(tmp_path / "ckpt"), str(tmp_path / "repo")
    torch.manual_seed(0)
    model = DeepFM()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01) if adam else torch.optim.Adagrad(model.parameters(),
                                                                                               lr=0.05)  # fmt: skip
    tracker = RowTracker(model, sticky=adam)
    tracker.check_optimizer(optimizer)
    example = (torch.zeros(1, len(CATEGORICAL), dtype=torch.int64), torch.zeros(1, len(NUMERIC)))
    exporter = TorchExporter(ExportConfig(repo_root, name="ctr", base_every=2), ckpt_url, DeepFM, example,
                             input_names=["cats", "nums"], output_names=["logit"], tables=tracker.params)  # fmt: skip
    checkpointer = Checkpointer(ckpt_url, saver="thread", retention=RetentionPolicy(keep_last=10),
                                on_durable=exporter.on_durable)  # fmt: skip
    ckpt = TorchCheckpoint(checkpointer, model, optimizer)
    gen = torch.Generator().manual_seed(1)
    try:
        for step in range(1, 16):
            cats = torch.randint(0, 1 << 40, (64, len(CATEGORICAL)), generator=gen)
            nums, y = torch.randn(64, len(NUMERIC), generator=gen), (torch.rand(64, generator=gen) < 0.2).float()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(cats, nums), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            tracker.step_done(step)
            if step % 5 == 0:
                ckpt.save(step, extra={TOUCHED_KEY: tracker.state()})
                checkpointer.wait(timeout=60)
        exporter.close()
    finally:
        checkpointer.close()
        purge_shared_memory(namespace_for(ckpt_url))
    repo = ModelRepository(repo_root, "ctr")
    assert repo.versions() == [5, 10, 15] and [repo.info(v).kind for v in (5, 10, 15)] == ["base", "delta", "base"]
    cats = torch.randint(0, 1 << 40, (32, len(CATEGORICAL)), generator=gen)
    nums = torch.randn(32, len(NUMERIC), generator=gen)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    for version in repo.versions():
        session = ort.InferenceSession(repo.read(version, MODEL_FILE), opts)
        served = session.run(None, {"cats": cats.numpy(), "nums": nums.numpy(), **read_tables(repo, version)})[0]
        reference = DeepFM()
        reference.load_state_dict(checkpoint_state(ckpt_url, version)[1]["model"])  # type: ignore[arg-type]
        with torch.no_grad():
            expected = reference(cats, nums).numpy()
        np.testing.assert_allclose(served, expected, rtol=0, atol=1e-5)
        state = checkpoint_state(ckpt_url, version)[1]["model"]
        tables = read_tables(repo, version)
        assert all(tables[t].tobytes() == state[t].numpy().tobytes() for t in tracker.params)  # type: ignore[index]


def test_a_model_without_tracked_tables_is_one_self_contained_onnx_file(tmp_path: Path) -> None:
    ckpt_url, repo_root = str(tmp_path / "ckpt"), str(tmp_path / "repo")
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    exporter = TorchExporter(ExportConfig(repo_root, name="mlp", keep_last=2), ckpt_url,
                             lambda: torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)),
                             (torch.zeros(1, 3),), input_names=["x"], output_names=["y"])  # fmt: skip
    checkpointer = Checkpointer(ckpt_url, saver="thread", on_durable=exporter.on_durable)
    ckpt = TorchCheckpoint(checkpointer, model)
    try:
        for step in (1, 2, 3):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.1 * step)
            ckpt.save(step)
            checkpointer.wait(timeout=60)
        exporter.close()
    finally:
        checkpointer.close()
        purge_shared_memory(namespace_for(ckpt_url))
    repo = ModelRepository(repo_root, "mlp")
    assert repo.versions() == [2, 3], "keep_last=2"
    x = torch.randn(5, 3)
    for version in repo.versions():
        assert repo.info(version).kind == "full" and read_tables(repo, version) == {}
        session = ort.InferenceSession(repo.read(version, MODEL_FILE))
        reference = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        reference.load_state_dict(checkpoint_state(ckpt_url, version)[1]["model"])  # type: ignore[arg-type]
        with torch.no_grad():
            np.testing.assert_allclose(session.run(None, {"x": x.numpy()})[0], reference(x).numpy(), atol=1e-5)
    config = (tmp_path / "repo" / "mlp" / "config.pbtxt").read_text()
    assert config.startswith('name: "mlp"\nplatform: "onnxruntime_onnx"')
