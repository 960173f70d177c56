"""Versions exported from durable checkpoints: exactly once across a SIGKILL, deltas exact across a restore.

Real processes: the trainer (tests/serving/trainer_proc.py) with its checkpoint saver process, SIGKILLed
between a checkpoint's durability and its export; versions checked against the checkpoints on storage and
served by onnxruntime.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from streamrover.ckpt import list_checkpoints, namespace_for, purge_shared_memory
from streamrover.ckpt.layout import read_manifest, read_part, step_dir
from streamrover.ckpt.storage import Storage
from streamrover.serving import ModelRepository, read_tables
from streamrover.serving.api import LINEAGE, MODEL_FILE
from tests.serving.trainer_proc import TinyCtr

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("trainer_proc.py")


@pytest.fixture
def dirs(tmp_path: Path) -> Iterator[tuple[str, str]]:
    ckpt, repo = str(tmp_path / "ckpt"), str(tmp_path / "repo")
    yield ckpt, repo
    purge_shared_memory(namespace_for(ckpt))


@pytest.fixture
def savers() -> Iterator[set[int]]:
    pids: set[int] = set()
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def train(ckpt: str, repo: str, savers: set[int], *args: str, killed: bool = False) -> dict[str, object]:
    """Run the trainer to its end (or its SIGKILL); what it printed. Its output goes to files, not pipes: the
    saver it starts inherits them and outlives it."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    logs = Path(ckpt).parent
    with open(logs / "stdout", "w+") as out_f, open(logs / "stderr", "w+") as err_f:
        proc = subprocess.run([sys.executable, str(SCRIPT), "--ckpt", ckpt, "--repo", repo, *args], env=env,
                              stdout=out_f, stderr=err_f, timeout=240)  # fmt: skip
        out_f.seek(0)
        err_f.seek(0)
        stdout, stderr = out_f.read(), err_f.read()
    out: dict[str, object] = {}
    for line in stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word == "saver" and int(rest):
            savers.add(int(rest))
        elif word in ("started", "exported"):
            out[word] = json.loads(rest)
        elif word in ("durable", "resumed"):
            out[word] = int(rest)
    expected = -signal.SIGKILL if killed else 0
    assert proc.returncode == expected, stderr[-3000:]
    return out


def checkpoint_state(ckpt: str, step: int) -> tuple[dict[str, object], dict[str, object]]:
    storage = Storage(ckpt)
    manifest = read_manifest(storage, step)
    _part, state, _cursor = read_part(storage, manifest, 0)
    return manifest, state


def served_logits(repo: ModelRepository, version: int, ids: np.ndarray) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    session = ort.InferenceSession(repo.read(version, MODEL_FILE), opts)
    return np.asarray(session.run(None, {"ids": ids, **read_tables(repo, version)})[0])


def test_sigkill_between_durability_and_export_publishes_once_with_lineage(dirs: tuple[str, str],
                                                                            savers: set[int]) -> None:  # fmt: skip
    ckpt, repo_root = dirs
    first = train(ckpt, repo_root, savers, "--steps", "30", "--kill-at", "20", killed=True)
    assert first["durable"] == 20
    repo = ModelRepository(repo_root, "tiny")
    durable = {c.step for c in list_checkpoints(ckpt) if c.complete}
    assert 20 in durable and 20 not in repo.versions(), "killed before exporting 20: no version of it yet"
    assert set(repo.versions()) <= durable
    before = repo.versions()  # what the killed trainer published (its export of 10 may have been cut short)

    second = train(ckpt, repo_root, savers, "--steps", "40")
    assert second["resumed"] == 20
    assert 20 in second["started"], "the restarted trainer exports the durable checkpoint left without a version"
    assert repo.versions() == [10, 20, 30, 40]
    published = [*before, *second["exported"]]  # type: ignore[misc]
    assert sorted(published) == sorted(set(published)), f"a version was published twice: {published}"
    infos = {c.step: c for c in list_checkpoints(ckpt)}
    for version in repo.versions():
        info = repo.info(version)
        manifest, state = checkpoint_state(ckpt, version)
        assert infos[version].complete, "no version without its durable checkpoint"
        assert info.lineage == infos[version].lineage and info.cursor == manifest["cursor"]
        assert info.lineage["learned"][0]["ranges"] == [[0, 10 * version]]
        assert info.checkpoint["cut_ids"] == manifest["cut_ids"] and "loss" in info.reported
        ids = np.arange(48, dtype=np.int64).reshape(16, 3) * 5
        model = TinyCtr()
        model.load_state_dict(state["model"])  # type: ignore[arg-type]
        with torch.no_grad():
            expected = model(torch.from_numpy(ids)).numpy()
        np.testing.assert_allclose(served_logits(repo, version, ids), expected, rtol=0, atol=1e-5)
    assert not [e for e in os.listdir(repo.model_dir) if e.startswith(".")], "no temporary left behind"


def test_base_plus_deltas_equal_full_tables_across_restore_from_older_checkpoint(dirs: tuple[str, str],
                                                                                 savers: set[int]) -> None:  # fmt: skip
    ckpt, repo_root = dirs
    train(ckpt, repo_root, savers, "--steps", "60", "--base-every", "4")
    repo = ModelRepository(repo_root, "tiny")
    kinds = {v: repo.info(v).kind for v in repo.versions()}
    assert kinds == {10: "base", 20: "delta", 30: "delta", 40: "delta", 50: "base", 60: "delta"}
    abandoned = {v: read_tables(repo, v)["emb.weight"] for v in (40, 50, 60)}
    for step in (40, 50, 60):  # the newest checkpoints are lost: the next trainer resumes from 30
        shutil.rmtree(os.path.join(ckpt, step_dir(step)))
    purge_shared_memory(namespace_for(ckpt))
    again = train(ckpt, repo_root, savers, "--steps", "70", "--base-every", "4", "--timeline", "1",
                  "--from-storage")  # fmt: skip
    assert again["resumed"] == 30 and again["exported"] == [40, 50, 60, 70]
    infos = {v: repo.info(v) for v in repo.versions()}
    assert {v: i.kind for v, i in infos.items()} == {10: "base", 20: "delta", 30: "delta", 40: "delta",
                                                     50: "base", 60: "delta", 70: "delta"}  # fmt: skip
    assert infos[40].parent == 30, "the first delta after the restore applies to the version it resumed from"
    for version in repo.versions():
        _manifest, state = checkpoint_state(ckpt, version)
        full = state["model"]["emb.weight"].numpy()  # type: ignore[index]
        rebuilt = read_tables(repo, version)["emb.weight"]
        assert rebuilt.dtype == full.dtype and rebuilt.tobytes() == full.tobytes(), f"version {version} differs"
        if version in abandoned:
            assert rebuilt.tobytes() != abandoned[version].tobytes(), "the new timeline's version replaced the old"
    delta = repo.read(40, "delta.safetensors")
    base = repo.read(50, "tables.safetensors")
    assert len(delta) < len(base) / 2, f"a delta ({len(delta)} B) carries only touched rows (base {len(base)} B)"
    assert os.path.exists(os.path.join(repo.model_dir, "config.pbtxt"))
    assert all(os.path.exists(os.path.join(repo.model_dir, str(v), LINEAGE)) for v in repo.versions())
