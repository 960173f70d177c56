"""The ``streamrover`` command against a real master."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from streamrover.testing.procs import MasterProcess, python_env
from tests.helpers import write_parquet_dataset


def _cli(master: MasterProcess, *args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "streamrover.cli", *args, "--master", master.address, "--token", token or master.token]
    env = {**python_env(), "COLUMNS": "200"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)


def test_dataset_add_list_describe_status(tmp_path: Path, master: MasterProcess) -> None:
    write_parquet_dataset(tmp_path / "data", 5_000, files=2, row_group_size=1_000)
    added = _cli(
        master, "dataset", "add", "clicks", str(tmp_path / "data"), "--records-per-shard", "400", "--epochs", "2"
    )
    assert added.returncode == 0, added.stderr
    assert "registered" in added.stdout and "clicks" in added.stdout
    again = _cli(
        master, "dataset", "add", "clicks", str(tmp_path / "data"), "--records-per-shard", "400", "--epochs", "2"
    )
    assert "already registered" in again.stdout
    listed = _cli(master, "dataset", "list")
    assert listed.returncode == 0 and "clicks" in listed.stdout and "5,000" in listed.stdout
    described = _cli(master, "dataset", "describe", "clicks", "--json")
    info = json.loads(described.stdout)
    assert info["spec"]["recordsPerShard"] == "400" and len(info["partitions"]) == 6
    status = _cli(master, "status")
    assert status.returncode == 0 and "records/s" in status.stdout and "clicks" in status.stdout


def test_cli_errors_are_clear(tmp_path: Path, master: MasterProcess) -> None:
    missing = _cli(master, "dataset", "add", "x", str(tmp_path / "nothing.parquet"))
    assert missing.returncode == 2 and "does not exist" in missing.stdout
    denied = _cli(master, "dataset", "list", token="wrong")
    assert denied.returncode == 2 and "token" in denied.stdout
    unknown = _cli(master, "dataset", "describe", "ghost")
    assert unknown.returncode == 2 and "not registered" in unknown.stdout
    not_there = _cli(master, "dataset", "resume", "ghost")
    assert not_there.returncode == 2 and "'ghost' is not registered" in not_there.stdout


def test_master_creates_a_private_token_file(tmp_path: Path) -> None:
    state = tmp_path / "state"
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamrover.cli", "master", "--state-dir", str(state), "--port", "0"],
        stdout=subprocess.PIPE, text=True, env=python_env(),
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on 127.0.0.1:" in line
        token_file = state / "token"
        assert token_file.stat().st_mode & 0o077 == 0, "the token file must be private to its owner"
        assert len(token_file.read_text().strip()) >= 24
    finally:
        proc.terminate()
        proc.wait(timeout=10)
