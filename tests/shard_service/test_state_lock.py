"""One master per state directory (issue 15, item 7): a second one refuses to start, naming the first."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from streamrover.shard_service.api import FailedPreconditionError
from streamrover.shard_service.master import MasterServer
from streamrover.testing.procs import MasterProcess, python_env


def _second_master(state: Path) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "streamrover.cli", "master", "--state-dir", str(state), "--port", "0",
           "--token", "t"]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=python_env())


def test_a_second_master_on_the_same_state_dir_refuses_to_start(master: MasterProcess) -> None:
    assert master.proc is not None
    second = _second_master(master.state_dir)
    try:
        out, _ = second.communicate(timeout=60)  # today it starts and serves: this times out
    except subprocess.TimeoutExpired:
        second.kill()
        out, _ = second.communicate()
        raise AssertionError(f"the second master did not refuse to start: {out}") from None
    assert second.returncode != 0, out
    assert "listening" not in out, out
    assert str(master.state_dir) in out and f"pid {master.proc.pid}" in out, out

    master.kill()  # the lock dies with its holder, even by SIGKILL: a restart on the same dir works
    master.start()


def test_the_lock_holds_within_one_process_too(tmp_path: Path) -> None:
    first = MasterServer(tmp_path / "state", "token")
    try:
        with pytest.raises(FailedPreconditionError, match="another master"):
            MasterServer(tmp_path / "state", "token")
    finally:
        first.stop()
    MasterServer(tmp_path / "state", "token").stop()  # released by stop()
