"""The model repository on local disk and on an fsspec filesystem: idempotent publish, chains, retention, retirement."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest

from streamrover.serving import BrokenChainError, ModelRepository, VersionInfo, read_tables
from streamrover.serving.api import DELTA_FILE, LINEAGE, MODEL_FILE, TABLES_FILE
from streamrover.serving.tables import delta_arrays, dump_arrays, load_arrays


def _publish(repo: ModelRepository, version: int, parent: int | None, table: np.ndarray, stamps: np.ndarray) -> bool:
    kind = "base" if parent is None else "delta"
    info = VersionInfo(version, kind, parent, None, {}, {}, None, tables={"t": {}})
    data = dump_arrays({"t": table}) if parent is None else dump_arrays(delta_arrays({"t": table}, {"t": stamps},
                                                                                     parent))  # fmt: skip
    return repo.publish(info, {MODEL_FILE: b"onnx", TABLES_FILE if parent is None else DELTA_FILE: data})


@pytest.fixture(params=["local", "memory"])
def repo(request: pytest.FixtureRequest, tmp_path: Path) -> ModelRepository:
    root = str(tmp_path / "repo") if request.param == "local" else f"memory://repo-{uuid.uuid4().hex[:8]}"
    return ModelRepository(root, "m")


def test_chains_rebuild_exactly_and_retention_keeps_what_chains_need(repo: ModelRepository) -> None:
    rng = np.random.default_rng(0)
    table = rng.standard_normal((100, 4)).astype(np.float32)
    stamps = np.zeros(100, dtype=np.int64)
    expected = {}
    parents = {1: None, 2: 1, 3: 2, 4: None, 5: 4}
    for version, parent in parents.items():
        rows = rng.choice(100, 7, replace=False)
        table[rows] += 1.0
        stamps[rows] = version
        assert _publish(repo, version, parent, table, stamps)
        expected[version] = table.copy()
    assert not _publish(repo, 3, 2, table, stamps), "a published version is never written again"
    for version in parents:
        assert read_tables(repo, version)["t"].tobytes() == expected[version].tobytes()
    assert len(load_arrays(repo.read(3, DELTA_FILE))["t.rows"]) == 7, "a delta holds only the touched rows"

    assert repo.apply_retention(3) == [], "version 3 is kept, and with it 1 and 2, its chain"
    assert repo.apply_retention(2) == [1, 2, 3]
    assert repo.versions() == [4, 5]
    assert repo.retire_after(4) == [5] and repo.versions() == [4]
    with pytest.raises(BrokenChainError, match="version 6 needs version 5"):
        info = VersionInfo(6, "delta", 5, 4, {}, {}, None)
        repo.publish(info, {MODEL_FILE: b"onnx", DELTA_FILE: dump_arrays({})})
        read_tables(repo, 6)


def test_a_cut_short_publish_is_invisible_and_cleaned(tmp_path: Path) -> None:
    repo = ModelRepository(str(tmp_path / "repo"), "m")
    half = tmp_path / "repo" / "m" / ".tmp-7-123-abcd"
    half.mkdir(parents=True)
    (half / MODEL_FILE).write_bytes(b"onnx")
    unfinished = tmp_path / "repo" / "m" / "8"
    unfinished.mkdir()
    (unfinished / MODEL_FILE).write_bytes(b"onnx")  # written in place (object-store style), lineage.json never came
    assert repo.versions() == []
    assert repo.clean_temporaries() == 1 and not half.exists()
    info = VersionInfo(8, "full", None, None, {}, {}, None)
    assert repo.publish(info, {MODEL_FILE: b"new"}) and repo.read(8, MODEL_FILE) == b"new"
    assert (unfinished / LINEAGE).exists()


def test_an_exporter_refuses_a_repository_name_another_job_exports_to(tmp_path: Path) -> None:
    from streamrover.serving import ExportConfig, ExportError, TorchExporter

    repo = ModelRepository(str(tmp_path / "repo"), "m")
    repo.publish(VersionInfo(7, "full", None, None, {"url": "/elsewhere/ckpt"}, {}, None), {MODEL_FILE: b"onnx"})
    exporter = TorchExporter(ExportConfig(str(tmp_path / "repo"), name="m"), str(tmp_path / "ckpt"), object, (),
                             input_names=[], output_names=[])  # fmt: skip
    with pytest.raises(ExportError, match="give this job its own export name"):
        exporter.start(0)
    assert repo.versions() == [7], "another job's versions are never retired"
