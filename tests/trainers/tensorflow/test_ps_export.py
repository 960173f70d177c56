"""The TF-PS path to serving: ``PSTrainer(exporter=SavedModelExporter(...))`` under ``streamrover tf-ps-run``.

A real job (a master, 2 parameter servers with the embedding sharded over both, 1 worker, a parquet dataset)
exports every durable checkpoint as ``NAME/STEP/model.savedmodel``: each version's lineage is its checkpoint's
cursor, and the SavedModel, loaded by TensorFlow as a server would, predicts what the checkpoint's variables
(the sharded embedding's parts put back together) give. The export section reaches the chief as the job spec's
``export:`` does under ``streamrover run``: the supervisor's ``STREAMROVER_EXPORT``, passed on by tf-ps-run.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from streamrover.operator.spec import ExportSpec
from streamrover.operator.supervisor import EXPORT_ENV
from streamrover.serving import ModelRepository
from streamrover.serving.savedmodel import SAVEDMODEL_DIR
from tests.serving.test_export import checkpoint_state
from tests.trainers.tensorflow.test_ps_failures import _job

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="tensorflow-cpu is not installed"),
]
RECORDS = 8_000
BUCKETS = 2048


def test_ps_job_exports_each_durable_checkpoint_as_a_savedmodel_with_its_lineage(tmp_path: Path) -> None:
    import tensorflow as tf

    job = _job(tmp_path, records=RECORDS)
    repo_root = tmp_path / "models"
    try:
        # the job spec's export: section as the supervisor hands it to every trainer command (STREAMROVER_EXPORT):
        # tf-ps-run passes it on to the chief, whose script builds its exporter from it (ExportConfig.from_env)
        section = ExportSpec(repository=str(repo_root), name="ledger", keep_last=100)
        job.start(ps=2, workers=1, script_args=["--records", str(RECORDS), "--ckpt-every", "10"],
                  env={EXPORT_ENV: section.model_dump_json()})  # fmt: skip
        assert job.wait(timeout=240) == 0, job.logs()
    finally:
        job.stop()
    repo = ModelRepository(str(repo_root), "ledger")
    versions = repo.versions()
    assert len(versions) >= 3, (versions, job.logs())
    config = (repo_root / "ledger" / "config.pbtxt").read_text()
    assert 'platform: "tensorflow_savedmodel"' in config
    x = np.linspace(-1, 1, 16, dtype=np.float32)
    ids = np.arange(16, dtype=np.int64) * 131
    kept = [v for v in versions if (job.ckpt / f"step-{v:012d}" / "MANIFEST.json").exists()]
    assert kept and kept[-1] == versions[-1], (versions, kept)
    for version in kept[-2:]:  # the versions whose checkpoints retention kept
        info = repo.info(version)
        manifest, state = checkpoint_state(str(job.ckpt), version)
        assert info.kind == "full" and info.cursor == manifest["cursor"] and info.lineage == manifest["lineage"]
        served = tf.saved_model.load(str(repo_root / "ledger" / str(version) / SAVEDMODEL_DIR))
        y = served.signatures["serving_default"](x=tf.constant(x), id=tf.constant(ids))["y"].numpy()
        v = state["vars"]  # type: ignore[index]
        emb = np.concatenate([v[f"model/emb/part_{i}"] for i in range(2)])
        expected = v["model/w"] * x + v["model/b"] + emb[ids % BUCKETS].sum(axis=1)
        np.testing.assert_allclose(y, expected, rtol=0, atol=1e-5)
    assert json.loads((repo_root / "ledger" / str(versions[-1]) / "lineage.json").read_text())["lineage"]["positions"]
