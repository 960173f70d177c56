"""The TF-PS contract without TensorFlow: cluster specs, the chief's environment, launcher input errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamrover.trainers.tensorflow.api import ClusterConfigError, ClusterSpec, TrainerEnv
from streamrover.trainers.tensorflow.launcher import LaunchConfig, main


def test_cluster_spec_round_trips_and_names_bad_input() -> None:
    spec = ClusterSpec("127.0.0.1:1", ["127.0.0.1:2", "127.0.0.1:3"], ["127.0.0.1:4"])
    assert ClusterSpec.from_json(spec.to_json()) == spec
    assert spec.as_tf() == {"chief": ["127.0.0.1:1"], "ps": ["127.0.0.1:2", "127.0.0.1:3"], "worker": ["127.0.0.1:4"]}
    with pytest.raises(ClusterConfigError, match="at least one ps"):
        ClusterSpec("127.0.0.1:1", [], ["127.0.0.1:4"])
    with pytest.raises(ClusterConfigError, match="'nohost' is not HOST:PORT"):
        ClusterSpec("127.0.0.1:1", ["nohost"], ["127.0.0.1:4"])
    with pytest.raises(ClusterConfigError, match="share an address"):
        ClusterSpec("127.0.0.1:1", ["127.0.0.1:1"], ["127.0.0.1:4"])
    with pytest.raises(ClusterConfigError, match="unknown task types"):
        ClusterSpec.from_json('{"chief": ["a:1"], "ps": ["a:2"], "worker": ["a:3"], "evaluator": ["a:4"]}')
    with pytest.raises(ClusterConfigError, match="not JSON"):
        ClusterSpec.from_json("{")


def test_trainer_env_round_trips_and_says_how_to_launch() -> None:
    spec = ClusterSpec("127.0.0.1:1", ["127.0.0.1:2"], ["127.0.0.1:4"])
    env = TrainerEnv(spec, "127.0.0.1:7070", "tok", "/ckpt", "job1", "/tmp/events")
    assert TrainerEnv.from_env(env.to_env()) == env
    with pytest.raises(ClusterConfigError, match="tf-ps-run"):
        TrainerEnv.from_env({})


def test_launcher_rejects_bad_settings(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(ClusterConfigError, match="--ps must be >= 1"):
        LaunchConfig(str(script), [], 0, 1, "127.0.0.1:1", "", str(tmp_path))
    with pytest.raises(ClusterConfigError, match="does not exist"):
        LaunchConfig(str(tmp_path / "missing.py"), [], 1, 1, "127.0.0.1:1", "", str(tmp_path))
    with pytest.raises(SystemExit, match="--shard-service"):
        main(["--ckpt-dir", str(tmp_path), str(script)])
