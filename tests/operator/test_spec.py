"""The job spec: a good spec parses with its defaults; a bad one is refused naming each bad field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from streamrover.operator.spec import SCHEMA_PATH, SpecError, load_spec, parse_memory, schema_text
from streamrover.testing.procs import python_env

GOOD = """\
name: ledger
datasets:
  - name: stream
    uri: kafka://127.0.0.1:9092/clicks
    records_per_shard: 2000
    options: {sr.format: json, sr.max_delay_ms: 200, sr.strict: true}
trainer:
  script: train.py
  args: [--records, 1000]
  nproc_per_node: 2
  nodes: "1:3"
  memory: 1.5Gi
  cpu: 500m
checkpoint: {url: ckpt, every_steps: 10}
restart: {per_job: 4, oom: {factor: 2, max_memory: 4Gi}}
autoscaling: {target_lag_records: 5000, max_nodes: 2}
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_a_good_spec_parses_with_paths_resolved_and_defaults(tmp_path: Path) -> None:
    spec = load_spec(_write(tmp_path, GOOD))
    assert spec.name == "ledger"
    assert spec.datasets[0].options == {"sr.format": "json", "sr.max_delay_ms": "200", "sr.strict": "true"}
    assert spec.trainer.script == str(tmp_path / "train.py") and spec.trainer.args == ["--records", "1000"]
    assert (spec.trainer.nodes.min, spec.trainer.nodes.max) == (1, 3)
    assert spec.trainer.memory == 3 * 2**29 and spec.trainer.cpu == 0.5
    assert spec.checkpoint.url == str(tmp_path / "ckpt") and spec.checkpoint.keep_last == 3
    assert spec.scale_bounds == (1, 2) and spec.memory_ceiling == 4 * 2**30
    assert spec.restart.per_node == 3 and spec.master.port == 0 and spec.master.state_dir is None


def test_a_relative_dataset_path_resolves_against_the_spec_file_like_the_script(tmp_path: Path) -> None:
    # the master and the nodes run in directories of their own: a relative path must not depend on theirs
    text = GOOD.replace("uri: kafka://127.0.0.1:9092/clicks", "uri: data/*.parquet")
    spec = load_spec(_write(tmp_path, text))
    assert spec.datasets[0].uri == str(tmp_path / "data" / "*.parquet")
    assert load_spec(_write(tmp_path, GOOD)).datasets[0].uri == "kafka://127.0.0.1:9092/clicks"
    raw = load_spec(_write(tmp_path, text), resolve=False)  # what --platform k8s reads (shipped or refused there)
    assert raw.datasets[0].uri == "data/*.parquet" and raw.trainer.script == "train.py"


@pytest.mark.parametrize(
    ("change", "field", "message"),
    [
        (("name: ledger", "name: Ledger_1"), "name", "not a DNS label"),
        (("    records_per_shard: 2000", "    records_per_shard: -1"), "datasets[0].records_per_shard", "greater"),
        (("    records_per_shard: 2000", "    recods_per_shard: 1"), "datasets[0].recods_per_shard", "unknown field"),
        (('  nodes: "1:3"', '  nodes: "3:1"'), "trainer.nodes", "MIN 3 is more than MAX 1"),
        (('  nodes: "1:3"', "  nodes: many"), "trainer.nodes", "not MIN:MAX"),
        (("  memory: 1.5Gi", "  memory: 2Xi"), "trainer.memory", "not a memory size"),
        (("  script: train.py\n", ""), "trainer.script", "required field missing"),
        (("max_nodes: 2", "max_nodes: 7"), "(top level)", "autoscaling.max_nodes 7 is outside trainer.nodes 1:3"),
        (("target_lag_records: 5000", "cooldown_seconds: 5"), "autoscaling", "exactly one of target_lag_records"),
        (("max_memory: 4Gi", "max_memory: 1Gi"), "(top level)", "restart.oom.max_memory 1Gi is below"),
        (("factor: 2", "factor: 0.5"), "restart.oom.factor", "greater than 1"),
    ],
)
def test_a_bad_spec_names_the_field(tmp_path: Path, change: tuple[str, str], field: str, message: str) -> None:
    old, new = change
    assert old in GOOD
    with pytest.raises(SpecError) as caught:
        load_spec(_write(tmp_path, GOOD.replace(old, new)))
    problems = dict(caught.value.problems)
    assert field in problems, caught.value
    assert message in problems[field], caught.value
    assert f"  {field}: " in str(caught.value)


def test_yaml_errors_and_missing_files_say_where(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="line 3, column 1: not valid YAML"):
        load_spec(_write(tmp_path, "name: x\ndatasets: [\n"))
    with pytest.raises(SpecError, match="cannot read it"):
        load_spec(tmp_path / "absent.yaml")
    with pytest.raises(SpecError, match="must be a mapping"):
        load_spec(_write(tmp_path, "- a list\n"))


def test_memory_quantities() -> None:
    assert parse_memory("512Mi") == 512 * 2**20 and parse_memory("2G") == 2 * 10**9 and parse_memory(1024) == 1024
    with pytest.raises(ValueError, match="not a memory size"):
        parse_memory("lots")


def test_the_export_section_reaches_the_trainers_config(tmp_path: Path) -> None:
    from streamrover.operator.supervisor import EXPORT_ENV
    from streamrover.serving import ExportConfig

    spec = load_spec(_write(tmp_path, GOOD + "export: {repository: models, name: ctr, base_every: 4}\n"))
    assert spec.export is not None and spec.export.repository == str((tmp_path / "models").resolve())
    config = ExportConfig.from_env({EXPORT_ENV: spec.export.model_dump_json()})
    assert config == ExportConfig(str((tmp_path / "models").resolve()), name="ctr", keep_last=5, base_every=4)
    assert ExportConfig.from_env({}) is None
    with pytest.raises(SpecError, match="export.base_every"):
        load_spec(_write(tmp_path, GOOD + "export: {repository: models, base_every: 0}\n"))


def test_the_committed_schema_is_the_models() -> None:
    """jobspec.schema.json is generated from the model: regenerate with python -m streamrover.operator.spec --schema."""
    assert SCHEMA_PATH.read_text() == schema_text()
    schema = json.loads(SCHEMA_PATH.read_text())
    assert {"name", "datasets", "trainer"} <= set(schema["required"])
    assert schema["additionalProperties"] is False


def test_run_refuses_a_bad_spec_naming_the_field(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD.replace("  nproc_per_node: 2", "  nproc_per_node: 0"))
    env = {**python_env(), "STREAMROVER_HOME": str(tmp_path / "home"), "COLUMNS": "200"}
    done = subprocess.run([sys.executable, "-m", "streamrover.cli", "run", str(path)], capture_output=True, text=True,
                          env=env, timeout=60)  # fmt: skip
    assert done.returncode == 2, done
    assert "trainer.nproc_per_node: Input should be greater than or equal to 1" in done.stdout
    assert not (tmp_path / "home" / "jobs").exists(), "nothing is started for a refused spec"
